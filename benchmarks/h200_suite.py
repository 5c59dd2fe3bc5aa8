"""The GPU measurements of BENCHMARKS.md and docs/validation in one process.

    python benchmarks/h200_suite.py OUT_DIR [--model NAME] [--parts grid,calib,poisson,fp32]
                                            [--prompts N] [--rates R,...] [--repeats N]

grid:      the model (llama3_8b by default; random bf16), ShareGPT 1000 prompts (seed 0), all
           at t=0: single_step, multi_step k=1,2,4,8,16, chunked_prefill, cp1 k=8, cp2 k=8
calib:     the calibration microbenchmarks (experiments.calibrate's grid) -> calibration.csv
poisson:   the validation grid's real side at Poisson rates (--rates, default 20,40; seed 1)
fp32:      single_step vs multi_step k=8 in fp32 (TF32 off), greedy token ids compared
models:    one model's validation runs, under OUT_DIR/models/NAME (what
           `experiments.validate --measured-dir OUT_DIR/models/NAME` reads): single_step,
           multi_step k=8 and cp1 k=8 on ShareGPT (--prompts, seed 0) at t=0 (--rates inf),
           then at a Poisson rate of 60% of the measured single_step t=0 request throughput,
           rounded to whole req/s (--rates poisson, seed 1; it reads the t=0 run of an earlier
           call into the same OUT_DIR); --rates inf,poisson (the default) does both
synthetic: the calibration's served synthetic runs on the model -> OUT_DIR/models/NAME/
           served_synthetic.csv (+ .timeline.csv, .clock.csv: the calibration data's layout)

Each run's directory goes under OUT_DIR; a failing part is reported and the rest go on.
The estimated time of the models and synthetic parts is printed first, a short table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
import traceback
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import real_backend  # noqa: E402,F401  (sets CUDA_MODULE_LOADING before CUDA starts)
from common.model_spec import ModelSpec  # noqa: E402
from experiments.files import write_text_atomic  # noqa: E402
from experiments.validate import POLICIES, _policy_grid, run_one  # noqa: E402

GRID = _policy_grid(POLICIES)
GRID = GRID[:6] + [("chunked_prefill", None)] + GRID[6:]
MODEL_POLICIES = [("single_step", None), ("multi_step", 8), ("cp1", 8)]  # the models part's
POISSON_LOAD = 0.6  # the models part's Poisson rate: this share of single_step's t=0 throughput
MODEL_DIR = Path(__file__).resolve().parents[1] / "conf" / "model"

MODEL = ["model=llama3_8b"]
SMOKE = [False]


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
    if SMOKE[0]:
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


def load_spec(name: str) -> ModelSpec:
    return ModelSpec.from_dict(yaml.safe_load((MODEL_DIR / f"{name}.yaml").read_text()))


def poisson_rate(t0_result: Path) -> int:
    """POISSON_LOAD of the single_step t=0 run's request throughput, in whole req/s."""
    try:
        throughput = float(json.loads(t0_result.read_text())["request_throughput"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"--rates poisson needs {t0_result} (the model's single_step run at "
                         "t=0: run --rates inf into this OUT_DIR first, or give a rate)") from None
    return max(1, round(POISSON_LOAD * throughput))


def chosen_policies(args) -> list[tuple[str, int | None]] | None:
    """--policies as (policy, k) pairs, or None when not given."""
    return None if not args.policies else [
        (p.split(":")[0], int(p.split(":")[1]) if ":" in p else None)
        for p in args.policies.split(",")]


def models_part(args, out: Path, go, table: list[str]) -> None:
    """The models part (module docstring): a warm-up run outside the measured tree, then the
    three policies at each of the rates."""
    base = f"models/{args.model}"
    policies = chosen_policies(args) or MODEL_POLICIES
    go(f"warmup/{args.model}", real("single_step", None, "inf", 3, min(100, args.prompts)))
    for rate in model_rates(args):
        if rate == "inf":
            for policy, k in policies:
                go(f"{base}/t0/{policy}_k{k or 1}", real(policy, k, "inf", 0, args.prompts))
            continue
        if rate == "poisson":
            try:
                rate = str(poisson_rate(out / f"{base}/t0/single_step_k1{args.tag}/result.json"))
            except ValueError as err:
                table.append(f"models poisson FAILED: {err}")
                continue
            print(f"models: Poisson rate {rate} req/s", flush=True)
        for policy, k in policies:
            go(f"{base}/poisson/{policy}_k{k or 1}_rate{rate}",
               real(policy, k, rate, 1, args.poisson_prompts or args.prompts))


def models_plan(args, parts: list[str]) -> str:
    """A rough time estimate of the models and synthetic parts on an H200: request throughput
    at t=0 scaled from llama3_8b's measured 46 req/s by sqrt(parameters), setup (weights,
    memory profile, graph capture) growing with the layers."""
    spec = load_spec(args.model)
    thr = 46.0 * math.sqrt(8.03e9 / spec.num_params)
    setup = 20.0 + spec.num_layers
    rate = max(1, round(POISSON_LOAD * thr))
    est = {"warm-up": args.warm_seconds + setup + min(100, args.prompts) / thr}
    if "models" in parts:
        for r in model_rates(args):
            if r == "inf":
                est["t=0 runs"] = 3 * (args.prompts / thr + 3) + 10
            else:
                n = args.poisson_prompts or args.prompts
                est[f"Poisson runs ({r})"] = 3 * (n / (rate if r == "poisson" else float(r)) + 10)
    if "synthetic" in parts:
        est["synthetic runs"] = setup + 3 * (400 / thr + 3)
    total = sum(est.values())
    text = (f"{args.model}: estimated on an H200 (~{thr:.0f} req/s at t=0, Poisson at ~{rate} "
            "req/s): " + ", ".join(f"{k} {v:.0f} s" for k, v in est.items())
            + f"; total ~{total:.0f} s")
    if total > 540:
        text += ("\n  over 9 minutes: split it, e.g. --parts models,synthetic --rates inf, "
                 "then --parts models --rates poisson")
    return text


def served_synthetic(model: str, base: Path, smoke: bool) -> str:
    """The calibration's served synthetic runs (its Profiler.served over its grid's policies)
    on this model: rows, window timeline and clock samples as calibration data keeps them."""
    import pandas as pd

    from experiments.measure import Profiler, grid
    t0 = time.perf_counter()
    spec = load_spec(model)
    p = Profiler(spec, {"device": "cpu", "num_blocks": 256} if smoke else {"device": "cuda"}, 1)
    sampler = clock_sampler()
    origin = time.perf_counter()
    gc.collect()
    gc.freeze()  # as the serving loop does: no full collection inside a timed window
    try:
        for policy, params in grid(smoke, spec.max_model_len)["served"]:
            p.served(policy, params, 12 if smoke else 400, smoke)
    finally:
        gc.unfreeze()
        clock = None
        if sampler is not None:
            sampler.stop()
            clock = sampler.frame()
            clock["t"] -= origin
    data = pd.DataFrame(p.rows)
    data["model"] = model
    timeline = pd.DataFrame(p.timeline, columns=["window", "start_s", "end_s", "gpu_s"])
    timeline[["start_s", "end_s"]] -= origin
    del p
    gc.collect()
    base.mkdir(parents=True, exist_ok=True)
    write_text_atomic(base / "served_synthetic.timeline.csv", timeline.to_csv(index=False))
    if clock is not None:
        write_text_atomic(base / "served_synthetic.clock.csv", clock.to_csv(index=False))
    write_text_atomic(base / "served_synthetic.csv", data.to_csv(index=False))  # last: done
    return (f"served synthetic runs of {model}: {len(data)} rows in "
            f"{time.perf_counter() - t0:.0f} s -> {base / 'served_synthetic.csv'}")


def model_rates(args) -> list[str]:
    return (args.rates or "inf,poisson").split(",")


def check_args(args) -> None:
    """Bad settings as a ValueError naming the flag, before anything runs."""
    if not (MODEL_DIR / f"{args.model}.yaml").is_file():
        raise ValueError(f"--model: no {args.model}.yaml in {MODEL_DIR}")
    known = {"grid", "single", "warm", "calib", "poisson", "fp32", "models", "synthetic"}
    bad = [p for p in args.parts.split(",") if p not in known]
    if bad:
        raise ValueError(f"--parts: unknown part {bad[0]!r} (parts: {', '.join(sorted(known))})")
    for flag, value in (("--prompts", args.prompts), ("--poisson-prompts", args.poisson_prompts)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    rates = model_rates(args) if "models" in args.parts.split(",") else \
        (args.rates or "20,40").split(",")
    for rate in rates:
        if rate in ("inf", "poisson") and "models" in args.parts.split(","):
            continue
        try:
            ok = float(rate) > 0
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"--rates: {rate!r} is not a rate in req/s"
                             + (" (nor inf or poisson)" if "models" in args.parts else ""))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--parts", default="grid,calib,poisson,fp32")
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--model", default="llama3_8b", help="a conf/model name")
    ap.add_argument("--poisson-prompts", type=int, default=None,
                    help="prompts of Poisson runs (default: 400; the models part: --prompts)")
    ap.add_argument("--rates", default=None, help="poisson part: req/s list (default 20,40); "
                    "models part: inf, poisson (60%% of capacity) or req/s (default inf,poisson)")
    ap.add_argument("--fp32-prompts", type=int, default=300)
    ap.add_argument("--policies", default=None,
                    help="policy:k list for grid, poisson and models (default: all)")
    ap.add_argument("--warm-seconds", type=float, default=20.0)
    ap.add_argument("--extra", default="", help="comma-separated overrides added to every run "
                    "(e.g. backend.piecewise_graph_max_tokens=0)")
    ap.add_argument("--tag", default="", help="suffix of every run directory (A/B runs)")
    ap.add_argument("--repeats", type=int, default=1, help="run the grid and Poisson parts this "
                    "many times, each a full pass (directories *_r1, *_r2, ...; validation "
                    "averages them)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on cpu: check the script")
    args = ap.parse_args(argv)
    try:
        check_args(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    SMOKE[0] = args.smoke
    MODEL[:] = [f"model={args.model}"]
    if args.smoke:
        MODEL[1:] = ["backend.device=cpu", "backend.num_blocks=2048"]
    out = Path(args.out)
    parts = args.parts.split(",")
    table = []
    rates = model_rates(args)
    if "models" in parts and "poisson" in rates and "inf" not in rates:
        try:  # the rate comes from an earlier call's t=0 run: refuse before anything runs
            poisson_rate(out / f"models/{args.model}/t0/single_step_k1{args.tag}/result.json")
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            raise SystemExit(2) from None
    if "models" in parts or "synthetic" in parts:
        print(models_plan(args, parts), flush=True)

    def go(tag: str, overrides: list[str]) -> dict | None:
        tag += args.tag
        overrides = overrides + [o for o in args.extra.split(",") if o]
        t0 = time.perf_counter()
        sampler = clock_sampler()
        try:
            res = run_one(overrides, out / tag)
        except (Exception, SystemExit) as err:  # keep the other measurements
            traceback.print_exc()
            table.append(f"{tag:<34} FAILED {err}")
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
    chosen = chosen_policies(args)
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
            calibrate(["--model", args.model, "--device", "cpu", "--quick", "--num-blocks", "256",
                       "--conf-dir", str(out / "conf")] if args.smoke else
                      ["--model", args.model, "--device", "cuda", "--conf-dir", str(out / "conf")])
        except (Exception, SystemExit):
            traceback.print_exc()
            table.append("calibration FAILED")
    if "poisson" in parts:
        grid = chosen or _policy_grid(POLICIES)
        for r in rep:
            for policy, k in grid:  # policy-major: runs of one shape follow each other
                for rate in (args.rates or "20,40").split(","):
                    go(f"poisson/{policy}_k{k or 1}_rate{rate}{r}",
                       real(policy, k, rate, 1, args.poisson_prompts or 400))
    if "models" in parts:
        models_part(args, out, go, table)
    if "synthetic" in parts:
        try:
            table.append(served_synthetic(args.model, out / "models" / args.model, args.smoke))
        except (Exception, SystemExit):
            traceback.print_exc()
            table.append("served synthetic runs FAILED")
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
