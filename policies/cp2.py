"""cp2: chunked prefill + multi-step, always k steps; prefill chunks take part in step 1 only."""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import KStepPolicy, register


@register
@dataclass(frozen=True)
class CP2(KStepPolicy):
    name = "cp2"
    mixed_batches = True
    chunk_prefills = True

    def window_steps(self, sched, has_prefill: bool) -> int:
        return self.num_steps
