"""Benchmark: the simulator's wall time and peak memory, end to end, as a user runs it.

Usage: python benchmarks/sim_speed.py [--big N] [--cases NAME ...]
Each case is one ``python -m experiments.run`` process under ``/usr/bin/time -v`` (wall time
from start to exit, Hydra and the imports included, and the peak RSS), then a second one whose
process tree's summed PSS is sampled beside it (the run and any child process together),
with the main configuration (llama3_8b, h100_sxm, vllm_v0_5, multi_step k=8); the ShareGPT token-count cache
is built first so it is not timed. The targets, on a 2-core machine:

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
import time
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


def measure(overrides: list[str], *, sample_tree: bool = False
            ) -> tuple[float, float, float, float, float | None]:
    """(wall seconds end to end, CPU seconds (user + system), peak RSS in GB, the simulation's
    own wall seconds, with ``sample_tree`` the peak of the process tree's summed PSS in GB).
    On a shared machine the CPU seconds are the ones to compare. The peak RSS is time -v's: the
    largest process's; the summed PSS of the process tree, sampled every 50 ms, counts any
    child too (None where /proc cannot say, or not sampled). Sampling slows the run it samples (each
    sample reads every process's memory map: 0.7 s of a 14 s run on two cores), so the times
    come from a run that is not sampled."""
    with tempfile.TemporaryDirectory() as d:
        cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "experiments.run", *overrides,
               "progress=false", f"hydra.run.dir={Path(d) / 'run'}"]
        with open(Path(d) / "out.txt", "w+") as out:  # a file: a pipe could fill and stall it
            with subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)}) as proc:
                tree_peak = _sample_tree_pss(proc) if sample_tree else None
            out.seek(0)
            text = out.read()
        if proc.returncode:
            raise SystemExit(f"{' '.join(overrides)} failed:\n{text[-4000:]}")
    m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)",
                  text)
    wall = int(m.group(1) or 0) * 3600 + int(m.group(2)) * 60 + float(m.group(3))
    cpu = sum(float(re.search(rf"{what} time \(seconds\): ([\d.]+)", text).group(1))
              for what in ("User", "System"))
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1)) / 1e6
    sim = float(re.search(r"wall_seconds:\s+([\d.]+)", text).group(1))
    return wall, cpu, rss, sim, tree_peak


def _sample_tree_pss(proc: subprocess.Popen) -> float | None:
    """The peak over the run of the summed PSS (proportional set size: a shared page counted
    once in all) of ``proc`` and every process below it, in GB; None without /proc."""
    if not os.path.exists(f"/proc/{proc.pid}/smaps_rollup"):
        return None
    peak = 0
    while proc.poll() is None:
        peak = max(peak, sum(_pss_kb(pid) for pid in _tree(proc.pid)))
        time.sleep(0.05)
    return peak / 1e6


def _tree(pid: int) -> list[int]:
    """``pid`` and the processes below it (one that exits meanwhile is left out)."""
    pids = [pid]
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                for child in f.read().split():
                    pids += _tree(int(child))
    except (FileNotFoundError, ProcessLookupError):
        pass
    return pids


def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("Pss:")), 0)
    except (FileNotFoundError, ProcessLookupError):  # it has just exited
        return 0


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
    print(f"{'case':<28}{'wall s':>8}{'cpu s':>8}{'sim s':>8}{'peak RSS GB':>13}"
          f"{'tree PSS GB':>13}")
    for name in names:
        wall, cpu, rss, sim, _ = measure(table[name])
        tree = measure(table[name], sample_tree=True)[-1]  # a second run, sampled
        print(f"{name:<28}{wall:>8.1f}{cpu:>8.1f}{sim:>8.1f}{rss:>13.2f}"
              f"{'n/a' if tree is None else f'{tree:.2f}':>13}", flush=True)


if __name__ == "__main__":
    main()
