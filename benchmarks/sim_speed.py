"""Benchmark: the simulator's wall time and peak memory, end to end, as a user runs it.

Usage: python benchmarks/sim_speed.py [--big N] [--cases NAME ...]
Each case is one ``python -m experiments.run`` process under ``/usr/bin/time -v`` (wall time
from start to exit, Hydra and the imports included, and the peak RSS), with the main
configuration (llama3_8b, h100_sxm, vllm_v0_5, multi_step k=8); the ShareGPT token-count cache
is built first so it is not timed. The issue-34 targets, on a 2-core machine:

- ``synthetic-1M``: N synthetic requests at t=0 on one replica, metrics.save_per_request=false
  (target: 15 s, 1 GB);
- ``cluster16-1M``: the same requests at Poisson 800 req/s (80% of 16 replicas' capacity) on
  16 replicas behind least_outstanding (target: 60 s, 1.5 GB);
- ``synthetic-1M-per-request``: the first with metrics.save_per_request=true (1 GB).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cases(n: int) -> dict[str, list[str]]:
    big = ["workload=synthetic", f"workload.num_prompts={n}"]
    return {
        "sharegpt-1000": ["workload.num_prompts=1000"],
        "synthetic-1M": [*big, "metrics.save_per_request=false"],
        "cluster16-1M": [*big, "metrics.save_per_request=false", "cluster.num_replicas=16",
                         "router=least_outstanding", "workload.request_rate=800"],
        "synthetic-1M-per-request": [*big, "metrics.save_per_request=true"],
    }


def measure(overrides: list[str]) -> tuple[float, float, float, float]:
    """(wall seconds end to end, CPU seconds (user + system), peak RSS in GB, the simulation's
    own wall seconds). On a shared machine the CPU seconds are the ones to compare."""
    with tempfile.TemporaryDirectory() as d:
        cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "experiments.run", *overrides,
               "progress=false", f"hydra.run.dir={d}"]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        if out.returncode:
            raise SystemExit(f"{' '.join(overrides)} failed:\n{out.stdout[-2000:]}"
                             f"{out.stderr[-2000:]}")
        text = out.stdout + out.stderr
    m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)",
                  text)
    wall = int(m.group(1) or 0) * 3600 + int(m.group(2)) * 60 + float(m.group(3))
    cpu = sum(float(re.search(rf"{what} time \(seconds\): ([\d.]+)", text).group(1))
              for what in ("User", "System"))
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1)) / 1e6
    sim = float(re.search(r"wall_seconds:\s+([\d.]+)", text).group(1))
    return wall, cpu, rss, sim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--big", type=int, default=1_000_000, help="requests of the big cases")
    ap.add_argument("--cases", nargs="*", default=None, help="cases to run (default: all)")
    args = ap.parse_args()
    table = cases(args.big)
    names = args.cases or list(table)
    unknown = set(names) - set(table)
    if unknown:
        raise SystemExit(f"unknown case {sorted(unknown)[0]!r}; choose from {', '.join(table)}")
    measure(["workload.num_prompts=10"])  # builds the ShareGPT token-count cache
    print(f"{'case':<28}{'wall s':>8}{'cpu s':>8}{'sim s':>8}{'peak RSS GB':>13}")
    for name in names:
        wall, cpu, rss, sim = measure(table[name])
        print(f"{name:<28}{wall:>8.1f}{cpu:>8.1f}{sim:>8.1f}{rss:>13.2f}", flush=True)


if __name__ == "__main__":
    main()
