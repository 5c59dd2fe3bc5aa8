"""The policies of the literature on the real engine, for docs/validation/policies.md (GPU).

    python benchmarks/policy_suite.py OUT_DIR [--rates 56,73] [--prompts 2000] [--policies ...]
    python -m experiments.validate_policies OUT_DIR --out docs/validation

Llama-3-8B (random bf16 weights), ShareGPT (seed 1), Poisson arrivals at a rate near capacity
and one at 130% of it (the calibrated H200 profile's capacity, 56 req/s: chosen before any of
these runs), each request in the SLO classes of conf/experiment/policy_sweep.yaml. Every policy
of the literature plus FCFS (single_step, chunked_prefill) as reference. sarathi and
slo_adaptive price their windows with hardware=h200_calibrated, the profile taken before the
runs. Each run's directory (result.json with per-request lists, requests.csv, steps.csv,
config.json) goes under OUT_DIR/<policy>_rate<r>; nothing here enters a fit. A short table last.
--smoke: the tiny model on the CPU, 16 short synthetic prompts (checks the script).
--traces DIR: the same ShareGPT requests replayed from DIR/sharegpt_seed1_n<N>_rate<r>.csv
(their lengths and Poisson arrival times, written from the dataset beforehand), for a machine
without the dataset; --no-texts: no tokenizer (result.json without per-request lists;
requests.csv keeps every request's times).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import real_backend  # noqa: E402,F401  (sets CUDA_MODULE_LOADING before CUDA starts)
from experiments.validate import run_one  # noqa: E402

POLICIES = ["single_step", "chunked_prefill", "priority", "sjf", "edf", "sarathi", "mlfq",
            "slo_adaptive"]
CLASSES = ("workload.classes={interactive: {share: 0.2, priority: 0, ttft_ms: 500, tpot_ms: 50}, "
           "standard: {share: 0.5, priority: 1, ttft_ms: 2000, tpot_ms: 100}, "
           "batch: {share: 0.3, priority: 2, ttft_ms: 8000, tpot_ms: 200}}")


def overrides(policy: str, rate: str, prompts: int, smoke: bool, traces: str | None = None,
              texts: bool = True) -> list[str]:
    model = ["model=tiny", "backend.device=cpu", "hardware=cpu", "workload=synthetic",
             "workload.lengths.dist=fixed", "workload.lengths.prompt_len=32",
             "workload.lengths.output_len=8"] if smoke else \
        ["model=llama3_8b", "hardware=h200_calibrated", "workload=sharegpt"]
    workload = [f"workload.num_prompts={prompts}", f"workload.request_rate={rate}"]
    if traces and not smoke:  # the same requests, replayed from their trace
        model[-1] = "workload=trace"
        workload = [f"workload.trace_path={Path(traces) / trace_name(prompts, rate)}"]
    return ["backend=real", f"policy={policy}", *model, *workload, "workload.seed=1", CLASSES,
            "progress=false", *([] if texts else ["metrics.save_per_request=false"]),
            "backend.keep_runner=true"]  # runs of one shape share weights, cache and graphs


def trace_name(prompts: int, rate: str) -> str:
    """The trace of ShareGPT (seed 1)'s first ``prompts`` requests at ``rate``."""
    return f"sharegpt_seed1_n{prompts}_rate{rate}.csv"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--rates", default="56,73", help="Poisson req/s, comma-separated")
    ap.add_argument("--prompts", type=int, default=2000)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, 16 prompts")
    ap.add_argument("--traces", default=None, help="replay the requests from this directory's "
                    "traces (a machine without the dataset)")
    ap.add_argument("--no-texts", action="store_true", help="no tokenizer: no per-request "
                    "lists in result.json")
    args = ap.parse_args(argv)
    out = Path(args.out)
    prompts = 16 if args.smoke else args.prompts
    table = [f"{'run':<28} {'req/s':>7} {'med TTFT':>9} {'p90 TTFT':>9} {'med TPOT':>9} "
             f"{'goodput':>8} {'preempt':>7} {'wall s':>6}"]
    for rate in args.rates.split(","):
        for policy in args.policies.split(","):
            tag = f"{policy}_rate{rate}"
            t0 = time.perf_counter()
            try:
                res = run_one(overrides(policy, rate, prompts, args.smoke, args.traces,
                                        not args.no_texts), out / tag)
            except SystemExit as err:  # run_one's InputError: one line, the rest go on
                print(f"{tag}: failed: {getattr(err, 'message', err)}", flush=True)
                continue
            s = res.get("schedlab", {})
            table.append(f"{tag:<28} {res['request_throughput']:7.2f} "
                         f"{res['median_ttft_ms']:9.1f} {res.get('p90_ttft_ms', 0):9.1f} "
                         f"{res['median_tpot_ms']:9.2f} {res.get('class_goodput', 0):8.2f} "
                         f"{s.get('num_preemptions', 0):7d} {time.perf_counter() - t0:6.0f}")
            print(table[-1], flush=True)
    print("\n".join(table))


if __name__ == "__main__":
    main()
