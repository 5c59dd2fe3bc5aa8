"""sarathi: stall-free chunked prefill under a TBT target (Sarathi-Serve, Agrawal et al., OSDI '24).

Every window holds all running decodes first (never stalled behind a prefill), then prefill
chunks, continuing ones first, as ``chunked_prefill`` does; but the chunk sizes come from a time
budget rather than a fixed token count: each chunk is the largest that keeps the window's step
within ``tpot_slo_ms`` by the run's cost model (the hardware profile's), the way Sarathi-Serve
sizes its token budget from profiling against its TBT SLO: no other token budget applies unless
``scheduler.max_num_batched_tokens`` is set. Simplification: the budget is priced per window from the batch at hand
(Sarathi-Serve fixes one budget offline from the worst case); a window of decodes alone that is
over the target is not split.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import Policy, check_number, register
from policies.step_budget import largest_chunk


@register
@dataclass(frozen=True)
class Sarathi(Policy):
    name = "sarathi"
    mixed_batches = True
    chunk_prefills = True
    needs_step_time = True
    tpot_slo_ms: float = 50.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number("policy.tpot_slo_ms", self.tpot_slo_ms, positive=True)

    def window_budget(self, sched):
        tokens = sched.config.max_num_batched_tokens or sched.max_model_len
        return tokens, sched.config.max_num_seqs

    def chunk_size(self, req, num_new, budget, sched):
        return largest_chunk(sched, req, num_new, budget, self.tpot_slo_ms / 1e3)
