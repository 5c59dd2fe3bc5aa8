"""cp1: chunked prefill + multi-step, forced to a single step whenever a prefill is in the batch."""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import KStepPolicy, register


@register
@dataclass(frozen=True)
class CP1(KStepPolicy):
    name = "cp1"
    mixed_batches = True
    chunk_prefills = True

    def window_steps(self, sched, has_prefill: bool) -> int:
        return 1 if has_prefill else self.num_steps
