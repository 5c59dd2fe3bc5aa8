"""cp_promote: vLLM #8378, a prompt is prefilled whole in step 1 and decodes in steps 2..k."""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import KStepPolicy, register


@register
@dataclass(frozen=True)
class CPPromote(KStepPolicy):
    """Prompts that do not fit the budget left after the decodes wait; they are never chunked."""

    name = "cp_promote"
    mixed_batches = True
    chunk_prefills = False

    def window_steps(self, sched, has_prefill: bool) -> int:
        return self.num_steps

    def prefill_steps(self, k: int) -> int:
        return k
