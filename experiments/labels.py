"""Human names of the settings' values and metric columns in figures: one mapping table."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

# The names a reader of a paper knows, for each setting's value as the table holds it (the
# conf/<group>/<name>.yaml names, and the GPU names the real engine records); a value missing
# here is shown as it is.
HUMAN_NAMES: dict[str, dict[str, str]] = {
    "policy": {"multi_step": "multi-step", "cp1": "CP1", "cp2": "CP2",
               "single_step": "single-step", "chunked_prefill": "chunked prefill",
               "cp_promote": "CP-promote", "adaptive": "adaptive", "priority": "priority",
               "sjf": "SJF", "edf": "EDF", "sarathi": "Sarathi-Serve", "mlfq": "MLFQ (FastServe)",
               "slo_adaptive": "SLO-adaptive k", "lpm": "longest prefix match"},
    "hardware": {"h100_sxm": "H100 SXM", "h200": "H200", "a100_80g": "A100 80GB", "a10g": "A10G",
                 "cpu": "CPU", "h200_calibrated": "H200 (calibrated)",
                 "h200_ops": "H200 (operator tables)", "vllm_cpu": "vLLM's CPU engine (calibrated)", "NVIDIA H200": "H200",
                 "NVIDIA H100 80GB HBM3": "H100 SXM"},
    "model": {"llama3_8b": "Llama-3-8B", "llama3_70b": "Llama-3-70B",
              "llama3_2_1b": "Llama-3.2-1B", "llama3_2_3b": "Llama-3.2-3B",
              "llama2_13b": "Llama-2-13B", "llama_30b": "LLaMA-30B", "tiny": "tiny test model",
              "opt_13b": "OPT-13B", "opt_66b": "OPT-66B", "opt_175b": "OPT-175B"},
    "overhead": {"vllm_v0_5": "vLLM v0.5 CPU overheads", "vllm_v0_6": "vLLM v0.6 CPU overheads",
                 "none": "no CPU overheads",
                 "vllm_cpu": "CPU overheads fitted on vLLM's CPU engine",
                 "schedlab_h200": "CPU overheads fitted on the H200 engine",
                 "schedlab_h200_server": "CPU overheads fitted on the H200 engine behind its "
                                         "HTTP server"},
    "workload": {"sharegpt": "ShareGPT", "synthetic": "synthetic lengths", "trace": "trace",
                 "sharegpt_multiturn": "multi-turn ShareGPT"},
    "backend": {"sim": "simulated", "real": "real engine", "vllm": "vLLM"},
}
METRIC_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "end-to-end latency"}


def present(value: Any) -> bool:
    """Whether a table cell holds a value (neither None nor NaN)."""
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def human(kind: str, value: Any) -> str:
    """A setting's value as a reader knows it: human("hardware", "h100_sxm") == "H100 SXM"."""
    if not present(value):
        return ""
    return HUMAN_NAMES.get(kind, {}).get(str(value), str(value))


def metric_label(column: str) -> tuple[str, str]:
    """A metric column's name and unit: "median_ttft_ms" -> ("median TTFT", "ms")."""
    if column == "request_throughput":
        return "request throughput", "req/s"
    m = re.fullmatch(r"(mean|median|std|p\d+)_(ttft|tpot|itl|e2el)_ms", column)
    if not m:
        return column.replace("_", " "), ""
    return f"{m[1]} {METRIC_NAMES[m[2]]}", "ms"


def with_unit(text: str, unit: str) -> str:
    return f"{text} ({unit})" if unit else text


def rate_label(rate: float | None) -> str:
    return "all at t=0" if rate is None or math.isinf(rate) else f"{rate:g} req/s"


# result.json's goodput targets (schedlab.goodput_slo_ms) as the aggregate table's columns
SLO_COLUMNS = {"ttft": "ttft_slo_ms", "tpot": "tpot_slo_ms", "e2el": "e2el_slo_ms"}
# A conversation workload's request_rate starts conversations, not requests.
CONVERSATION_WORKLOADS = frozenset({"sharegpt_multiturn"})


def goodput_targets(row: Mapping[str, Any]) -> str:
    """The goodput targets a table row counted against: "TTFT ≤ 1000 ms, TPOT ≤ 100 ms"
    (empty where it records none)."""
    return ", ".join(f"{m.upper()} ≤ {float(row[col]):g} ms"
                     for m, col in SLO_COLUMNS.items() if present(row.get(col)))


def goodput_label(rows: Iterable[Mapping[str, Any]]) -> str:
    """A request_goodput axis's label naming its targets: the runs' one set, or where they
    differ or went unrecorded, the setting that holds them."""
    targets = {goodput_targets(row) for row in rows}
    if len(targets) == 1 and "" not in targets:
        return f"goodput (req/s meeting {targets.pop()})"
    if len(targets) > 1 and "" not in targets:
        return "goodput (req/s meeting each run's goodput.* targets)"
    return "goodput (req/s meeting goodput.* targets)"


def counts_conversations(workloads: Iterable[Any]) -> bool:
    """Whether a table's request_rate starts conversations (each of its runs' workloads)."""
    kinds = {str(w) for w in workloads if present(w)}
    return bool(kinds) and kinds <= CONVERSATION_WORKLOADS


def rate_axis_label(workloads: Iterable[Any], arrivals: str = "") -> str:
    """The x label of a figure over the configured rate: requests or conversations a second."""
    how = f", {arrivals}" if arrivals else ""
    if counts_conversations(workloads):
        return f"conversation rate (conversations/s{how})"
    return f"request rate (req/s{how})"
