"""The largest prefill chunk that keeps a window's first step within a time target, priced by
the run's cost model (``Scheduler.step_time_fn``): Sarathi-Serve's token budget, per window."""

from __future__ import annotations

from typing import TYPE_CHECKING

from policies.speculation import draft_steps_time

if TYPE_CHECKING:
    from collections.abc import Sequence

    from policies.base import StepTimeFn
    from policies.batch import ScheduledSeq
    from policies.request import Request
    from policies.scheduler import Scheduler


def step_seconds(sched: Scheduler, extra: tuple[int, int, bool] | None = None) -> float:
    """GPU seconds of the first step of the window being formed (``sched.forming``), with one
    more prefill chunk ``extra`` = (query tokens, cached tokens, samples) if given; with
    drafting decodes, the draft model's steps before it too (the catch-up forward of requests
    whose draft KV lags is the engine's state, unknown here, and left out)."""
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
    if decode_tokens != decodes:  # a decode computes several tokens: it drafts
        t = sched.step_time_fn(decodes, decode_kv, longest, chunks, decode_tokens)
        spec = sched.speculation
        if spec is not None and spec.draft_step_time is not None:
            t += _draft_seconds(sched.forming, spec.draft_step_time, spec.num_tokens)
        return t
    return sched.step_time_fn(decodes, decode_kv, longest, chunks)


def _draft_seconds(forming: Sequence[ScheduledSeq], draft_step: StepTimeFn,
                   num_tokens: int) -> float:
    """The draft model's steps before the first verify step of the window being formed: what
    the window's time is, and the budget bounds, besides the verify step."""
    groups: dict[int, list[int]] = {}
    for s in forming:
        k = s.num_query_tokens - 1
        if s.is_prefill or not k:
            continue
        ctx = s.num_cached_tokens + 1
        g = groups.get(k)
        if g is None:
            groups[k] = [1, ctx, ctx]
        else:
            g[0] += 1
            g[1] += ctx
            g[2] = max(g[2], ctx)
    return draft_steps_time(draft_step, num_tokens, groups)


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
