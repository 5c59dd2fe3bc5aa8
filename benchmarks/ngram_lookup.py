"""Scenario: the GPU time of the real engine's n-gram prompt lookup per verify step
(real_backend/speculative.py ``ngram_propose``), which the simulator leaves unpriced: each
call's time replayed from a CUDA graph (the device's own work, what a step costs while the host
queues ahead of it, as it does inside a window) and launched eagerly one call at a time (the
host's launch cost, what it costs when the device waits for it).

    python benchmarks/ngram_lookup.py [--rows 8 64 256] [--history 2048] [--k 4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from real_backend.speculative import ngram_propose  # noqa: E402


def timed(fn, reps: int) -> float:
    """Mean milliseconds of ``fn`` over ``reps`` calls, after a warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--history", type=int, default=2048)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--ngram-min", type=int, default=1)
    ap.add_argument("--ngram-max", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"device {torch.cuda.get_device_name()}, history {args.history}, k {args.k}, "
          f"n-grams {args.ngram_min}..{args.ngram_max}")
    print("rows  graph_ms  eager_ms")
    for rows in args.rows:
        gen = torch.Generator(device=dev).manual_seed(0)
        hist = torch.randint(0, 500, (rows, args.history), device=dev, generator=gen)
        lens = torch.randint(args.history // 2, args.history, (rows,), device=dev,
                             generator=gen)

        def call(hist=hist, lens=lens):
            return ngram_propose(hist, lens, args.k, args.ngram_min, args.ngram_max)

        eager = timed(call, 200)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            call()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        replay = timed(graph.replay, 200)
        print(f"{rows:4d}  {replay:8.3f}  {eager:8.3f}")


if __name__ == "__main__":
    main()
