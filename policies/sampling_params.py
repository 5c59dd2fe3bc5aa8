"""How a request's tokens are sampled: temperature, top-k, top-p and a seed (the server's
``backend.sampling``, or a request's own settings on the HTTP server), vLLM's penalties, and
the logprobs a served request asks to have returned."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.checks import check_int, check_number, check_settings

# A temperature below this is greedy, as in vLLM (its _SAMPLING_EPS): the logits divided by a
# tinier one overflow float32 (1e-40 makes every logit inf, and softmax NaN), and well before
# that the sample is the argmax anyway.
SAMPLING_EPS = 1e-5

# The most top logprobs a request may ask for, per token: vLLM's default max_logprobs.
MAX_LOGPROBS = 20

# vLLM's bounds of the OpenAI penalties (its SamplingParams checks)
MAX_PENALTY = 2.0

# A token's logprobs as the engine returns them: its own, then the ids and logprobs of the most
# likely tokens (as many as its request asks for)
Logprob = tuple[float, list[int], list[float]]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """One request's sampling settings, checked; a temperature below ``SAMPLING_EPS`` is kept
    as 0 (greedy), so that every sampler and every comparison of settings sees it as greedy."""

    temperature: float = 0.0  # 0: greedy (benchmark_serving's setting)
    top_k: int = -1  # -1: whole vocabulary
    top_p: float = 1.0
    # A request's own seed: its samples depend on the seed and each token's position alone
    # (real_backend/sampling.py); None: drawn from the engine's generator (backend.seed).
    seed: int | None = None
    # vLLM's penalties, as its sampler applies them before temperature: presence and
    # frequency over the output's token counts, repetition over every token of the prompt
    # and the output (a positive logit divided by it, a negative one multiplied); neutral at
    # 0, 0 and 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # The logprobs returned: with each sampled token its own and the ``logprobs`` most likely
    # tokens' (None: none), with each prompt token from the second on the same
    # (``prompt_logprobs``: the completions API's echo)
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        """Every value checked here, for both the config and a served request (never cast:
        top_k=2.5 must not run as 2, nor temperature=nan as anything)."""
        temperature = float(check_number("temperature", self.temperature, minimum=0))
        if check_int("top_k", self.top_k, -1) == 0:
            raise ValueError(f"top_k must be -1 or >= 1, got {self.top_k}")
        if not 0.0 < check_number("top_p", self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (isinstance(self.seed, bool)
                                      or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            check_number(name, getattr(self, name), minimum=-MAX_PENALTY, maximum=MAX_PENALTY)
        check_number("repetition_penalty", self.repetition_penalty, positive=True)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and check_int(name, value, 0) > MAX_LOGPROBS:
                raise ValueError(f"{name} must be at most {MAX_LOGPROBS} (vLLM's max_logprobs), "
                                 f"got {value}")
        object.__setattr__(self, "temperature", 0.0 if temperature < SAMPLING_EPS
                           else temperature)
        object.__setattr__(self, "top_p", float(self.top_p))

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any] | None) -> SamplingParams:
        """The ``backend.sampling`` section (no seed: backend.seed seeds the generator)."""
        d = dict(d or {})
        check_settings("backend.sampling", d, ("temperature", "top_k", "top_p"))
        try:
            return cls(d.get("temperature", 0.0), d.get("top_k", -1), d.get("top_p", 1.0))
        except ValueError as err:
            raise ValueError(f"backend.sampling.{err}") from None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a penalty changes the logits."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
