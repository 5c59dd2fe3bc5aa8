"""steps.csv's window record: one row per window (a vLLM step is a window of one step), the
same columns from every backend, with each backend's own timings after them."""

from __future__ import annotations

from collections.abc import Sequence

# What a window is, as the scheduler formed it and every backend runs it: its id, when it
# started (seconds from the run's start), its steps k, its sequences (of which prefills), the
# tokens of its first step, the KV tokens it attends over (cached plus query, per sequence),
# the requests preempted to form it and the decode slots run past a request's end.
WINDOW_COLUMNS = ("window", "t_start", "k", "num_seqs", "num_prefill_seqs", "num_tokens",
                  "kv_tokens", "num_preempted", "num_wasted_steps")


def window_columns(timings: Sequence[str], lead: Sequence[str] = ()) -> tuple[str, ...]:
    """steps.csv's header for a backend: its columns before the record (the simulator's
    virtual engine), the record, then its timings."""
    return (*lead, *WINDOW_COLUMNS, *timings)


def window_record(window: int, t_start: float, k: int, num_seqs: int, num_prefill_seqs: int,
                  num_tokens: int, kv_tokens: int, num_preempted: int,
                  num_wasted_steps: int) -> tuple:
    """The record's values, in WINDOW_COLUMNS' order."""
    return (window, t_start, k, num_seqs, num_prefill_seqs, num_tokens, kv_tokens,
            num_preempted, num_wasted_steps)
