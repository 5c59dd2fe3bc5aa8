"""single_step: the vLLM V0 default, a prefill-only batch when prompts fit, else one decode step."""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import Policy, register


@register
@dataclass(frozen=True)
class SingleStep(Policy):
    name = "single_step"
    reads_running = False
