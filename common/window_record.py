"""steps.csv's window record: one row per window (a vLLM step is a window of one step), the
same columns from every backend, then the stages the simulator and the real engine both time,
under one name each, then each backend's own timings. Every backend's header comes from
``window_columns``, so a column means the same in every run's steps.csv."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# What a window is, as the scheduler formed it and every backend runs it: its id, when it
# started (seconds from the run's start), its steps k, its sequences (of which prefills), the
# tokens of its first step, the KV tokens it attends over (cached plus query, per sequence),
# the requests preempted to form it and the decode slots run past a request's end.
WINDOW_COLUMNS = ("window", "t_start", "k", "num_seqs", "num_prefill_seqs", "num_tokens",
                  "kv_tokens", "num_preempted", "num_wasted_steps")

# The stages of a window that the simulator and the real engine both have: the CPU's time
# before the GPU starts (scheduling, and preparing the window's inputs), the GPU's time for the
# whole window and for each of its steps (";"-separated). vLLM's engine times a step whole
# (its step_s), so its rows have none of them.
STAGE_COLUMNS = ("schedule_prepare_s", "gpu_s", "gpu_step_s")


def window_columns(own: Sequence[str] = (), lead: Sequence[str] = (), *,
                   stages: bool = True) -> tuple[str, ...]:
    """steps.csv's header for a backend: its columns before the record (the simulator's
    virtual engine), the record, the stage timings (``stages``), then its own columns."""
    return (*lead, *WINDOW_COLUMNS, *(STAGE_COLUMNS if stages else ()), *own)


def window_record(window: int, t_start: float, k: int, num_seqs: int, num_prefill_seqs: int,
                  num_tokens: int, kv_tokens: int, num_preempted: int,
                  num_wasted_steps: int) -> tuple:
    """The record's values, in WINDOW_COLUMNS' order."""
    return (window, t_start, k, num_seqs, num_prefill_seqs, num_tokens, kv_tokens,
            num_preempted, num_wasted_steps)


def stage_cells(schedule_prepare_s: float, gpu_step_s: Sequence[float]) -> tuple:
    """STAGE_COLUMNS' values, from the CPU's time before the GPU and each step's GPU time."""
    return (schedule_prepare_s, sum(gpu_step_s),
            ";".join(["%.6f"] * len(gpu_step_s)) % tuple(gpu_step_s))  # (one format, in C)


def window_row(record: tuple, stages: tuple | None = None, **own: Any) -> dict[str, Any]:
    """A named steps.csv row: the record (``window_record``), the stage cells
    (``stage_cells``, where the backend times them) and the backend's own columns, in
    ``window_columns``' order."""
    row = dict(zip(WINDOW_COLUMNS, record, strict=True))
    if stages is not None:
        row.update(zip(STAGE_COLUMNS, stages, strict=True))
    row.update(own)
    return row
