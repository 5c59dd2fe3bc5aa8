"""All-reduce time against message size across this host's GPUs (NCCL) or CPU ranks (gloo), and
the simulator's all-reduce coefficients fitted to it (docs/parallel.md).

Scenario: the ranks all-reduce what a tensor-parallel step all-reduces, T tokens x hidden
size activations, over a range of T. simulator/cost_model.py charges each such all-reduce

    t_ar + 2 (tp-1)/tp * T h d / (N * eta_ar)

(N: the profile's nvlink_gbps), so a straight line through (2 (tp-1)/tp * bytes, seconds)
gives t_ar (allreduce_latency_us, the intercept) and eta_ar (allreduce_efficiency, from the
slope). Prints one row per size and the two profile lines; --csv keeps the rows.

Run on 2 GPUs: python benchmarks/allreduce.py --ranks 2 --hardware h200 --hidden 4096,8192
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from time import perf_counter

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.paths import conf_dir  # noqa: E402

TOKENS = (1, 8, 32, 128, 256, 512, 1024, 2048)
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _time_one(x: torch.Tensor, iters: int, cuda: bool) -> float:
    """Seconds of one all-reduce of ``x`` (the mean over ``iters`` back to back)."""
    for _ in range(3):  # warm-up: the communicator and its buffers
        dist.all_reduce(x)
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            dist.all_reduce(x)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    return (perf_counter() - t0) / iters


def _rank(rank: int, ranks: int, init: str, device: str, sizes: list[tuple[int, int]],
          dtype: str, iters: int, out: str) -> None:
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank,
                            world_size=ranks)
    rows = []
    for tokens, hidden in sizes:
        x = torch.ones(tokens, hidden, dtype=_DTYPES[dtype],
                       device=f"cuda:{rank}" if cuda else "cpu")
        seconds = _time_one(x, iters, cuda)
        rows.append({"ranks": ranks, "tokens": tokens, "hidden": hidden, "dtype": dtype,
                     "bytes": x.numel() * x.element_size(), "seconds": seconds})
    if rank == 0:
        pd.DataFrame(rows).to_csv(out, index=False)
    dist.destroy_process_group()


def measure(ranks: int, device: str, hidden: list[int], tokens: list[int], dtype: str,
            iters: int) -> pd.DataFrame:
    """One row per (tokens, hidden): the all-reduce's bytes and seconds, timed on rank 0."""
    tmp = tempfile.mkdtemp(prefix="schedlab-allreduce-")
    try:
        out = str(Path(tmp) / "rows.csv")
        sizes = [(t, h) for h in hidden for t in tokens]
        mp.spawn(_rank, args=(ranks, f"file://{tmp}/rendezvous", device, sizes, dtype, iters,
                              out), nprocs=ranks)
        return pd.read_csv(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fit(rows: pd.DataFrame, nvlink_gbps: float) -> tuple[float, float]:
    """(allreduce_latency_us, allreduce_efficiency): the cost model's line through the rows."""
    tp = int(rows["ranks"].iloc[0])
    moved = 2.0 * (tp - 1) / tp * rows["bytes"].to_numpy(dtype=float)
    slope, intercept = np.polyfit(moved, rows["seconds"].to_numpy(dtype=float), 1)
    return max(intercept, 0.0) * 1e6, 1.0 / (slope * nvlink_gbps * 1e9)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--device", choices=("cuda", "cpu"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--hardware", default="h200", help="the profile whose nvlink_gbps the "
                    "efficiency is relative to (conf/hardware/<name>.yaml)")
    ap.add_argument("--hidden", default="4096,8192", help="hidden sizes (Llama-3-8B, -70B)")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--dtype", choices=tuple(_DTYPES), default="bfloat16")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--csv", default=None, help="write the rows here too")
    args = ap.parse_args(argv)
    if args.ranks < 2:
        ap.error("--ranks must be >= 2")
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        ap.error(f"--ranks {args.ranks} needs {args.ranks} GPUs, this host has "
                 f"{torch.cuda.device_count()}")
    profile = Path(conf_dir()) / "hardware" / f"{args.hardware}.yaml"
    if not profile.is_file():
        ap.error(f"--hardware {args.hardware}: no {profile}")
    nvlink = float(yaml.safe_load(profile.read_text())["nvlink_gbps"])
    rows = measure(args.ranks, args.device, [int(h) for h in args.hidden.split(",")],
                   [int(t) for t in args.tokens.split(",")], args.dtype, args.iters)
    print(rows.assign(us=rows["seconds"] * 1e6).drop(columns="seconds").to_string(index=False))
    if args.csv:
        rows.to_csv(args.csv, index=False)
    latency_us, efficiency = fit(rows, nvlink)
    print(f"# fitted on {len(rows)} sizes, {args.ranks} {args.device} ranks, against "
          f"{args.hardware}'s nvlink_gbps {nvlink:g}:")
    print(f"allreduce_latency_us: {latency_us:.3g}")
    print(f"allreduce_efficiency: {efficiency:.3g}")
    if not 0.0 < efficiency <= 1.0:  # the profile refuses it; noise or too few sizes
        print(f"# allreduce_efficiency {efficiency:.3g} is outside (0, 1]: not a profile value; "
              "measure more sizes (--tokens) or longer (--iters)")


if __name__ == "__main__":
    main()
