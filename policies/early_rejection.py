"""Mooncake-style early rejection (Qin et al., FAST '25, "Mooncake": its overload-oriented
scheduling rejects a request at arrival when the load it would meet says it would miss its
SLO, rather than after it has spent prefill time): a decision at the router's level, made for a
disaggregated cluster (simulator/disaggregation.py gives it the pools' loads and prices)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from policies.request import Request
from policies.routers import ReplicaLoad


@dataclass
class EarlyRejection:
    """Reject ``req`` when its predicted TTFT or TPOT exceeds its target: its SLO class's
    (``Request.ttft_slo_ms``, ``tpot_slo_ms``), else the run's (``ttft_ms``, ``tpot_ms``:
    goodput.*); no target, no rejection on that count.

    Predicted TTFT: the prompt tokens queued on the prefill replica it was routed to and in the
    window it runs, its own included, prefilled as one batch of prompts of its length
    (``prefill_time[i](n, m)``: seconds of a step prefilling m prompts of n tokens on
    prefill-pool replica i). Predicted TPOT: the step time of the least loaded decode replica
    with it added (``decode_step_time[j]``: seconds of a decode step of n sequences over kv
    tokens on decode replica j; its unfinished requests are its batch, its KV in use plus this
    prompt the KV read). Both leave out what the cost model cannot know
    yet (prefix hits, the decode batch a window will really hold)."""

    prefill_time: Sequence[Callable[[int, int], float]]
    decode_step_time: Sequence[Callable[[int, int], float]]
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def rejects(self, req: Request, prefill: ReplicaLoad,
                decode: Sequence[ReplicaLoad]) -> bool:
        ttft = req.ttft_slo_ms if req.ttft_slo_ms is not None else self.ttft_ms
        if ttft is not None:
            own = req.prompt_len
            # the prompts queued and those in the window on its GPU (a prefill replica's
            # running requests), its own included, as prompts of its length
            running = sum(r.prompt_len for s in prefill.schedulers for r in s.running)
            ahead = math.ceil((prefill.queued_prompt_tokens + running + own) / own)
            if self.prefill_time[prefill.index](own, ahead) * 1e3 > ttft:
                return True
        tpot = req.tpot_slo_ms if req.tpot_slo_ms is not None else self.tpot_ms
        if tpot is not None and req.max_tokens > 1 and decode:
            best = min(self.decode_step_time[d.index](d.outstanding + 1,
                                                      d.kv_tokens_used + req.prompt_len)
                       for d in decode)
            if best * 1e3 > tpot:
                return True
        return False
