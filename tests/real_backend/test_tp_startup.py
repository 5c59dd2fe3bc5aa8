"""A worker rank that dies before it joins the group ends the run at once, in one line: rank 0
joins the rendezvous only after every worker has started, and the rendezvous would otherwise
wait for the dead rank as long as the group's timeout (30 minutes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from test_tensor_parallel import ROOT, TP_RUN, _worker_pids


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_worker_killed_while_it_starts_ends_the_run(tmp_path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([*TP_RUN, f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (workers := _worker_pids(proc.pid)):  # spawned, still importing
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        os.kill(workers[0], signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert (proc.returncode, err) == (
        2, "error: tensor-parallel rank 1 was killed by SIGKILL during the run\n")
    assert not list(tmp_path.glob("schedlab-tp-*"))
