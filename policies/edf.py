"""edf: earliest TTFT deadline first, with optional admission control.

A request's deadline is its arrival plus its TTFT target (the request's SLO class's, else
``ttft_slo_ms``), as DistServe and SLO-aware schedulers frame goodput. With
``admission_control``, a request whose deadline has passed can no longer count toward goodput:
it is deferred behind every request that still can (EDF among the deferred too), so it is
served only with capacity the others leave, instead of pushing them past their deadlines.
Non-preemptive.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import Policy, check_bool, check_number, register


def ttft_target_s(req, default_ms: float) -> float:
    """The request's own TTFT target (its SLO class's) or the policy's, in seconds."""
    return (req.ttft_slo_ms if req.ttft_slo_ms is not None else default_ms) / 1e3


@register
@dataclass(frozen=True)
class EDF(Policy):
    name = "edf"
    reads_running = False
    orders_queue = True
    ttft_slo_ms: float = 1000.0
    admission_control: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number("policy.ttft_slo_ms", self.ttft_slo_ms, positive=True)
        check_bool("policy.admission_control", self.admission_control)

    def queue_key(self, req, sched):
        deadline = req.arrival_time + ttft_target_s(req, self.ttft_slo_ms)
        late = self.admission_control and req.num_output_tokens == 0 and sched.now > deadline
        return (late, deadline)
