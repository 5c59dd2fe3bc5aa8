"""Routers: which replica of a cluster serves each request (a scheduling decision a level up),
the load a router sees of each replica, and the registry that picks a router by name.

A router is asked once per request, when the client sends it: ``route(req, replicas, now)``
returns the index of the replica it goes to. What it sees of a replica (``ReplicaLoad``):
requests routed there and not finished (``outstanding``), their prompt and output tokens
(``outstanding_tokens``), the prompt tokens of those not admitted yet
(``queued_prompt_tokens``) and the KV blocks its schedulers hold (``kv_blocks_used``). Ties go
to the lowest index, so a run is the same every time (``random`` and ``power_of_two`` draw from
their own seeded generator).

Your own router: a module (``router.module``: a dotted name or a .py file) that registers a
class with ``@register_router``, as a policy does (docs/cluster.md shows one); its answers are
checked (an int in range(len(replicas)), policies/hooks.py).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from policies.base import build_registered, check_int, check_number
from policies.prefix_cache import block_hashes
from policies.request import Request
from policies.scheduler import Scheduler


@dataclass(slots=True, eq=False)
class ReplicaLoad:
    """What a router sees of one replica; the backend keeps the counters."""

    index: int  # its place among the replicas routed to (a disaggregated cluster's pool)
    schedulers: list[Scheduler]  # the replica's virtual engines
    group: int = 0  # its replica group (heterogeneous clusters)
    outstanding: int = 0  # requests routed here and not finished
    outstanding_tokens: int = 0  # prompt + max_tokens of those requests
    queued_prompt_tokens: int = 0  # prompt tokens of those not admitted yet

    @property
    def kv_blocks_used(self) -> int:
        return sum(s.block_manager.num_blocks - s.block_manager.num_free_blocks
                   for s in self.schedulers)

    @property
    def kv_tokens_used(self) -> int:
        return sum((s.block_manager.num_blocks - s.block_manager.num_free_blocks)
                   * s.block_manager.block_size for s in self.schedulers)


class Router:
    """The interface: pick a replica for each request as it is sent."""

    name: ClassVar[str] = "router"

    def route(self, req: Request, replicas: Sequence[ReplicaLoad], now: float) -> int:
        raise NotImplementedError


ROUTERS: dict[str, type[Router]] = {}


def register_router(cls: type[Router]) -> type[Router]:
    """Class decorator: make ``cls`` selectable as ``router=<cls.name>``."""
    ROUTERS[cls.name] = cls
    return cls


def make_router(name: str, module: str | None = None, **params: Any) -> Router:
    """Build a router by registry name (``router.name``); unknown names and settings are
    one-line errors. ``module`` (``router.module``) imports a user's router first."""
    return build_registered("router", ROUTERS, name, module, params)


def _least(replicas: Sequence[ReplicaLoad], key) -> int:
    best, best_key = 0, None
    for r in replicas:
        k = key(r)
        if best_key is None or k < best_key:
            best, best_key = r.index, k
    return best


@register_router
@dataclass
class RoundRobin(Router):
    """Replica 0, 1, ..., n-1, 0, ... in send order."""

    name: ClassVar[str] = "round_robin"
    _next: int = field(default=0, init=False)

    def route(self, req: Request, replicas: Sequence[ReplicaLoad], now: float) -> int:
        i = self._next % len(replicas)
        self._next += 1
        return i


@register_router
@dataclass
class RandomRouter(Router):
    """A replica drawn uniformly at random (seeded)."""

    name: ClassVar[str] = "random"
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("router.seed", self.seed, 0)
        self._rng = random.Random(self.seed)

    def route(self, req: Request, replicas: Sequence[ReplicaLoad], now: float) -> int:
        return self._rng.randrange(len(replicas))


@register_router
@dataclass
class LeastOutstanding(Router):
    """The replica with the fewest requests routed to it and not finished."""

    name: ClassVar[str] = "least_outstanding"

    def route(self, req: Request, replicas: Sequence[ReplicaLoad], now: float) -> int:
        return _least(replicas, lambda r: r.outstanding)


@register_router
@dataclass
class LeastKV(Router):
    """The replica with the least KV load: tokens in its KV blocks plus prompt tokens queued."""

    name: ClassVar[str] = "least_kv"

    def route(self, req: Request, replicas: Sequence[ReplicaLoad], now: float) -> int:
        return _least(replicas, lambda r: r.kv_tokens_used + r.queued_prompt_tokens)


@register_router
@dataclass
class PowerOfTwo(Router):
    """Two distinct replicas drawn at random (seeded); the one with fewer outstanding tokens
    (the first drawn on a tie). Mitzenmacher's power of two choices."""

    name: ClassVar[str] = "power_of_two"
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("router.seed", self.seed, 0)
        self._rng = random.Random(self.seed)

    def route(self, req: Request, replicas: Sequence[ReplicaLoad], now: float) -> int:
        if len(replicas) == 1:
            return 0
        a, b = self._rng.sample(range(len(replicas)), 2)
        return b if replicas[b].outstanding_tokens < replicas[a].outstanding_tokens else a


@register_router
@dataclass
class PrefixAffinity(Router):
    """Keep a conversation (``Request.conversation_id``), or a shared prompt prefix, on the
    replica that served it last, where its KV prefix is: a request goes where the longest run
    of its leading prompt blocks went (the prefix cache's block hashes, from its content
    segments; a Mooncake trace's ``hash_ids`` without them). A request with none of these
    goes to the least outstanding replica. The load cap: the affine replica is passed over for the least
    outstanding one when its outstanding requests exceed both ``load_cap_abs`` more and
    ``load_cap_rel`` times the least loaded replica's (SGLang's router's balance thresholds);
    the conversation or prefix then moves with it."""

    name: ClassVar[str] = "prefix_affinity"
    load_cap_abs: int = 32
    load_cap_rel: float = 1.5
    max_prefixes: int = 1_000_000  # conversations and block hashes remembered (LRU)
    _owner: OrderedDict[Any, int] = field(default_factory=OrderedDict, init=False)

    def __post_init__(self) -> None:
        check_int("router.load_cap_abs", self.load_cap_abs, 0)
        check_number("router.load_cap_rel", self.load_cap_rel, minimum=1.0)
        check_int("router.max_prefixes", self.max_prefixes, 1)

    def capped(self, target: int, replicas: Sequence[ReplicaLoad]) -> bool:
        """Whether replica ``target`` is past the load cap."""
        least = min(r.outstanding for r in replicas)
        mine = replicas[target].outstanding
        return mine > least + self.load_cap_abs and mine > least * self.load_cap_rel

    def route(self, req: Request, replicas: Sequence[ReplicaLoad], now: float) -> int:
        owner = self._owner
        if req.conversation_id is not None:
            keys: Sequence[Any] = (("conversation", req.conversation_id),)
        elif req.prefix_segments:
            sizes = {s.block_manager.block_size for r in replicas for s in r.schedulers}
            size = min(sizes)
            keys = block_hashes(req, size, keep=len(sizes) == 1)
        elif req.hash_ids:
            keys = req.hash_ids
        else:
            keys = ()
        if not keys:
            return _least(replicas, lambda r: r.outstanding)
        target = None
        for key in reversed(keys):  # the longest prefix some replica served
            target = owner.get(key)
            if target is not None:
                break
        if target is None or self.capped(target, replicas):
            target = _least(replicas, lambda r: r.outstanding)
        for key in keys:  # the prefix now lives (also) on target: its newest copy
            owner[key] = target
            owner.move_to_end(key)
        while len(owner) > self.max_prefixes:  # the least recently routed go first
            owner.popitem(last=False)
        return target
