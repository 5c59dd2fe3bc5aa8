"""Setup of every test: one OpenMP thread per process (the tests' and the commands they start),
and the objects that outlive a test frozen out of garbage collection."""

from __future__ import annotations

import gc
import os

import pytest

# The tests run in a worker process per core (pytest-xdist) and many start commands of their
# own (runs, servers, tensor-parallel ranks): with OpenMP's default of a thread per core in each
# process, the threads spin against each other's processes, and the tiny model's matmuls gain
# nothing from them (on a 2-core machine the README's real-backend CPU run took 25 s of CPU
# instead of 5). Set before any test imports torch, and inherited by every command a test
# starts; a value set from outside is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")


# Every real-backend run collects garbage (real_backend/engine.py), and a full collection scans
# every object the test process holds: in a worker that has collected the whole suite, ~380k
# objects and 0.2 s or more a collection. What is alive after a full collection is frozen, so
# that the next collections pass over it (freezing is a constant-time list splice). A run's
# serve_source leaves a process that froze objects of its own to its own freezing, so a test's
# run no longer unfreezes the worker and scans it all at its end. What was frozen alive and dies
# in a reference cycle stays frozen: once the worker has grown by RECLAIM_BYTES since the last
# time, everything is unfrozen and collected after the test (one full scan), then frozen again.
def _freeze_after_a_full_collection(phase: str, info: dict) -> None:
    if phase == "stop" and info["generation"] == 2:
        gc.freeze()


RECLAIM_BYTES = 512 << 20
_reclaimed_at = [0]  # the worker's resident bytes after the last reclaim


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    if _resident_bytes() > _reclaimed_at[0] + RECLAIM_BYTES:
        gc.unfreeze()
        gc.collect()  # (the callback freezes what is alive)
        _reclaimed_at[0] = _resident_bytes()


def pytest_configure(config: pytest.Config) -> None:
    # Hypothesis looks for its PRNG's referrers with gc.get_referrers, which does not see frozen
    # objects: its warning that nothing refers to the PRNG is then wrong.
    config.addinivalue_line("filterwarnings", "ignore:It looks like `register_random` was "
                            "passed an object:hypothesis.errors.HypothesisWarning")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules that hold a slow test run first, each module's tests kept together and in
    order (a module's shared engine or server is started once). The workers take tests in
    collection order and an idle one takes the rest of another's queue, so the long tests are
    spread over both workers early; one left to start last kept a worker busy for its whole
    length while the other had nothing left to take. Only the order changes: every test runs."""
    def module(item: pytest.Item) -> str:
        return item.nodeid.split("::", 1)[0]

    slow: dict[str, bool] = {}
    for item in items:
        slow[module(item)] = slow.get(module(item), False) or bool(item.get_closest_marker("slow"))
    rank = {name: (not has_slow, i) for i, (name, has_slow) in enumerate(slow.items())}
    items.sort(key=lambda item: rank[module(item)])


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.callbacks.append(_freeze_after_a_full_collection)
    gc.collect()


def pytest_unconfigure(config: pytest.Config) -> None:
    # the interpreter's last collection at exit, over everything (a frozen object is never
    # finalised: nanobind, Triton's bindings, reports each one as leaked)
    if _freeze_after_a_full_collection in gc.callbacks:
        gc.callbacks.remove(_freeze_after_a_full_collection)
    gc.unfreeze()
