"""``router=kv_balance``: a router for a disaggregated cluster's decode pool (any pool works)
that balances KV memory by what each replica's requests will hold, not what they hold now: a
decode replica's blocks fill as its requests decode, so the blocks in use when a request is
placed (``least_kv``) understate a replica that has just taken long requests. Registered as a
user's router would be (this file and conf/router/kv_balance.yaml, which names it as its
``module``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from policies.request import Request
from policies.routers import ReplicaLoad, Router, register_router


def kv_capacity_tokens(load: ReplicaLoad) -> int:
    """The KV tokens a replica's caches hold, over its virtual engines."""
    return sum(s.block_manager.num_blocks * s.block_manager.block_size for s in load.schedulers)


@register_router
@dataclass
class KVBalance(Router):
    """The replica whose predicted KV footprint, as a fraction of its KV cache, is least once
    the request is added: the footprint is the prompt plus max_tokens of every request routed
    there and not finished (``outstanding_tokens``: each holds that much at its last token),
    so replicas of different KV sizes fill alike. Ties go to the lowest index."""

    name: ClassVar[str] = "kv_balance"

    def route(self, req: Request, replicas: Sequence[ReplicaLoad], now: float) -> int:
        own = req.prompt_len + req.max_tokens
        best, best_key = 0, None
        for r in replicas:
            key = (r.outstanding_tokens + own) / kv_capacity_tokens(r)
            if best_key is None or key < best_key:
                best, best_key = r.index, key
        return best
