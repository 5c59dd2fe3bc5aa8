"""sjf: shortest predicted remaining output first (non-preemptive), with a starvation bound.

Follows the learning-to-rank scheduler of Fu et al. 2024 ("Efficient LLM Scheduling by Learning
to Rank") and Qiu et al. 2024's proxy-model SJF: the waiting queue is ordered by a predicted
output length, so short requests stop queueing behind long ones. The predictor is a setting:
``oracle`` (the true length, ``max_tokens``), ``noisy`` (the true length times a lognormal
error exp(N(0, sigma)), seeded per request), ``bucket`` (the class of the true length among
``buckets``, as a ranking predictor gives: only the order between classes is known).
A request that has waited ``starvation_s`` seconds goes ahead of every request that has not
(FCFS among them), so a long request is never starved forever; each request's longest wait is
recorded (``max_queueing_delay_ms`` in the results). Simplification: the prediction is made
once per request, not refined as it generates (the remaining length is the prediction less the
tokens generated, for a preempted request).
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass, field

from policies.base import Policy, check_int, check_number, register

PREDICTORS = ("oracle", "noisy", "bucket")


@register
@dataclass(frozen=True)
class SJF(Policy):
    name = "sjf"
    reads_running = False
    orders_queue = True
    predictor: str = "oracle"
    sigma: float = 0.5  # noisy: the lognormal error's sigma
    seed: int = 0  # noisy: the error's seed
    buckets: tuple[int, ...] = (64, 128, 256, 512, 1024)  # bucket: the classes' upper bounds
    starvation_s: float = 30.0  # a request waiting this long goes first
    _predicted: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.predictor not in PREDICTORS:
            raise ValueError(f"policy.predictor must be one of {', '.join(PREDICTORS)}, got "
                             f"{self.predictor!r}")
        check_number("policy.sigma", self.sigma, minimum=0)
        check_int("policy.seed", self.seed, 0)
        check_number("policy.starvation_s", self.starvation_s, positive=True)
        object.__setattr__(self, "buckets", tuple(self.buckets))
        for b in self.buckets:
            check_int("policy.buckets", b, 1)
        if list(self.buckets) != sorted(set(self.buckets)):
            raise ValueError(f"policy.buckets must increase, got {list(self.buckets)}")

    def predicted_len(self, req) -> float:
        """The predicted output length of ``req`` (made once, on first use)."""
        got = self._predicted.get(req.request_id)
        if got is None:
            true = req.max_tokens
            if self.predictor == "oracle":
                got = float(true)
            elif self.predictor == "noisy":
                rng = random.Random(self.seed * 1_000_003 + req.request_id)
                got = true * math.exp(rng.gauss(0.0, self.sigma))
            else:
                got = float(bisect.bisect_left(self.buckets, true))
            self._predicted[req.request_id] = got
        return got

    def queue_key(self, req, sched):
        waited = req.waiting_since is not None and sched.now - req.waiting_since >= self.starvation_s
        if waited:
            return (0, req.waiting_since, 0.0)
        left = self.predicted_len(req)
        if self.predictor != "bucket":
            left -= req.num_output_tokens
        return (1, left, req.arrival_time)
