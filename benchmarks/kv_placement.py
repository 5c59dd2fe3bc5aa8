"""Decode step time with contiguous against scattered KV block tables (GPU).

    python benchmarks/kv_placement.py

A long-running engine hands out blocks in the order its churn left them, so a request's block
table is scattered over the cache; a fresh block manager hands them out in order. The same
decode windows (llama3_8b, batch x context, k = 4) are timed both ways.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from experiments.calibrate import Profiler  # noqa: E402
from experiments.run import CONF_DIR  # noqa: E402
from policies import ModelSpec  # noqa: E402

CASES = [(256, 512), (256, 128), (128, 1024), (64, 512), (8, 2048)]


def main() -> None:
    spec = ModelSpec.from_dict(yaml.safe_load(open(Path(CONF_DIR) / "model" / "llama3_8b.yaml")))
    p = Profiler(spec, {"device": "cuda"}, reps=5, scatter=False)
    table = []
    rid = 0
    for scattered in (False, True):
        if scattered:
            p.blocks.shuffle_free(0)
        for b, ctx in CASES:
            start = len(p.rows)
            p.measure("decode", [p.decode_seq(rid + i, ctx, 4) for i in range(b)], 4)
            rid += b
            ms = statistics.median(r["gpu_s"] for r in p.rows[start:]) * 1e3
            table.append((b, ctx, scattered, ms))
    print(f"{'batch':>5} {'ctx':>5} {'contiguous ms':>14} {'scattered ms':>13} {'ratio':>6}")
    half = len(CASES)
    for (b, ctx, _, a), (_, _, _, s) in zip(table[:half], table[half:], strict=True):
        print(f"{b:5d} {ctx:5d} {a:14.2f} {s:13.2f} {s / a:6.3f}")


if __name__ == "__main__":
    main()
