"""smartspec (Liu et al. 2024, "Optimizing Speculative Decoding for Serving LLMs Using
Goodput"): per window, the speculation length k (0 to spec.num_tokens) that maximises the
estimated goodput, tokens emitted per second: n running decodes emit n (1 - a^(k+1)) / (1 - a)
tokens a step at acceptance rate a (the running estimate), in the draft model's steps
(spec.num_tokens + 1 of them whatever k is, as the engine runs them) plus a verify step of
k + 1 tokens each, priced by the run's cost model."""

from __future__ import annotations

from dataclasses import dataclass

from common.checks import check_int, check_number
from policies.speculation import SpeculationPolicy, draft_steps_time, register_speculation


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a k-token draft's step emits on average when each drafted token is accepted
    with probability ``rate`` given the ones before it were: 1 + rate + ... + rate^k."""
    return sum(rate ** i for i in range(k + 1))


@register_speculation
@dataclass(frozen=True)
class SmartSpec(SpeculationPolicy):
    name = "smartspec"
    needs_step_time = True
    prior_rate: float = 0.7  # the acceptance rate assumed until min_drafts are verified
    min_drafts: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number("spec.prior_rate", self.prior_rate, minimum=0.0, maximum=1.0)
        check_int("spec.min_drafts", self.min_drafts, 0)

    def window_tokens(self, sched) -> int:
        running = sched.running
        n = len(running)
        if n == 0:
            return 0
        rate = sched.spec_stats.rate_estimate(self.prior_rate, self.min_drafts)
        kv = longest = 0
        for req in running:
            c = req.num_computed_tokens + 1
            kv += c
            if c > longest:
                longest = c
        target, draft = sched.step_time_fn, sched.speculation.draft_step_time
        best, best_goodput = 0, n / target(n, kv, longest, ())
        for k in range(1, self.num_tokens + 1):
            seconds = target(n, kv + k * n, longest + k, (), n * (k + 1))
            if draft is not None:  # the engine's draft steps for a k-token draft
                seconds += draft_steps_time(draft, self.num_tokens, {k: (n, kv, longest)})
            goodput = n * expected_tokens(rate, k) / seconds
            if goodput > best_goodput:
                best, best_goodput = k, goodput
        return best
