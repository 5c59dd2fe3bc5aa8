"""Prefix caching on the real engine, for docs/validation/prefix_cache.md (GPU).

    python benchmarks/prefix_suite.py OUT_DIR [--rate 20] [--conversations 300] [--prompts 1000]
    python -m experiments.validate_policies OUT_DIR --table prefix_cache --out docs/validation

Llama-3-8B (random bf16 weights) on two workloads that reuse prefixes: multi-turn ShareGPT
(`workload=sharegpt_multiturn`, every turn's prompt the conversation so far) and ShareGPT with
a 1024-token system prompt on every request (`workload.shared_prefix_len=1024`); caching on and
off; single_step and multi_step k=8; all at t=0 and at one Poisson rate (chosen before the
runs). Each run's directory (result.json with per-request lists, requests.csv with each
request's cached tokens, steps.csv, config.json) goes under OUT_DIR/<name>; nothing here enters
a fit. A short table last. --smoke: the tiny model on the CPU, a few requests (checks the script).
--traces DIR: the system-prompt workload's ShareGPT requests replayed from
DIR/sharegpt_seed1_n<N>_rate<r>.csv (lengths and arrival times, written from the dataset
beforehand) with seeded token ids, for a machine without the dataset (multi-turn needs it);
--only NAME runs one workload; --no-texts: no tokenizer (no per-request lists in result.json).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policy_suite import trace_name  # noqa: E402  (this script's directory is on sys.path)

import real_backend  # noqa: E402,F401  (sets CUDA_MODULE_LOADING before CUDA starts)
from experiments.validate import run_one  # noqa: E402

POLICIES = {"single_step": [], "multi_step_k8": ["policy=multi_step", "policy.num_steps=8"]}


def workloads(conversations: int, prompts: int, smoke: bool, traces: str | None = None,
              rate: str = "20") -> dict[str, list[str]]:
    if smoke:
        return {"multiturn": ["workload=sharegpt_multiturn", "workload.num_conversations=3",
                              "workload.max_turns=3", "workload.fixed_output_len=4"],
                "sysprompt": ["workload=synthetic", "workload.num_prompts=8",
                              "workload.shared_prefix_len=32", "workload.lengths.dist=fixed",
                              "workload.lengths.prompt_len=16", "workload.lengths.output_len=4"]}
    sysprompt = ["workload=sharegpt", f"workload.num_prompts={prompts}"]
    if traces:  # the rate is the trace's: {rate} is filled in per run
        sysprompt = ["workload=trace",
                     f"workload.trace_path={Path(traces) / trace_name(prompts, '{rate}')}"]
    return {"multiturn": ["workload=sharegpt_multiturn",
                          f"workload.num_conversations={conversations}"],
            "sysprompt": [*sysprompt, "workload.shared_prefix_len=1024"]}


def overrides(policy: str, workload: list[str], caching: bool, rate: str,
              smoke: bool) -> list[str]:
    model = ["model=tiny", "backend.device=cpu", "hardware=cpu"] if smoke else \
        ["model=llama3_8b", "hardware=h200_calibrated"]
    return ["backend=real", *(["policy=single_step"] if policy == "single_step"
                              else POLICIES[policy]),
            *model, *(w.replace("{rate}", rate) for w in workload), "workload.seed=1",
            *([] if any(w.startswith("workload=trace") for w in workload)
              else [f"workload.request_rate={rate}"]),
            f"scheduler.enable_prefix_caching={str(caching).lower()}", "progress=false",
            "backend.keep_runner=true"]  # runs of one shape share weights, cache and graphs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--rate", default="20", help="the Poisson rate (req/s or conversations/s)")
    ap.add_argument("--conversations", type=int, default=300)
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, a few requests")
    ap.add_argument("--traces", default=None, help="replay sysprompt's requests from this "
                    "directory's traces (a machine without the dataset)")
    ap.add_argument("--only", default=None, choices=["multiturn", "sysprompt"])
    ap.add_argument("--no-texts", action="store_true", help="no tokenizer: no per-request "
                    "lists in result.json")
    args = ap.parse_args(argv)
    out = Path(args.out)
    table = [f"{'run':<36} {'req/s':>7} {'med TTFT':>9} {'p90 TTFT':>9} {'med TPOT':>9} "
             f"{'hit rate':>8} {'wall s':>6}"]
    for wname, workload in workloads(args.conversations, args.prompts, args.smoke,
                                     args.traces).items():
        if args.only and wname != args.only:
            continue
        for rate in ("inf", args.rate):
            for policy in POLICIES:
                for caching in (True, False):
                    tag = f"{wname}_{policy}_{'on' if caching else 'off'}_rate{rate}"
                    t0 = time.perf_counter()
                    try:
                        res = run_one(overrides(policy, workload, caching, rate, args.smoke)
                                      + (["metrics.save_per_request=false"] if args.no_texts
                                         else []), out / tag)
                    except SystemExit as err:  # run_one's InputError: one line, the rest go on
                        print(f"{tag}: failed: {getattr(err, 'message', err)}", flush=True)
                        continue
                    s = res.get("schedlab", {})
                    table.append(f"{tag:<36} {res['request_throughput']:7.2f} "
                                 f"{res['median_ttft_ms']:9.1f} {res.get('p90_ttft_ms', 0):9.1f} "
                                 f"{res['median_tpot_ms']:9.2f} "
                                 f"{s.get('prefix_cache_hit_rate', 0):8.3f} "
                                 f"{time.perf_counter() - t0:6.0f}")
                    print(table[-1], flush=True)
    print("\n".join(table))


if __name__ == "__main__":
    main()
