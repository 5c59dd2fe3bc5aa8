"""Token sampling on the device: greedy, temperature, top-k and top-p, seeded, with no host sync;
the device-side map of each request's newest token that overlap scheduling reads inputs from."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from policies.base import check_int, check_number, check_settings
from policies.request import Request, RequestState


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
        # checked, never cast: top_k=2.5 must not run as 2, nor temperature=nan as anything
        return cls(float(check_number("backend.sampling.temperature", d.get("temperature", 0.0))),
                   check_int("backend.sampling.top_k", d.get("top_k", -1), -1),
                   float(check_number("backend.sampling.top_p", d.get("top_p", 1.0))))

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


class TokenMap:
    """Each running request's newest sampled token on the device, in a row the map hands out.

    Overlap scheduling builds window n+1's inputs before window n's ids reach the host:
    sampling writes every step's ids into the map, and window n+1's input ids are gathered
    from it on the device. A request's row goes back once it is no longer running; a window
    still in flight may write the row after that, but the stream runs windows in order, so its
    next owner writes the row (its first sample) before anything reads it.
    """

    def __init__(self, num_rows: int, device: torch.device) -> None:
        self.tokens = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self._row: dict[Request, int] = {}
        self._free = list(range(num_rows - 1, -1, -1))

    def rows(self, requests: Sequence[Request]) -> list[int]:
        """Each request's row, handed out on first use (rows of finished and preempted
        requests are given back first)."""
        row = self._row
        for req in [r for r in row if r.state is not RequestState.RUNNING]:
            self._free.append(row.pop(req))
        out = []
        for req in requests:
            r = row.get(req)
            if r is None:
                if not self._free:
                    raise RuntimeError(f"the token map's {len(row)} rows are all held by "
                                       "running requests")
                r = row[req] = self._free.pop()
            out.append(r)
        return out

    def write(self, rows: torch.Tensor, sampled: torch.Tensor) -> None:
        self.tokens.index_copy_(0, rows, sampled)

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        return self.tokens.index_select(0, rows)
