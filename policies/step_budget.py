"""The largest prefill chunk that keeps a window's first step within a time target, priced by
the run's cost model (``Scheduler.step_time_fn``): Sarathi-Serve's token budget, per window."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from policies.request import Request
    from policies.scheduler import Scheduler


def step_seconds(sched: Scheduler, extra: tuple[int, int, bool] | None = None) -> float:
    """GPU seconds of the first step of the window being formed (``sched.forming``), with one
    more prefill chunk ``extra`` = (query tokens, cached tokens, samples) if given."""
    decodes = decode_tokens = decode_kv = longest = 0
    chunks: list[tuple[int, int, bool]] = []
    for s in sched.forming:
        cq = s.num_cached_tokens + s.num_query_tokens
        if s.is_prefill:
            chunks.append((s.num_query_tokens, s.num_cached_tokens, s.samples))
        else:
            decodes += 1
            decode_tokens += s.num_query_tokens
            decode_kv += cq
            longest = max(longest, cq)
    if extra is not None:
        chunks.append(extra)
    if decode_tokens != decodes:  # a decode computes several tokens
        return sched.step_time_fn(decodes, decode_kv, longest, chunks, decode_tokens)
    return sched.step_time_fn(decodes, decode_kv, longest, chunks)


def largest_chunk(sched: Scheduler, req: Request, num_new: int, budget: int,
                  target_s: float) -> int:
    """The most of ``req``'s ``num_new`` tokens (at most ``budget``) whose chunk keeps the step
    within ``target_s``; 0 if not even one token does. A step's time grows with its tokens, so
    a bisection finds it."""
    cached = req.seq_len - num_new  # computed, or (on admission) found in the prefix cache
    hi = min(num_new, budget)

    def fits(q: int) -> bool:
        return step_seconds(sched, (q, cached, cached + q >= req.seq_len)) <= target_s

    if hi <= 0 or not fits(1):
        return 0
    if fits(hi):
        return hi
    lo = 1  # fits(lo) and not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
