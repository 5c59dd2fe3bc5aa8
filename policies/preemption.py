"""Preemption for a waiting request, shared by the preemptive policies (priority, mlfq)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from policies.request import Request
    from policies.scheduler import Scheduler


def victims_for(sched: Scheduler, key: Callable[[Request, Scheduler], Any]) -> list[Request]:
    """The running requests to preempt, from the tail of the (key-sorted) running queue, while
    the first waiting request in key order cannot be admitted (KV blocks above the watermark or
    a seat) and the tail ranks below it: vLLM V0's priority preemption, one waiting request per
    window. A request whose outputs are still in flight (overlap) is neither."""
    waiting = next((r for r in sched.waiting if not r.num_output_placeholders), None)
    if waiting is None:
        return []
    bm = sched.block_manager
    rank = key(waiting, sched)
    hits = bm.match(waiting)  # its cached prefix takes no new block
    need = bm.blocks_needed(waiting.seq_len + sched.policy.max_steps, hits)
    free = bm.num_free_blocks
    seats = sched.config.max_num_seqs - len(sched.running)
    victims: list[Request] = []
    for victim in reversed(sched.running):
        if free - need >= bm.watermark_blocks and seats > 0:
            break
        if not key(victim, sched) > rank or victim.num_output_placeholders:
            break
        victims.append(victim)
        free += bm.blocks_freed_by(victim)  # a block another request shares stays held
        seats += 1
    return victims
