"""Copies of paged KV blocks on one GPU: what a prefill-to-decode hand-off costs (GPU).

    python benchmarks/kv_copy.py [--model llama3_8b] [--out kv_copy.csv]

A disaggregated cluster moves a request's KV blocks from the prefill replica's cache to the
decode replica's. One GPU can measure three of the paths such a transfer takes, for block counts
of 1 to 4096, each from a cache laid out as the engine lays it out (per layer, K and V tensors of
[blocks, block_size, kv_heads, head_dim]) and from scattered block ids (a running engine's):

- ``d2h``: the blocks gathered per layer into a staging buffer and copied to pinned host memory
  (the first half of a transfer through the host: PCIe);
- ``h2d``: pinned host memory copied to the device and scattered into another cache's blocks;
- ``d2d``: blocks copied from one KV pool to another on the same GPU (gather and scatter, no
  staging): the fastest a hand-off between two replicas on one GPU can be.

``copy_d2h``/``copy_h2d``/``copy_d2d`` are plain copies of one contiguous buffer of the same
bytes: the link's ceiling, without the gather. Times are CUDA-event medians over repeats, each
repeat with freshly drawn block ids; every transfer is checked against its source once.
The simulator's link model reads its measured defaults from these figures (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import yaml  # noqa: E402

from common.model_spec import ModelSpec  # noqa: E402
from common.paths import conf_dir  # noqa: E402

COUNTS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
OPS = ["d2h", "h2d", "d2d", "copy_d2h", "copy_h2d", "copy_d2d"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama3_8b", help="a conf/model name")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--counts", default=",".join(map(str, COUNTS)),
                   help="block counts, comma-separated")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None, help="CSV of every measurement")
    args = p.parse_args(argv)
    args.counts = [int(c) for c in args.counts.split(",")]
    if min(args.counts) < 1 or args.block_size < 1 or args.reps < 1:
        p.error("--counts, --block-size and --reps must be >= 1")
    return args


class Pools:
    """Two KV pools of one model shape on the GPU and a pinned staging buffer on the host."""

    def __init__(self, spec: ModelSpec, block_size: int, max_blocks: int, device: str = "cuda"):
        self.num_layers = spec.num_layers
        self.num_blocks = 2 * max_blocks  # ids drawn from twice the count: scattered
        shape = (self.num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        dt = torch.bfloat16
        # Random contents, never zeros: a copy of zeros can be faster than a copy of data
        self.device = device
        self.src = [torch.randn(shape, dtype=dt, device=device) for _ in range(2 * spec.num_layers)]
        self.dst = [torch.empty(shape, dtype=dt, device=device) for _ in range(2 * spec.num_layers)]
        self.block_elems = block_size * spec.num_kv_heads * spec.head_dim
        self.block_bytes = 2 * spec.num_layers * self.block_elems * 2
        n = 2 * spec.num_layers * max_blocks * self.block_elems
        self.stage = torch.empty(n, dtype=dt, device=device)
        self.stage2 = torch.empty(n, dtype=dt, device=device)
        self.host = torch.empty(n, dtype=dt, pin_memory=device != "cpu")

    def staged(self, count: int) -> list[torch.Tensor]:
        """The staging buffer as one [count, ...] view per layer tensor (K and V of each layer)."""
        per = count * self.block_elems
        shape = (count,) + tuple(self.src[0].shape[1:])
        return [self.stage[i * per:(i + 1) * per].view(shape) for i in range(len(self.src))]

    def d2h(self, ids: torch.Tensor) -> None:
        for part, pool in zip(self.staged(len(ids)), self.src, strict=True):
            torch.index_select(pool, 0, ids, out=part)
        n = len(ids) * self.block_elems * len(self.src)
        self.host[:n].copy_(self.stage[:n], non_blocking=True)

    def h2d(self, ids: torch.Tensor) -> None:
        n = len(ids) * self.block_elems * len(self.src)
        self.stage[:n].copy_(self.host[:n], non_blocking=True)
        for part, pool in zip(self.staged(len(ids)), self.dst, strict=True):
            pool.index_copy_(0, ids, part)

    def d2d(self, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
        for a, b in zip(self.src, self.dst, strict=True):
            b.index_copy_(0, dst_ids, a.index_select(0, src_ids))

    def plain(self, op: str, count: int) -> None:
        n = count * self.block_elems * len(self.src)
        if op == "copy_d2h":
            self.host[:n].copy_(self.stage[:n], non_blocking=True)
        elif op == "copy_h2d":
            self.stage[:n].copy_(self.host[:n], non_blocking=True)
        else:
            self.stage2[:n].copy_(self.stage[:n])


def time_ms(fn, reps: int) -> list[float]:
    """CUDA-event times of ``fn(rep)`` after two warm-up calls."""
    for r in range(2):
        fn(r)
    torch.cuda.synchronize()
    out = []
    for r in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(r)
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def transfer(pools: Pools, op: str, ids: tuple[torch.Tensor, torch.Tensor], count: int) -> None:
    """One transfer of kind ``op`` (``OPS``) of ``count`` blocks: from ``ids[0]``, to ``ids[1]``."""
    if op == "d2h":
        pools.d2h(ids[0])
    elif op == "h2d":
        pools.h2d(ids[1])
    elif op == "d2d":
        pools.d2d(*ids)
    else:
        pools.plain(op, count)


def check(pools: Pools, count: int, gen: torch.Generator) -> None:
    """One transfer of each kind, compared with its source block for block."""
    ids = torch.randperm(pools.num_blocks, generator=gen)[:count].to(pools.device)
    dst = torch.randperm(pools.num_blocks, generator=gen)[:count].to(pools.device)
    pools.d2d(ids, dst)
    for a, b in zip(pools.src, pools.dst, strict=True):
        if not torch.equal(a[ids], b[dst]):
            raise SystemExit(f"kv_copy: d2d of {count} blocks copied wrong data")
    for b in pools.dst:  # poisoned: a block the second transfer misses cannot pass
        b.fill_(float("nan"))
    pools.d2h(ids)
    if pools.device != "cpu":
        torch.cuda.synchronize()
    pools.h2d(dst)
    if pools.device != "cpu":
        torch.cuda.synchronize()
    for a, b in zip(pools.src, pools.dst, strict=True):
        if not torch.equal(a[ids], b[dst]):
            raise SystemExit(f"kv_copy: d2h + h2d of {count} blocks copied wrong data")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kv_copy: needs a CUDA GPU")
    spec = ModelSpec.from_dict(yaml.safe_load(open(conf_dir() / "model" / f"{args.model}.yaml")))
    pools = Pools(spec, args.block_size, max(args.counts))
    gen = torch.Generator().manual_seed(0)
    for count in (1, max(args.counts)):
        check(pools, count, gen)
    rows = []
    for count in args.counts:
        draws = [(torch.randperm(pools.num_blocks, generator=gen)[:count].to(pools.device),
                  torch.randperm(pools.num_blocks, generator=gen)[:count].to(pools.device))
                 for _ in range(args.reps + 2)]
        for op in OPS:
            ts = sorted(time_ms(lambda r, op=op, draws=draws, count=count:
                                transfer(pools, op, draws[r], count), args.reps))
            nbytes = count * pools.block_bytes
            med = statistics.median(ts)
            rows.append({"model": spec.name, "op": op, "blocks": count, "bytes": nbytes,
                         "median_ms": med, "p10_ms": ts[len(ts) // 10],
                         "p90_ms": ts[(9 * len(ts)) // 10], "gb_s": nbytes / med / 1e6})
    if args.out:
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    print(f"{torch.cuda.get_device_name()}  {spec.name}  block {args.block_size} tokens = "
          f"{pools.block_bytes / 2**20:.2f} MiB of K+V")
    print(f"{'blocks':>6} " + " ".join(f"{op + ' ms':>11}" for op in OPS[:3])
          + " " + " ".join(f"{op + ' GB/s':>14}" for op in OPS))
    by = {(r["op"], r["blocks"]): r for r in rows}
    for count in args.counts:
        print(f"{count:6d} " + " ".join(f"{by[op, count]['median_ms']:11.3f}" for op in OPS[:3])
              + " " + " ".join(f"{by[op, count]['gb_s']:14.1f}" for op in OPS))


if __name__ == "__main__":
    main()
