"""The GPU measurements of overlap scheduling (scheduler.overlap) against multi-step, in one process.

    python benchmarks/overlap_suite.py OUT_DIR [--parts grid,poisson] [--prompts N]
                                               [--poisson-prompts N] [--rates 20,40]
                                               [--only TAG,...] [--smoke]

grid:    llama3_8b (random bf16), ShareGPT 1000 prompts (seed 0), all at t=0: single_step
         without and with overlap, multi_step k=8, multi_step k=4 + overlap, chunked_prefill
         without and with overlap (the real backend)
poisson: ShareGPT (seed 1) at Poisson 20 and 40 req/s: the same six

Each run's directory goes under OUT_DIR (a finished run is not repeated); a failing run is
reported and the rest go on. A short table is printed last (request throughput, median TTFT,
TPOT and ITL), then the acceptance checks of overlap scheduling. ``--smoke`` runs the tiny
model on the CPU with a few prompts: a check of the script.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import real_backend  # noqa: E402,F401  (sets CUDA_MODULE_LOADING before CUDA starts)
from experiments.validate import run_one  # noqa: E402

# (tag, policy, k, overlap)
SINGLE = ("single_step", "single_step", None, False)
SINGLE_OVERLAP = ("single_step_overlap", "single_step", None, True)
MULTI8 = ("multi_step_k8", "multi_step", 8, False)
MULTI4_OVERLAP = ("multi_step_k4_overlap", "multi_step", 4, True)
CHUNKED = ("chunked_prefill", "chunked_prefill", None, False)
CHUNKED_OVERLAP = ("chunked_prefill_overlap", "chunked_prefill", None, True)
GRID = [SINGLE, SINGLE_OVERLAP, MULTI8, MULTI4_OVERLAP, CHUNKED, CHUNKED_OVERLAP]
POISSON = [SINGLE, SINGLE_OVERLAP, MULTI8, MULTI4_OVERLAP, CHUNKED, CHUNKED_OVERLAP]
MODEL = ["model=llama3_8b"]
SMOKE_MODEL = ["model=tiny", "backend.device=cpu", "backend.num_blocks=2048",
               "workload.max_prompt_len=64", "workload.fixed_output_len=6"]  # seconds a run


def overrides(policy: str, k: int | None, overlap: bool, rate: str, seed: int,
              prompts: int, model: list[str] = MODEL) -> list[str]:
    """One in-process run's overrides (benchmarks/server_suite.py's too, with its ``model``)."""
    ov = ["backend=real", f"policy={policy}", *model, "workload=sharegpt",
          f"workload.num_prompts={prompts}", f"workload.seed={seed}",
          f"workload.request_rate={rate}", f"scheduler.overlap={str(overlap).lower()}",
          "progress=false", "backend.keep_runner=true"]  # one shape: weights, cache, graphs kept
    return ov + ([f"policy.num_steps={k}"] if k else [])


def line(tag: str, res: dict | None) -> str:
    if res is None:
        return f"{tag:<40} FAILED"
    return (f"{tag:<40} {res['request_throughput']:7.2f} {res['median_ttft_ms']:9.1f} "
            f"{res['median_tpot_ms']:8.2f} {res['median_itl_ms']:8.2f}")


def acceptance(results: dict[str, dict | None], rates: list[str]) -> list[str]:
    """The issue's checks, each a line: what was compared, and whether it held."""
    def get(tag: str) -> dict | None:
        return results.get(tag)

    out = []
    over, multi = get("grid/single_step_overlap"), get("grid/multi_step_k8")
    if over and multi:
        ratio = over["request_throughput"] / multi["request_throughput"]
        out.append(f"single_step+overlap / multi_step k=8 req/s: {ratio:.3f} (>= 0.98: "
                   f"{ratio >= 0.98})")
        out.append(f"median TPOT {over['median_tpot_ms']:.2f} vs {multi['median_tpot_ms']:.2f} ms "
                   f"(no worse: {over['median_tpot_ms'] <= multi['median_tpot_ms']})")
        ratio = over["median_itl_ms"] / over["median_tpot_ms"]
        # a k-token burst puts ITL near k x TPOT; prefills between decodes put it below TPOT
        out.append(f"single_step+overlap median ITL / median TPOT: {ratio:.3f} (no bursts, "
                   f"<= 1.1: {ratio <= 1.1})")
    for rate in rates:
        plain, over = get(f"poisson/single_step_rate{rate}"), \
            get(f"poisson/single_step_overlap_rate{rate}")
        if plain and over:
            ok = over["median_ttft_ms"] <= plain["median_ttft_ms"]
            out.append(f"rate {rate}: median TTFT {over['median_ttft_ms']:.1f} with overlap vs "
                       f"{plain['median_ttft_ms']:.1f} ms without (no worse: {ok})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--parts", default="grid,poisson")
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--poisson-prompts", type=int, default=400)
    ap.add_argument("--rates", default="20,40")
    ap.add_argument("--only", default=None,
                    help="comma-separated run tags (single_step_overlap, ...): just these")
    ap.add_argument("--smoke", action="store_true", help="tiny model on cpu: check the script")
    args = ap.parse_args()
    if args.only:
        only = set(args.only.split(","))
        unknown = sorted(only - {c[0] for c in GRID + POISSON})
        if unknown:
            raise SystemExit(f"error: --only has no run {unknown[0]!r}")
        GRID[:] = [c for c in GRID if c[0] in only]
        POISSON[:] = [c for c in POISSON if c[0] in only]
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - {"grid", "poisson"})
    if unknown:
        raise SystemExit(f"error: --parts has no part {unknown[0]!r}; its parts: grid, poisson")
    if min(args.prompts, args.poisson_prompts) < 1:
        raise SystemExit("error: --prompts and --poisson-prompts must be >= 1")
    rates = args.rates.split(",")
    if args.smoke:
        MODEL[:] = SMOKE_MODEL
    out = Path(args.out)
    table: list[str] = []
    results: dict[str, dict | None] = {}

    def go(tag: str, ov: list[str]) -> None:
        t0 = time.perf_counter()
        try:
            res = run_one(ov, out / tag)
        except Exception:  # keep the other measurements
            traceback.print_exc()
            res = None
        results[tag] = res
        table.append(line(tag, res))
        print(f"{table[-1]}  ({time.perf_counter() - t0:.0f} s)", flush=True)

    if "grid" in parts:
        for tag, policy, k, overlap in GRID:
            go(f"grid/{tag}", overrides(policy, k, overlap, "inf", 0, args.prompts))
    if "poisson" in parts:
        for tag, policy, k, overlap in POISSON:  # policy-major: runs of one shape follow
            for rate in rates:
                go(f"poisson/{tag}_rate{rate}",
                   overrides(policy, k, overlap, rate, 1, args.poisson_prompts))
    print("\n" + f"{'run':<40} {'req/s':>7} {'TTFTmed':>9} {'TPOTmed':>8} {'ITLmed':>8}")
    print("\n".join(table))
    print("\n".join(["", *acceptance(results, rates)]))


if __name__ == "__main__":
    main()
