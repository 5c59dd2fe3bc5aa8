"""Benchmark: what a prefix-cache block key costs (policies/prefix_cache.py), per full block.

Usage: python benchmarks/prefix_hash.py [--case NAME ...] [--block-size 16] [--requests 2000]
       [--repeats 7]
(with ``PYTHONPATH`` at the checkout to time; the code before the keys became content digests answers too). Cases:

- ``server``: a served prompt's token ids to its block keys (the HTTP server's path:
  ``token_segments``, then ``block_hashes``), 1024-token prompts;
- ``sim-one-segment``: a workload's segments to block keys where each block lies inside one
  segment (``workload.shared_prefix_len``'s system prompt then the request's own tokens, or a
  Mooncake trace's blocks), 512 + 512 tokens;
- ``sim-across-segments``: blocks that span segments (``sharegpt_multiturn``'s messages, here
  20-300 tokens each), 1024 tokens.

Prints nanoseconds per block, the best of ``--repeats`` passes over ``--requests`` requests
(keys computed afresh each pass, as a request's first admission does). On a busy machine,
count instructions instead: one pass is the difference between ``--repeats 2`` and
``--repeats 1`` under ``valgrind --tool=callgrind``.

       python benchmarks/prefix_hash.py --run OVERRIDE ...
Runs ``python -m experiments.run OVERRIDE ...`` in this process and prints the CPU time spent
keying blocks in it (each first ``block_hashes`` call of the block manager timed), the part
of a simulation that the key's cost is, measured where a whole run's time is too noisy.
"""

from __future__ import annotations

import argparse
import atexit
import random
import runpy
import sys
import time
from collections.abc import Callable

import policies.block_manager
from policies.prefix_cache import block_hashes, token_segments
from policies.request import Request

PROMPT_LEN = 1024
CASES = ("server", "sim-one-segment", "sim-across-segments")


def _served(ids: list[int], block_size: int) -> tuple:
    """A served prompt's segments, as the server's inbox makes them."""
    try:
        return token_segments(ids)
    except TypeError:  # the code before content-digest keys cut the ids into blocks itself
        return token_segments(ids, block_size)  # type: ignore[call-arg]


def make_case(name: str, n: int, block_size: int
              ) -> tuple[list[Request], Callable[[Request], None]]:
    """A case's requests and what one of them costs (its keys from scratch)."""
    rng = random.Random(0)

    def request(i: int, segments: tuple | None = None, ids: list[int] | None = None) -> Request:
        r = Request(i, 0.0, PROMPT_LEN, 1, prompt_token_ids=ids)
        r.prefix_segments = segments
        return r

    def from_ids(r: Request) -> None:
        r.prefix_segments = _served(r.prompt_token_ids, block_size)
        block_hashes(r, block_size, keep=False)

    def from_segments(r: Request) -> None:
        block_hashes(r, block_size, keep=False)

    if name == "server":
        return [request(i, ids=[rng.randrange(128_000) for _ in range(PROMPT_LEN)])
                for i in range(n)], from_ids
    if name == "sim-one-segment":
        return [request(i, ((1, PROMPT_LEN // 2), (1000 + i, PROMPT_LEN // 2)))
                for i in range(n)], from_segments
    across = []
    for i in range(n):
        lengths: list[int] = []
        while sum(lengths) < PROMPT_LEN:
            lengths.append(min(rng.randint(20, 300), PROMPT_LEN - sum(lengths)))
        across.append(request(i, tuple((10 * i + j, m) for j, m in enumerate(lengths))))
    return across, from_segments


def keys_in_a_run(overrides: list[str]) -> None:
    """``experiments.run`` with these overrides, the block manager's block keys timed."""
    spent = [0.0, 0]  # CPU seconds, blocks keyed

    def timed(req: Request, block_size: int, keep: bool = True) -> list:
        if keep and req.block_hashes is not None:
            return req.block_hashes
        t = time.process_time()
        keys = block_hashes(req, block_size, keep)
        spent[0] += time.process_time() - t
        spent[1] += len(keys)
        return keys

    policies.block_manager.block_hashes = timed  # type: ignore[assignment]
    atexit.register(lambda: print(f"block keys: {spent[1]} blocks, {spent[0]:.2f} CPU s, "
                                  f"{spent[0] / max(spent[1], 1) * 1e9:.0f} ns per block"))
    sys.argv = ["experiments.run", *overrides]
    runpy.run_module("experiments.run", run_name="__main__")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", nargs="+", metavar="OVERRIDE",
                    help="time the block keys of an experiments.run with these overrides")
    ap.add_argument("--case", nargs="+", choices=CASES, default=CASES)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if args.run:
        return keys_in_a_run(args.run)
    blocks = args.requests * (PROMPT_LEN // args.block_size)
    print(f"{PROMPT_LEN}-token prompts, block size {args.block_size}, {args.requests} requests; "
          f"ns per block, best of {args.repeats}")
    for name in args.case:
        reqs, cost = make_case(name, args.requests, args.block_size)
        best = float("inf")
        for _ in range(args.repeats):
            t = time.perf_counter()
            for r in reqs:
                cost(r)
            best = min(best, time.perf_counter() - t)
        print(f"{name:22s} {best / blocks * 1e9:7.0f}")


if __name__ == "__main__":
    main()
