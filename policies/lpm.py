"""lpm: the waiting request with the longest cached prompt prefix first (SGLang's ``lpm``).

SGLang orders its waiting queue by the length of each prompt's match in the radix cache, so
that requests sharing a prefix run while it is cached (Zheng et al. 2024, "SGLang: Efficient
Execution of Structured Language Model Programs"). Here the match is the block manager's
longest run of cached full blocks (``BlockManager.match``); ties go in arrival order. Past
``fcfs_above`` waiting requests the queue is FCFS, as SGLang falls back when matching every
request each round costs too much. Batching is multi_step's: decode windows of ``num_steps``.
Simplification: the match is in whole blocks, not tokens (the radix tree's granularity).
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import check_int, register
from policies.multi_step import MultiStep


@register
@dataclass(frozen=True)
class LongestPrefixMatch(MultiStep):
    name = "lpm"
    reads_running = False
    orders_queue = True
    num_steps: int = 1
    fcfs_above: int = 128  # waiting requests past which the queue is FCFS (SGLang's threshold)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("policy.fcfs_above", self.fcfs_above, 0)

    def queue_key(self, req, sched):
        if len(sched.waiting) > self.fcfs_above:
            return (0, req.arrival_time)
        return (-len(sched.block_manager.match(req)), req.arrival_time)
