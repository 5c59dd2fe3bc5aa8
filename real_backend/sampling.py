"""Token sampling on the device: greedy, temperature, top-k and top-p, seeded, with no host sync."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from policies.base import check_settings


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (benchmark_serving's setting)
    top_k: int = -1  # -1: whole vocabulary
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"backend.sampling.temperature must be >= 0, got {self.temperature}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"backend.sampling.top_k must be -1 or >= 1, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"backend.sampling.top_p must be in (0, 1], got {self.top_p}")

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any] | None) -> SamplingParams:
        d = dict(d or {})
        check_settings("backend.sampling", d, ("temperature", "top_k", "top_p"))
        return cls(float(d.get("temperature", 0.0)), int(d.get("top_k", -1)),
                   float(d.get("top_p", 1.0)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> torch.Tensor:
    """Token ids [N] (int64, on the logits' device) from fp32 logits [N, vocab]."""
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token once the mass before it already reaches top_p; the first always stays.
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    # Gumbel-max in its exponential form: argmax(p / E), E ~ Exp(1), samples from p with no sync.
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)
