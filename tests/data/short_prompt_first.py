"""short_prompt_first: shortest prompt first; at most max_long long prompts run at once. A
policy written outside schedlab, loaded by its path (policy.module) in the tests that run a
user's own policy on every backend."""

from dataclasses import dataclass

from policies import Policy, register


@register
@dataclass(frozen=True)
class ShortPromptFirst(Policy):
    name = "short_prompt_first"
    orders_queue = True
    long_tokens: int = 128
    max_long: int = 1

    def queue_key(self, req, sched):
        return (req.prompt_len, req.arrival_time)

    def admit(self, req, sched):
        if req.prompt_len < self.long_tokens:
            return True
        return sum(r.prompt_len >= self.long_tokens for r in sched.running) < self.max_long
