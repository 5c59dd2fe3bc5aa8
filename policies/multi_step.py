"""multi_step: decode windows of k steps; prefill batches run one step (vLLM PR #7000)."""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import KStepPolicy, register


@register
@dataclass(frozen=True)
class MultiStep(KStepPolicy):
    name = "multi_step"
    reads_running = False

    def window_steps(self, sched, has_prefill: bool) -> int:
        return 1 if has_prefill else self.num_steps
