"""FCFS and two ordering policies on vLLM's engine (backend=vllm, CPU), for
docs/validation/vllm.md.

    python benchmarks/vllm_suite.py OUT_DIR [--rates inf,4,8] [--prompts 200] [--repeats 3]
                                    [--model tiny] [--device cpu]
    python -m experiments.validate_policies OUT_DIR --table vllm --hardware vllm_cpu \
        --overhead vllm_cpu --out docs/validation

The tiny model (dummy weights; --model another conf/model shape, --device cuda on CUDA vLLM) on
vLLM's CPU build, ShareGPT (the bundled dataset, seed 1),
all at t=0 and Poisson arrivals at the given rates, each request in the SLO classes of
benchmarks/policy_suite.py (priority reads them), KV blocks of 32 tokens (vLLM's CPU
attention). chunked_prefill (vLLM's own FCFS batching), sjf and priority run inside vLLM's
scheduler through VllmPolicyScheduler. The repeats are interleaved (every configuration once,
then again), one engine at a time, so that a drift of a shared machine's load falls on every
configuration alike; each run goes under OUT_DIR/<policy>_rate<r>_r<repeat> (config.json,
result.json without per-request lists, requests.csv, steps.csv) and OUT_DIR/load.csv records
the load average (os.getloadavg) before and after each run. Nothing here enters a fit.
--smoke: 8 synthetic prompts at t=0, one repeat of chunked_prefill (checks the script).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.policy_suite import CLASSES  # noqa: E402
from experiments.validate import run_one  # noqa: E402

POLICIES = ["chunked_prefill", "sjf", "priority"]


def overrides(policy: str, rate: str, prompts: int, smoke: bool, model: str = "tiny",
              device: str = "cpu") -> list[str]:
    workload = (["workload=synthetic", "workload.lengths.dist=fixed",
                 "workload.lengths.prompt_len=32", "workload.lengths.output_len=8"] if smoke
                else ["workload=sharegpt"])
    return ["backend=vllm", f"backend.device={device}", f"model={model}", f"policy={policy}",
            *workload,
            f"workload.num_prompts={prompts}", f"workload.request_rate={rate}",
            "workload.seed=1", CLASSES, "scheduler.block_size=32", "progress=false",
            "metrics.save_per_request=false"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="where the run directories go")
    ap.add_argument("--rates", default="inf,4,8", help="request rates (inf: all at t=0)")
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--model", default="tiny", help="a name in conf/model")
    ap.add_argument("--device", default="cpu", help="cpu (vLLM's CPU build) or cuda (CUDA vLLM)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    policies, rates, repeats = args.policies.split(","), args.rates.split(","), args.repeats
    if args.smoke:
        policies, rates, repeats, args.prompts = ["chunked_prefill"], ["inf"], 1, 8
    load = out / "load.csv"
    if not load.exists():
        load.write_text("run,load1_before,load1_after,seconds\n")
    for rep in range(1, repeats + 1):
        for rate in rates:
            for policy in policies:
                name = f"{policy}_rate{rate}_r{rep}"
                before, t0 = os.getloadavg()[0], time.perf_counter()
                res = run_one(overrides(policy, rate, args.prompts, args.smoke, args.model,
                                        args.device), out / name, quiet=True)
                seconds = time.perf_counter() - t0
                with load.open("a") as f:
                    f.write(f"{name},{before:.2f},{os.getloadavg()[0]:.2f},{seconds:.1f}\n")
                print(f"{name}: {res['request_throughput']:.3g} req/s, median TTFT "
                      f"{res['median_ttft_ms']:.4g} ms, median TPOT {res['median_tpot_ms']:.4g} "
                      f"ms ({seconds:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
