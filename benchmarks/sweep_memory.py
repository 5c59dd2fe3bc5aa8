"""Benchmark: how much a sweep's process grows per job (basic launcher, simulated runs).

Usage: python benchmarks/sweep_memory.py [--jobs 50 500] [--launcher basic]
Runs `python -m experiments.run -m workload.seed=0,...,N-1` (tiny model, 8 synthetic prompts a
run) once per N, each in a fresh process, and reads the process's peak RSS. The growth per job
is the difference of two sweeps' peaks over their difference in jobs, so the interpreter's and
the first run's fixed cost (imports, Hydra) cancel out.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = ["backend=sim", "workload=synthetic", "workload.num_prompts=8", "model=tiny",
       "hardware=cpu", "overhead=none", "progress=false"]


def sweep_peak_mb(jobs: int, launcher: str) -> tuple[float, float]:
    """The peak RSS (MB) and wall seconds of one sweep of ``jobs`` runs."""
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "experiments.run", "-m", *RUN, f"hydra/launcher={launcher}",
               f"hydra.sweep.dir={d}/sweep", "workload.seed=" + ",".join(map(str, range(jobs)))]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        err = proc.stderr.read()
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage (not all children's)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            sys.exit(f"the {jobs}-job sweep failed: {err.decode()[-500:]}")
        return usage.ru_maxrss / 1024, wall  # ru_maxrss: KB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--jobs", type=int, nargs=2, default=[50, 500], metavar=("FEW", "MANY"))
    ap.add_argument("--launcher", default="basic", help="basic (in-process jobs) or joblib")
    args = ap.parse_args()
    few, many = sorted(args.jobs)
    peak_few, wall_few = sweep_peak_mb(few, args.launcher)
    peak_many, wall_many = sweep_peak_mb(many, args.launcher)
    print(f"{few:>4} jobs: peak RSS {peak_few:7.1f} MB ({wall_few:.0f} s)")
    print(f"{many:>4} jobs: peak RSS {peak_many:7.1f} MB ({wall_many:.0f} s)")
    print(f"growth: {1024 * (peak_many - peak_few) / (many - few):.1f} KB per job "
          f"({args.launcher} launcher)")


if __name__ == "__main__":
    main()
