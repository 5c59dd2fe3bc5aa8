"""slo_adaptive: chunked prefill with multi-step decode windows whose k (and chunk sizes) are
chosen per window from the live queue to keep requests within ``ttft_slo_ms`` and
``tpot_slo_ms``, so that goodput (requests meeting both) is the most the load allows.

The rule, per window (cp1's structure: a window with a prefill runs one step):
1. Chunks: with a cost model, each prefill chunk is the largest that keeps the step within the
   TPOT target (as ``sarathi``); without one, the token budget as ``chunked_prefill``.
2. A decode window's k trades the CPU's per-window cost against waiting. Longer windows only
   help TPOT (the scheduler's cost is spread over more tokens), so k is the longest that TTFT
   allows: a request arriving meanwhile waits up to k * s (s: the measured time per decode
   step) for the window to end before its prefill, so under load (arrivals, or a queue) k * s
   may take at most ``ttft_share`` of the TTFT target, less what the oldest waiting request has
   already waited; offline, with nothing waiting, that cap vanishes.
3. k never exceeds the longest remaining output (no window of empty slots), nor ``num_steps``.
This is schedlab's own rule (after the SLO-aware k of
adaptive multi-step scheduling), not a published system's.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import KStepPolicy, check_number, register
from policies.step_budget import largest_chunk


@register
@dataclass(frozen=True)
class SLOAdaptive(KStepPolicy):
    name = "slo_adaptive"
    mixed_batches = True
    chunk_prefills = True
    num_steps: int = 16  # the longest window
    ttft_slo_ms: float = 1000.0
    tpot_slo_ms: float = 50.0
    ttft_share: float = 0.25

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number("policy.ttft_slo_ms", self.ttft_slo_ms, positive=True)
        check_number("policy.tpot_slo_ms", self.tpot_slo_ms, positive=True)
        check_number("policy.ttft_share", self.ttft_share, positive=True)

    def chunk_size(self, req, num_new, budget, sched):
        if sched.step_time_fn is None:
            return min(num_new, budget)
        return largest_chunk(sched, req, num_new, budget, self.tpot_slo_ms / 1e3)

    def window_steps(self, sched, has_prefill: bool) -> int:
        if has_prefill:
            return 1
        longest = max((r.max_tokens - r.num_output_tokens - r.num_output_placeholders
                       for r in sched.running), default=1)
        k = max(1, min(self.num_steps, longest))
        s = sched.step_time
        if not s:
            return k
        if sched.arrival_rate() > 0 or sched.waiting:
            waited = max((sched.now - r.arrival_time for r in sched.waiting), default=0.0)
            room = self.ttft_share * self.ttft_slo_ms / 1e3 - waited
            k = min(k, max(1, int(room / s)) if room > 0 else 1)
        return k
