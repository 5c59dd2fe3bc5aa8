"""spec_off_under_load: draft spec.num_tokens tokens while at most ``max_batch_size`` requests
run, none above (vLLM's speculative_disable_by_batch_size): under load the verify step's
extra tokens cost more than the accepted ones save."""

from __future__ import annotations

from dataclasses import dataclass

from common.checks import check_int
from policies.speculation import SpeculationPolicy, register_speculation


@register_speculation
@dataclass(frozen=True)
class SpecOffUnderLoad(SpeculationPolicy):
    name = "spec_off_under_load"
    max_batch_size: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("spec.max_batch_size", self.max_batch_size, 1)

    def window_tokens(self, sched) -> int:
        return self.num_tokens if len(sched.running) <= self.max_batch_size else 0
