"""How a request's tokens are sampled: temperature, top-k, top-p and a seed (the server's
``backend.sampling``, or a request's own settings on the HTTP server)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from policies.base import check_int, check_number, check_settings


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (benchmark_serving's setting)
    top_k: int = -1  # -1: whole vocabulary
    top_p: float = 1.0
    # A request's own seed: its samples depend on the seed and each token's position alone
    # (real_backend/sampling.py); None: drawn from the engine's generator (backend.seed).
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or >= 1, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (isinstance(self.seed, bool)
                                      or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any] | None) -> SamplingParams:
        """The ``backend.sampling`` section (no seed: backend.seed seeds the generator)."""
        d = dict(d or {})
        check_settings("backend.sampling", d, ("temperature", "top_k", "top_p"))
        # checked, never cast: top_k=2.5 must not run as 2, nor temperature=nan as anything
        try:
            return cls(float(check_number("backend.sampling.temperature",
                                          d.get("temperature", 0.0))),
                       check_int("backend.sampling.top_k", d.get("top_k", -1), -1),
                       float(check_number("backend.sampling.top_p", d.get("top_p", 1.0))))
        except ValueError as err:
            msg = str(err)
            raise ValueError(msg if msg.startswith("backend.") else
                             f"backend.sampling.{msg}") from None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
