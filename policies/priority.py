"""priority: vLLM V0's ``--scheduling-policy priority``: lower ``Request.priority`` first (FCFS
among equals, by arrival), and a waiting request that cannot be admitted preempts (recompute)
running requests of lower priority, the lowest first, as vLLM V0's
``_schedule_priority_preemption`` does. The running queue keeps the same order, so a decode
that runs out of KV blocks also preempts the lowest-priority request first."""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import Policy, register
from policies.preemption import victims_for


@register
@dataclass(frozen=True)
class Priority(Policy):
    name = "priority"
    orders_queue = True
    preemptive = True

    def queue_key(self, req, sched):
        return (req.priority, req.arrival_time)

    def preempt_for_waiting(self, sched):
        return victims_for(sched, self.queue_key)
