"""spec_fixed: every decode drafts spec.num_tokens tokens, whatever the load."""

from __future__ import annotations

from dataclasses import dataclass

from policies.speculation import SpeculationPolicy, register_speculation


@register_speculation
@dataclass(frozen=True)
class SpecFixed(SpeculationPolicy):
    name = "spec_fixed"
