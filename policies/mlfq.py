"""mlfq: FastServe's skip-join multi-level feedback queue (Wu et al. 2023), preemptive.

Level i grants ``quantum_tokens * 2**i`` tokens of service (prompt tokens prefilled plus output
tokens generated). Skip-join: a request enters at the first level whose quantum covers its
prompt, since its first iteration alone would use up the quanta above it; it is demoted a level
each time it has used the quantum of its level (the last level keeps it). Lower levels are
served first (FCFS within a level), and a waiting request that cannot be admitted preempts
running requests of higher levels, the most demoted first. A request that has waited
``starvation_s`` seconds goes ahead of every level until it finishes (FCFS among such, and
never preempted by another), so none starves past that bound as long as the requests that
reached it fit in the cache together. Simplifications: a preempted request is recomputed rather
than swapped to host memory (FastServe's proactive KV swapping), and demotion is counted in
tokens rather than in seconds of GPU time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from policies.base import Policy, check_int, check_number, register
from policies.preemption import victims_for


@register
@dataclass(frozen=True)
class MLFQ(Policy):
    name = "mlfq"
    orders_queue = True
    preemptive = True
    num_levels: int = 4
    quantum_tokens: int = 256  # level 0's quantum; level i's is quantum_tokens * 2**i
    starvation_s: float = 30.0
    _boosted: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("policy.num_levels", self.num_levels, 1)
        check_int("policy.quantum_tokens", self.quantum_tokens, 1)
        check_number("policy.starvation_s", self.starvation_s, positive=True)

    def level(self, req) -> int:
        """The request's level now: skip-join entry by prompt, one level down per quantum used."""
        q, last = self.quantum_tokens, self.num_levels - 1
        level = 0
        while level < last and q << level < req.prompt_len:
            level += 1
        used = req.num_output_tokens  # service past the prompt, which the entry level covered
        while level < last and used >= q << level:
            used -= q << level
            level += 1
        return level

    def queue_key(self, req, sched):
        boosted = self._boosted.get(req.request_id)
        if boosted is None and req.waiting_since is not None \
                and sched.now - req.waiting_since >= self.starvation_s:
            boosted = self._boosted[req.request_id] = req.waiting_since + self.starvation_s
        if boosted is not None:  # until it finishes: no other starving request preempts it
            return (-1, boosted)
        return (self.level(req), req.arrival_time)

    def preempt_for_waiting(self, sched):
        return victims_for(sched, self.queue_key)
