"""The GPU measurements of BENCHMARKS.md and docs/validation in one process (one device lease).

    python benchmarks/h200_suite.py OUT_DIR [--parts grid,calib,poisson,fp32] [--prompts N]
                                            [--repeats N]

grid:    llama3_8b (random bf16), ShareGPT 1000 prompts (seed 0), all at t=0: single_step,
         multi_step k=1,2,4,8,16, chunked_prefill, cp1 k=8, cp2 k=8 (the real backend)
calib:   the calibration microbenchmarks (experiments.calibrate's grid) -> calibration.csv
poisson: the validation grid's real side at two Poisson rates (ShareGPT seed 1)
fp32:    single_step vs multi_step k=8 in fp32 (TF32 off), greedy token ids compared

Each run's directory goes under OUT_DIR; a failing part is reported and the rest go on.
A short table is printed last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import real_backend  # noqa: E402,F401  (sets CUDA_MODULE_LOADING before CUDA starts)
from experiments.validate import POLICIES, run_one  # noqa: E402

GRID = POLICIES[:6] + [("chunked_prefill", None)] + POLICIES[6:]


MODEL = ["model=llama3_8b"]


def real(policy: str, k: int | None, rate: str, seed: int, prompts: int, extra=()) -> list[str]:
    ov = ["backend=real", f"policy={policy}", *MODEL, "workload=sharegpt",
          f"workload.num_prompts={prompts}", f"workload.seed={seed}",
          f"workload.request_rate={rate}", "progress=false",
          "backend.keep_runner=true", *extra]  # runs of one shape share weights, cache, graphs
    return ov + ([f"policy.num_steps={k}"] if k else [])


def line(tag: str, res: dict, wall: float) -> str:
    s = res.get("schedlab", {})
    return (f"{tag:<34} {res['request_throughput']:7.2f} {res['mean_ttft_ms']:9.1f} "
            f"{res['median_ttft_ms']:9.1f} {res['mean_tpot_ms']:7.2f} {res['median_tpot_ms']:7.2f} "
            f"{s.get('num_preemptions', 0):5d} {wall:6.0f} {s.get('setup_s', 0):6.1f}")


def clock_sampler():
    """A started sampler of the GPU's clock, or None without NVML (or with --smoke)."""
    if MODEL[0] != "model=llama3_8b":
        return None
    from real_backend.gpu_clock import ClockSampler

    sampler = ClockSampler.for_device(0, period=0.02)
    if sampler is not None:
        sampler.start()
    return sampler


def sustained_load(seconds: float) -> None:
    """Large bf16 matmuls back to back for ``seconds``: the GPU settles at its loaded clocks."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--parts", default="grid,calib,poisson,fp32")
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--poisson-prompts", type=int, default=400)
    ap.add_argument("--rates", default="20,40")
    ap.add_argument("--fp32-prompts", type=int, default=300)
    ap.add_argument("--policies", default=None, help="policy:k list for grid and poisson (default: all)")
    ap.add_argument("--warm-seconds", type=float, default=20.0)
    ap.add_argument("--extra", default="", help="comma-separated overrides added to every run "
                    "(e.g. backend.piecewise_graph_max_tokens=0)")
    ap.add_argument("--tag", default="", help="suffix of every run directory (A/B runs)")
    ap.add_argument("--repeats", type=int, default=1, help="run the grid and Poisson parts this "
                    "many times, each a full pass (directories *_r1, *_r2, ...; validation "
                    "averages them)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on cpu: check the script")
    args = ap.parse_args()
    if args.smoke:
        MODEL[:] = ["model=tiny", "backend.device=cpu", "backend.num_blocks=2048"]
    out = Path(args.out)
    parts = args.parts.split(",")
    table = []

    def go(tag: str, overrides: list[str]) -> dict | None:
        tag += args.tag
        overrides = overrides + [o for o in args.extra.split(",") if o]
        t0 = time.perf_counter()
        sampler = clock_sampler()
        try:
            res = run_one(overrides, out / tag)
        except Exception:  # keep the lease's other measurements
            traceback.print_exc()
            table.append(f"{tag:<34} FAILED")
            return None
        finally:
            if sampler is not None:  # the SM clock during the run; t = 0 when run_one returned
                t_end = time.perf_counter()
                sampler.stop()
                clock = sampler.frame()
                clock["t"] -= t_end
                (out / tag).mkdir(parents=True, exist_ok=True)
                clock.to_csv(out / tag / "clock.csv", index=False)
        table.append(line(tag, res, time.perf_counter() - t0))
        print(table[-1], flush=True)
        return res

    if not args.smoke:  # sustained load first, so the first timed run sees steady clocks
        sustained_load(args.warm_seconds)
    if "grid" in parts or "warm" in parts:  # a first run compiles kernels for new shapes
        go("warmup", real("single_step", None, "inf", 3, 100))
    chosen = None if not args.policies else [
        (p.split(":")[0], int(p.split(":")[1]) if ":" in p else None)
        for p in args.policies.split(",")]
    if args.repeats < 1:
        raise SystemExit(f"error: --repeats must be >= 1, got {args.repeats}")
    rep = [f"_r{i + 1}" if args.repeats > 1 else "" for i in range(args.repeats)]
    if "grid" in parts or "single" in parts:
        for r in rep:  # full passes, so that a slow spell of the host spreads over policies
            for policy, k in (chosen or GRID if "grid" in parts else GRID[:1]):
                go(f"grid/{policy}_k{k or 1}{r}", real(policy, k, "inf", 0, args.prompts))
    if "calib" in parts:
        from experiments.calibrate import main as calibrate

        try:
            calibrate(["--model", "tiny", "--device", "cpu", "--quick", "--num-blocks", "256",
                       "--conf-dir", str(out / "conf")] if args.smoke else
                      ["--model", "llama3_8b", "--device", "cuda", "--conf-dir", str(out / "conf")])
        except (Exception, SystemExit):
            traceback.print_exc()
            table.append("calibration FAILED")
    if "poisson" in parts:
        grid = chosen or POLICIES
        for r in rep:
            for policy, k in grid:  # policy-major: runs of one shape follow each other
                for rate in args.rates.split(","):
                    go(f"poisson/{policy}_k{k or 1}_rate{rate}{r}",
                       real(policy, k, rate, 1, args.poisson_prompts))
    if "fp32" in parts:
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        ids = {}
        for policy, k in (("single_step", None), ("multi_step", 8)):
            res = go(f"fp32/{policy}_k{k or 1}",
                     real(policy, k, "inf", 0, args.fp32_prompts, ["backend.dtype=float32",
                                                     "backend.save_token_ids=true"]))
            if res:
                ids[policy] = res["output_token_ids"]
        if len(ids) == 2:
            a, b = ids["single_step"], ids["multi_step"]
            same = sum(x == y for x, y in zip(a, b))
            first = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None)
                     for x, y in zip(a, b) if x != y]
            table.append(f"fp32 identical greedy outputs: {same}/{len(a)} requests; first "
                         f"differing positions {first[:20]}")
            (out / "fp32_compare.json").write_text(json.dumps({"same": same, "n": len(a),
                                                               "first_diff": first}))
    print("\n" + f"{'run':<34} {'req/s':>7} {'TTFTmean':>9} {'TTFTmed':>9} {'TPOTmn':>7} "
          f"{'TPOTmd':>7} {'pre':>5} {'wall':>6} {'setup':>6}")
    print("\n".join(table))


if __name__ == "__main__":
    main()
