"""Setup of every test: one OpenMP thread per process, the tests' and the commands they start."""

from __future__ import annotations

import os

# The tests run in a worker process per core (pytest-xdist) and many start commands of their
# own (runs, servers, tensor-parallel ranks): with OpenMP's default of a thread per core in each
# process, the threads spin against each other's processes, and the tiny model's matmuls gain
# nothing from them (on a 2-core machine the README's real-backend CPU run took 25 s of CPU
# instead of 5). Set before any test imports torch, and inherited by every command a test
# starts; a value set from outside is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

