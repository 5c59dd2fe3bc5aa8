"""Prefill/decode disaggregation in a simulated cluster: a request prefilled on a prefill-role
replica (its first token sampled there) is handed, with its KV, to a decode-role replica that
the decode router picks as the prefill ends; the KV crosses the prefill replica's outgoing link
(simulator/link.py: a FIFO shared by its transfers), the prefill replica holds its blocks until
the transfer is done, and the decode replica's scheduler admits it with that KV present
(``Scheduler.add_prefilled``). Its first tokens reach the client from the prefill replica (their
delivery there), the rest from the decode replica.

A colocated cluster (every replica ``mixed``) has none of this: the engine looks for it per
window, never per request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from policies.early_rejection import EarlyRejection
from policies.request import Request
from policies.routers import ReplicaLoad, Router
from policies.scheduler import Scheduler
from simulator.cluster import ROLES
from simulator.events import call_at
from simulator.link import LinkSpec, kv_transfer_bytes, transfer_span
from simulator.memory import kv_bytes_per_token_per_gpu


def check_roles(roles: Sequence[str], link: LinkSpec | None) -> bool:
    """Whether a cluster of replicas with these roles is disaggregated, its roles checked: a
    prefill pool needs a decode pool and the other way round, and a link between them."""
    for i, role in enumerate(roles):
        if role not in ROLES:
            raise ValueError(f"replica {i}: role must be one of {', '.join(ROLES)}, got {role!r}")
    if all(role == "mixed" for role in roles):
        return False
    if "prefill" not in roles:
        raise ValueError("cluster.groups: a decode group needs a prefill group (role: prefill) "
                         "to hand it requests")
    if "decode" not in roles:
        raise ValueError("cluster.groups: a prefill group needs a decode group (role: decode) "
                         "to hand its requests to")
    if link is None:
        raise ValueError("cluster.link: a disaggregated cluster needs a link for its KV "
                         "transfers (conf/link: nvlink, pcie, rdma, same_gpu)")
    return True


class HandoffLog:
    """Per request (by its position in the run's list): the prefill replica that prefilled it
    (-1: none, served whole on one replica), its KV transfer's time on the link and its wait
    for the link (NaN: none), and whether it was rejected at arrival (early rejection). The
    run's requests.csv carries them (experiments/result_files.py)."""

    COLUMNS = ("prefill_replica", "transfer_s", "transfer_queue_s", "rejected")

    def __init__(self, requests: Sequence[Request]) -> None:
        n = len(requests)
        self.position = {id(r): i for i, r in enumerate(requests)}
        self.prefill_replica = np.full(n, -1, np.int64)
        self.transfer_s = np.full(n, np.nan)
        self.transfer_queue_s = np.full(n, np.nan)
        self.rejected = np.zeros(n, bool)

    def columns(self) -> list[tuple[str, np.ndarray]]:
        return [(name, getattr(self, name)) for name in self.COLUMNS]


@dataclass(eq=False)
class Disaggregation:
    """A disaggregated cluster's hand-off state: the replicas by role, the decode router and
    the decode pool's loads (indexed in the pool), each prefill replica's link (busy until),
    and each handed-off request's first tokens (their prefill replica and GPU times)."""

    link: LinkSpec
    decode_router: Router
    prefill: list  # ReplicaSim of the prefill role
    decode: list  # ReplicaSim of the decode role
    replica_of: dict[int, int]
    log: HandoffLog | None = None
    link_free: dict[int, float] = field(default_factory=dict)
    first: dict[int, tuple] = field(default_factory=dict)  # id(req) -> (prefill sim, times)
    rejection: EarlyRejection | None = None
    num_rejected: int = 0

    def __post_init__(self) -> None:
        self.decode_loads: list[ReplicaLoad] = [sim.load for sim in self.decode]

    def prefilling(self) -> bool:
        """Whether a request may still be handed off: some prefill replica holds one."""
        return any(sim.load.outstanding for sim in self.prefill)

    def hand_off(self, sim, sched: Scheduler, win) -> None:
        """After a prefill replica's window: each request that sampled its first token leaves
        for the decode replica the decode router picks now, its KV sent once the link is free
        (the replica's blocks held meanwhile); the decode pool's idle engines learn when the
        last prefill is done."""
        from simulator.front_end import wake_idle

        taken = sched.take_prefilled()
        env = sim.env
        now = env.now
        if taken:
            load = sim.load
            per_token = kv_bytes_per_token_per_gpu(sim.model, sim.hw)
            block_size = sched.block_manager.block_size
            num_layers = sim.model.num_layers
            # one step: its layers computed from its start (layer-wise pipelining)
            prefill_start = win.gpu_done[0] - win.stage_times[0] \
                if len(win.gpu_done) == 1 and not sim.stages else now
            loads = self.decode_loads
            free = self.link_free.get(sim.index, 0.0)
            for req in taken:
                d = self.decode_router.route(req, loads, now)
                dsim = self.decode[d]
                tokens = req.prompt_len + req.num_output_tokens - 1
                # a decode replica of another split takes its own shard over each GPU's link:
                # the larger of the shards sent and received sets the link's bytes
                shard = per_token if dsim.hw == sim.hw else \
                    max(per_token, kv_bytes_per_token_per_gpu(sim.model, dsim.hw))
                nbytes = kv_transfer_bytes(tokens, block_size, shard)
                start, end = transfer_span(self.link, nbytes, num_layers, now, prefill_start,
                                           free)
                free = end
                owed = req.prompt_len + req.max_tokens
                load.outstanding -= 1
                load.outstanding_tokens -= owed
                dload = dsim.load
                dload.outstanding += 1
                dload.outstanding_tokens += owed
                v = dsim.num_sent % len(dsim.schedulers)
                dsim.num_sent += 1
                dsim.arrivals_left[v] += 1
                self.replica_of[id(req)] = dsim.index
                # its tokens so far are delivered by this replica (times mapped at its finish)
                self.first[id(req)] = (sim, req.token_times)
                req.token_times = []
                if self.log is not None:
                    i = self.log.position[id(req)]
                    self.log.prefill_replica[i] = sim.index
                    self.log.transfer_s[i] = end - start
                    earliest = transfer_span(self.link, nbytes, num_layers, now,
                                             prefill_start, 0.0)[0]
                    self.log.transfer_queue_s[i] = start - earliest
                call_at(env, max(end, now), lambda req=req, dsim=dsim, v=v:
                        self._arrive(sched, req, dsim, v))
            self.link_free[sim.index] = free
        if self.log is not None:
            for req in win.finished or ():  # served whole here (no token left to decode)
                self.log.prefill_replica[self.log.position[id(req)]] = sim.index
        if not sim.shared.client.num_unsent and not self.prefilling():
            wake_idle(self.decode)

    def reject(self, req: Request, sim, now: float) -> bool:
        """Early rejection (``rejection``) of ``req``, routed to prefill replica ``sim``: a
        rejected request is sent nowhere, is never served, and frees its client slot now."""
        if self.rejection is None or not self.rejection.rejects(req, sim.load,
                                                                 self.decode_loads):
            return False
        if self.log is not None:
            self.log.rejected[self.log.position[id(req)]] = True
        self.num_rejected += 1
        sim.shared.client.finished([req], [now])  # (a later turn it held back: now due)
        return True

    def _arrive(self, sched: Scheduler, req: Request, dsim, v: int) -> None:
        """The KV is on the decode replica: the prefill replica's blocks go back, and the decode
        replica's virtual engine ``v`` takes the request."""
        from simulator.front_end import wake_engine

        sched.release(req)
        dsim.schedulers[v].add_prefilled(req, dsim.env.now)
        dsim.arrivals_left[v] -= 1
        wake_engine(dsim, v)

    def first_tokens(self, finished: list[Request]) -> None:
        """Decode-side finishes: each request's tokens from its prefill replica go first, at
        their delivery times there."""
        first = self.first
        for r in finished:
            psim, times = first.pop(id(r))
            delivery = psim.delivery
            try:
                r.token_times[:0] = [delivery[t] for t in times]
            except KeyError:
                raise RuntimeError(f"request {r.request_id} finished on replica "
                                   f"{self.replica_of[id(r)]} before its first token was "
                                   f"delivered by prefill replica {psim.index} (its engine "
                                   "thread held past it?)") from None
