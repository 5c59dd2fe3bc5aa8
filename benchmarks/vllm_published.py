"""Benchmark: the vllm_v0_5 / vllm_v0_6 profiles against vLLM's published multi-step results.

Usage: python benchmarks/vllm_published.py [--only SOURCE] [--cpu-scale F]
Simulates each published configuration on h100_sxm (the 70B runs on 4 GPUs; the multi-step
RFC's A10G row on a10g) through experiments.run.run and prints one Markdown row per published
figure: what was published, what the simulator predicts, and the runs behind the prediction
(each one a `python -m experiments.run` command line). docs/validation/vllm_published.md holds
the table. ``--cpu-scale F`` is a what-if: every CPU cost of every run's profile times F.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
from dataclasses import asdict, dataclass
from functools import cache

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from experiments.run import CONF_DIR, run
from simulator.overhead import OverheadSpec, scale_overhead

SHAREGPT_500 = ("workload=sharegpt", "workload.num_prompts=500")
V05_SINGLE = ("overhead=vllm_v0_5", "policy=single_step")
V06_MS10 = ("overhead=vllm_v0_6", "policy=multi_step", "policy.num_steps=10")
V06_SINGLE = ("overhead=vllm_v0_6", "policy=single_step")
V06_SYNC = ("overhead=vllm_v0_6", "overhead.async_output_processing=false")
MS8 = ("policy=multi_step", "policy.num_steps=8")
LLAMA70B_TP4 = ("model=llama3_70b", "TP=4")  # TP: the tensor-parallel setting of this tree
# #7921's sonnet prompts: 191053 input tokens over 200 requests (955 each), 512 out
SONNET_7921 = ("workload=synthetic", "workload.num_prompts=200", "workload.request_rate=10",
               "workload.lengths.dist=fixed", "workload.lengths.prompt_len=955",
               "workload.lengths.output_len=512")
# RFC #6854's table, "Single GPU | Baseline (Req/s) | MS-8 (Req/s) | MS-16 (Req/s)": vLLM's
# request throughput in single step, multi-step 8 and multi-step 16 (no MS-16 on the A10G)
RFC_6854 = {"a10g_8b": (5.20, 5.89, None), "h100_8b": (20.66, 40.06, 43.31),
            "h100_30b": (9.23, 13.09, 13.23)}
# its workload is not stated: benchmark_serving's default (ShareGPT, 1000 prompts, all at t=0)
SHAREGPT_1000 = ("workload=sharegpt",)
A10G = ("hardware=a10g",)
LLAMA30B = ("model=llama_30b",)
V05_MS8 = ("overhead=vllm_v0_5",) + MS8
V05_MS16 = ("overhead=vllm_v0_5", "policy=multi_step", "policy.num_steps=16")


@dataclass(frozen=True)
class Row:
    """One published figure and the simulated runs that predict it: ``metric`` of ``runs[0]``,
    or with two runs the ratio runs[0] / runs[1] (``inverse``: runs[1] / runs[0])."""

    source: str
    hardware: str
    model: str
    workload: str
    config: str
    metric: str
    published: float
    runs: tuple[tuple[str, ...], ...]
    inverse: bool = False


def rfc_rows(key: str, hardware: str, model: str, runs: tuple[str, ...]) -> tuple[Row, ...]:
    """One RFC #6854 table row as rows here: single-step throughput, then each multi-step
    gain (multi-step / single-step throughput) that the row publishes."""
    single, ms8, ms16 = RFC_6854[key]
    source, workload = "#6854 (RFC)", "ShareGPT 1000, all at t=0 (assumed)"
    out = [Row(source, hardware, model, workload, "single step (v0.5)", "request_throughput",
               single, (SHAREGPT_1000 + runs + V05_SINGLE,))]
    for k, ms, policy in ((8, ms8, V05_MS8), (16, ms16, V05_MS16)):
        if ms is not None:
            out.append(Row(source, hardware, model, workload,
                           f"multi-step {k} / single step (v0.5)", "request_throughput ratio",
                           ms / single,
                           (SHAREGPT_1000 + runs + policy, SHAREGPT_1000 + runs + V05_SINGLE)))
    return tuple(out)


ROWS = (
    Row("v0.6.0 post (Sept 2024)", "1xH100", "Llama 8B", "ShareGPT 500, all at t=0",
        "v0.6.0 (multi-step 10, async) / v0.5.3", "request_throughput ratio", 2.7,
        (SHAREGPT_500 + V06_MS10, SHAREGPT_500 + V05_SINGLE)),
    Row("v0.6.0 post (Sept 2024)", "1xH100", "Llama 8B", "ShareGPT 500, 32 req/s",
        "v0.5.3 / v0.6.0 (multi-step 10, async)", "mean_tpot_ms ratio", 5.0,
        (SHAREGPT_500 + ("workload.request_rate=32",) + V06_MS10,
         SHAREGPT_500 + ("workload.request_rate=32",) + V05_SINGLE), inverse=True),
    Row("v0.6.0 post (Sept 2024)", "4xH100", "Llama 70B", "ShareGPT 500, all at t=0",
        "v0.6.0 (multi-step 10, async) / v0.5.3", "request_throughput ratio", 1.8,
        (SHAREGPT_500 + LLAMA70B_TP4 + V06_MS10, SHAREGPT_500 + LLAMA70B_TP4 + V05_SINGLE)),
    Row("v0.6.0 post (Sept 2024)", "4xH100", "Llama 70B", "ShareGPT 500, 32 req/s",
        "v0.5.3 / v0.6.0 (multi-step 10, async)", "mean_tpot_ms ratio", 2.0,
        (SHAREGPT_500 + ("workload.request_rate=32",) + LLAMA70B_TP4 + V06_MS10,
         SHAREGPT_500 + ("workload.request_rate=32",) + LLAMA70B_TP4 + V05_SINGLE),
        inverse=True),
    Row("v0.6.0 post (Sept 2024)", "4xH100", "Llama 70B", "ShareGPT 500, all at t=0",
        "multi-step 10 / single step (v0.6 CPU costs)", "request_throughput ratio", 1.28,
        (SHAREGPT_500 + LLAMA70B_TP4 + V06_MS10, SHAREGPT_500 + LLAMA70B_TP4 + V06_SINGLE)),
    Row("#7921", "1xH100", "Llama-3.1-8B", "sonnet 1024 in (955 tokenized) / 512 out, 200, "
        "10 req/s", "multi-step 8, sync output", "mean_tpot_ms", 28.10,
        (SONNET_7921 + MS8 + V06_SYNC,)),
    Row("#7921", "1xH100", "Llama-3.1-8B", "sonnet 1024 in (955 tokenized) / 512 out, 200, "
        "10 req/s", "multi-step 8, async output", "mean_tpot_ms", 21.36,
        (SONNET_7921 + MS8 + ("overhead=vllm_v0_6",),)),
    Row("#7921", "1xH100", "Llama-3.1-8B", "sonnet 1024 in (955 tokenized) / 512 out, 200, "
        "10 req/s", "multi-step 8, sync output", "request_throughput", 6.51,
        (SONNET_7921 + MS8 + V06_SYNC,)),
    Row("#7921", "1xH100", "Llama-3.1-8B", "sonnet 1024 in (955 tokenized) / 512 out, 200, "
        "10 req/s", "multi-step 8, sync output", "mean_ttft_ms", 145.21,
        (SONNET_7921 + MS8 + V06_SYNC,)),
    Row("#8050", "1xH100", "Llama-3-8B", "ShareGPT 500, all at t=0",
        "multi-step (8), sync output", "request_throughput", 26.57,
        (SHAREGPT_500 + MS8 + V06_SYNC,)),
    Row("#8050", "1xH100", "Llama-3-8B", "ShareGPT 500, all at t=0",
        "multi-step (8), sync output", "mean_tpot_ms", 44.48,
        (SHAREGPT_500 + MS8 + V06_SYNC,)),
    Row("#8050", "1xH100", "Llama-3-8B", "ShareGPT 500, all at t=0",
        "multi-step (8), async output", "mean_tpot_ms", 32.38,
        (SHAREGPT_500 + MS8 + ("overhead=vllm_v0_6",),)),
    Row("#8378", "(H100)", "(Llama-3-8B)", "ShareGPT 1000, all at t=0",
        "multi-step 8 + chunked prefill, 8192 batched tokens", "request_throughput", 45.41,
        (("workload=sharegpt", "policy=cp_promote", "policy.num_steps=8",
          "scheduler.max_num_batched_tokens=8192", "overhead=vllm_v0_6"),)),
    Row("#8378", "(H100)", "(Llama-3-8B)", "ShareGPT 1000, all at t=0",
        "multi-step 8 + chunked prefill, 8192 batched tokens", "mean_ttft_ms", 4685.0,
        (("workload=sharegpt", "policy=cp_promote", "policy.num_steps=8",
          "scheduler.max_num_batched_tokens=8192", "overhead=vllm_v0_6"),)),
    Row("#8378", "(H100)", "(Llama-3-8B)", "ShareGPT 1000, all at t=0",
        "multi-step 8 + chunked prefill, 8192 batched tokens", "mean_tpot_ms", 22.01,
        (("workload=sharegpt", "policy=cp_promote", "policy.num_steps=8",
          "scheduler.max_num_batched_tokens=8192", "overhead=vllm_v0_6"),)),
    *rfc_rows("a10g_8b", "1xA10G", "Llama 8B", A10G),
    *rfc_rows("h100_8b", "1xH100", "Llama 8B", ()),
    *rfc_rows("h100_30b", "1xH100", "30B Llama (LLaMA-1 30B assumed)", LLAMA30B),
)
BASE = ("backend=sim", "hardware=h100_sxm", "model=llama3_8b")


@cache
def tp_setting() -> str:
    """The setting that sets the tensor-parallel size in this tree's config."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config")
    return "parallel.tensor_parallel_size" if "parallel" in cfg else "hardware.tp"


def overrides(run_overrides: tuple[str, ...]) -> list[str]:
    """BASE then the run's own settings, one per key (the run's win), TP=n spelt as this
    tree spells it."""
    by_key: dict[str, str] = {}
    for o in BASE + run_overrides:
        key, value = o.split("=", 1)
        by_key[tp_setting() if key == "TP" else key] = value
    return [f"{k}={v}" for k, v in by_key.items()]


@cache
def simulate(run_overrides: tuple[str, ...], cpu_scale: float = 1.0) -> dict:
    """The run's result.json; ``cpu_scale``: its profile's CPU costs times that (a what-if)."""
    settings = overrides(run_overrides) + ["progress=false"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = OmegaConf.to_container(compose("config", overrides=settings), resolve=True)
    if cpu_scale != 1.0:
        cfg["overhead"] = asdict(scale_overhead(OverheadSpec.from_dict(cfg["overhead"]),
                                                cpu_scale))
    with tempfile.TemporaryDirectory() as d, contextlib.redirect_stdout(io.StringIO()):
        return run(cfg, d)


def predict(row: Row, cpu_scale: float = 1.0) -> float:
    metric = row.metric.removesuffix(" ratio")
    values = [simulate(r, cpu_scale)[metric] for r in row.runs]
    if len(values) == 1:
        return values[0]
    return values[1] / values[0] if row.inverse else values[0] / values[1]


def command(run_overrides: tuple[str, ...]) -> str:
    return "python -m experiments.run " + " ".join(overrides(run_overrides))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--only", help="rows whose source starts with this (e.g. '#8050')")
    ap.add_argument("--cpu-scale", type=float, default=1.0, metavar="F",
                    help="what-if: every CPU cost of every run's profile times F (default 1)")
    args = ap.parse_args()
    if not args.cpu_scale > 0:
        ap.error(f"--cpu-scale must be > 0, got {args.cpu_scale}")
    scale = args.cpu_scale
    rows = [r for r in ROWS if args.only is None or r.source.startswith(args.only)]
    if scale != 1.0:
        print(f"What-if: every CPU cost of every run's profile times {scale:g} (the commands "
              "below run the profiles as they are).\n")
    print("| # | source | hardware | model | workload | config | metric | published "
          "| predicted | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    runs: dict[tuple[str, ...], int] = {}
    for i, row in enumerate(rows, 1):
        got = predict(row, scale)
        err = got / row.published - 1.0
        for r in row.runs:
            runs.setdefault(r, len(runs) + 1)
        print(f"| {i} | {row.source} | {row.hardware} | {row.model} | {row.workload} "
              f"| {row.config} | {row.metric} | {row.published:.5g} | {got:.2f} | {err:+.0%} |")
    print("\nRuns (each row's runs, in its order: the ratio's numerator first):")
    for i, row in enumerate(rows, 1):
        print(f"- row {i}: " + ", ".join(f"run {runs[r]}" for r in row.runs))
    for r, j in runs.items():
        res = simulate(r, scale)
        print(f"- run {j}: `{command(r)}` ({res['total_input_tokens']} input / "
              f"{res['total_output_tokens']} output tokens; {res['request_throughput']:.2f} "
              f"req/s, mean TTFT {res['mean_ttft_ms']:.0f} ms, mean TPOT "
              f"{res['mean_tpot_ms']:.2f} ms, {res['schedlab']['num_preemptions']} "
              "preemptions)")


if __name__ == "__main__":
    main()
