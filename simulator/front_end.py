"""A replica's front end in the simulation: the client sends requests (at their arrival times,
or as slots free), the router picks a replica, the front end's per-request work hands each to
a scheduler; the window's tokens are streamed (delivered) through the API server, and a
request's finish reaches the client and the run's finish hook once its last token is
delivered (simulator/engine.py's module doc: the timeline)."""

from __future__ import annotations

import operator
from collections.abc import Callable, Generator
from typing import Any

import numpy as np

from policies.request import Request
from policies.routers import Router
from simulator.events import At, call_at
from simulator.overhead import api_time, request_time
from simulator.replica_state import ReplicaSim, Shared, Window

_FINISH_TIME = operator.attrgetter("finish_time")


def arrivals(shared: Shared, sims: list[ReplicaSim], router: Router,
             replica_of: dict[int, int], pool: list[ReplicaSim] | None = None,
             reject: Callable[[Request, ReplicaSim, float], bool] | None = None) -> Generator:
    """Send requests as the client does (at their arrival times; with max_concurrency, when a
    slot frees), each to the replica the router picks of ``pool`` (the replicas a request
    starts on: all but a disaggregated cluster's decode replicas), round-robin over its
    virtual engines. ``reject``: early rejection (a rejected request goes nowhere)."""
    env, client = shared.env, shared.client
    if pool is None:
        pool = sims
    loads = [sim.load for sim in pool]
    single = len(sims) == 1
    fronts = [request_time(sim.overhead) for sim in pool]
    now = env.now
    # one engine that takes requests as they come (no front-end time, one virtual engine):
    # each burst reaches its scheduler at once, as _enter would take it one by one
    direct = sims[0].schedulers[0] if single and fronts[0] <= 0.0 \
        and len(sims[0].schedulers) == 1 else None
    while client.num_unsent:
        sent = client.send_due(now)
        if direct is not None and sent:
            for req in sent:
                direct.add_request(req)
            sims[0].num_sent += len(sent)
            wake_engine(sims[0], 0)
            sent = []
        for req in sent:
            r = 0 if single else router.route(req, loads, now)
            sim = pool[r]
            if reject is not None and reject(req, sim, now):
                continue
            if not single:  # (one replica needs no map: every request is its)
                replica_of[id(req)] = sim.index
                load = sim.load
                load.outstanding += 1
                load.outstanding_tokens += req.prompt_len + req.max_tokens
                load.queued_prompt_tokens += req.prompt_len
            v = sim.num_sent % len(sim.schedulers)
            sim.num_sent += 1
            sim.arrivals_left[v] += 1
            front = fronts[r]
            if front <= 0.0:
                _enter(sim, req, v)
                continue
            # the front end takes requests in turn, on the engine thread or its own process
            if sim.overhead.api_server_on_critical_path:
                sim.cpu_free = entry = max(sim.cpu_free, now) + front
                sim.cpu_busy += front
            else:
                sim.api_free = entry = max(sim.api_free, now) + front
            call_at(env, entry, lambda sim=sim, req=req, v=v: _enter(sim, req, v))
        t = client.next_send_time()
        if t is None:  # every slot is held: wait for a finish
            if not client.num_unsent:
                break
            shared.client_wake = env.event()
            yield shared.client_wake
            now = env.now
        elif client.has_followups and t > now:  # a later turn may fall due before t
            wake = shared.client_wake = env.event()
            call_at(env, t, lambda wake=wake: _wake_client(shared) if shared.client_wake is wake
                    else None)
            yield wake
            now = env.now
        elif t > now:  # (now is env.now: nothing was waited for since it was taken)
            yield At(env, t)
            now = t
    wake_idle(sims)  # nothing more comes: an idle engine learns it is done


def wake_idle(sims: list[ReplicaSim]) -> None:
    """Each idle virtual engine with no request on its way resumes now (to find it is done,
    or, a decode replica of a disaggregated cluster, to wait for the prefills left)."""
    for sim in sims:
        for v, wake in enumerate(sim.wake):
            if wake is not None and not sim.arrivals_left[v]:
                sim.wake[v] = None
                wake.succeed()


def _enter(sim: ReplicaSim, req: Request, v: int) -> None:
    """``req`` reaches virtual engine ``v``'s scheduler, which wakes if it was idle."""
    sim.schedulers[v].add_request(req)
    sim.arrivals_left[v] -= 1
    wake_engine(sim, v)


def wake_engine(sim: ReplicaSim, v: int) -> None:
    """Virtual engine ``v`` resumes now if it was idle (waiting for work)."""
    wake = sim.wake[v]
    if wake is not None:
        sim.wake[v] = None
        wake.succeed()


def client_finished(sim: ReplicaSim, win: Window) -> None:
    """The window's finished requests' last tokens are delivered (update() has run and the
    delivery times are known, in either order): their token times become delivery times, and
    the client learns of the finishes."""
    finished = win.finished
    assert finished is not None
    shared = sim.shared
    get = sim.delivery.__getitem__
    for r in finished:  # (a decode group member's: its tokens from before it joined)
        times = r.token_times
        if len(times) == 1:
            times[0] = get(times[0])
        else:
            times[:] = map(get, times)
        r.finish_time = get(r.finish_time)
    if sim.takes_kv is not None and finished:  # (disaggregated) tokens from its prefill first
        sim.takes_kv.first_tokens(finished)
    group = win.batch.decodes
    # a member's decode tokens: its run of the group's delivery times
    runs = None if group is None else (sim.group_delivery[win.engine], group.runs)
    if shared.on_finish is not None and finished:
        shared.on_finish(finished, sim.index, runs)
    if runs is not None:
        log, spans = runs
        for r, (start, end) in zip(finished, spans, strict=True):
            if isinstance(r.token_times, list):  # the hook has not let go of it
                # a new list: the hook may keep the one it was given
                r.token_times = r.token_times + log[start:end].tolist()
    client = shared.client
    env = sim.env
    if client.max_concurrency is None:  # no slot waits on a finish; a later turn may
        for due in client.finished(finished, map(_FINISH_TIME, finished)):
            call_at(env, max(due, env.now), lambda: _wake_client(shared))
        return
    at: dict[float, list[Request]] = {}
    for r in finished:
        at.setdefault(r.finish_time, []).append(r)
    for t, reqs in at.items():
        call_at(env, max(t, env.now), lambda reqs=reqs: _slots_freed(shared, reqs))


def _slots_freed(shared: Shared, reqs: list[Request]) -> None:
    env = shared.env
    for due in shared.client.finished(reqs, [env.now] * len(reqs)):
        if due > env.now:
            call_at(env, due, lambda: _wake_client(shared))
    _wake_client(shared)


def _wake_client(shared: Shared) -> None:
    """The client may have a request to send now (a slot freed, a later turn due)."""
    wake, shared.client_wake = shared.client_wake, None
    if wake is not None:
        wake.succeed()


def deliver(sim: ReplicaSim, win: Window) -> None:
    """Stream the window's tokens (through the API-server process if separate); note their times."""
    spec, k = sim.overhead, win.batch.num_steps
    times = list(win.out_done) if sim.stream_per_step else [win.out_done[-1]] * k
    if not spec.api_server_on_critical_path and (spec.api_per_token_us > 0
                                                 or spec.api_per_chunk_us > 0):
        if sim.stream_per_step:
            for j in range(k):
                sim.api_free = (max(sim.api_free, times[j])
                                + api_time(spec, win.delivered[j], win.chunks[j]))
                times[j] = sim.api_free
        else:
            sim.api_free = (max(sim.api_free, times[-1])
                            + api_time(spec, sum(win.delivered), sum(win.chunks)))
            times = [sim.api_free] * k
    delivery = sim.delivery
    burst = not sim.stream_per_step  # the window's tokens reach the client at one time
    if len(win.gpu_done) != k:
        raise RuntimeError(f"window {win.batch.window_id}: {len(win.gpu_done)} steps done of {k}")
    if burst:
        at = times[0]
        for g in win.gpu_done:
            delivery[g] = at
    else:
        for g, t in zip(win.gpu_done, times, strict=True):
            delivery[g] = t
    if win.batch.decodes is not None:
        start = win.batch.decodes.start
        log = sim.group_delivery[win.engine]
        if start + k > len(log):
            log = sim.group_delivery[win.engine] = np.resize(log, 2 * (start + k))
        log[start:start + k] = at if burst else times
    if burst:
        last = at if any(win.delivered) else 0.0
    else:
        last = max((t for t, n in zip(times, win.delivered, strict=True) if n), default=0.0)
    if last > sim.last_delivery:
        sim.last_delivery = last
    win.delivery_known = True
    if win.finished is not None:
        client_finished(sim, win)


def apply_delivery_times(requests: Any, delivery: dict[float, float]) -> None:
    """Replace the GPU completion times ``update()`` recorded by the tokens' delivery times
    (requests that never finished: their last window's delivery never closed them)."""
    get = delivery.get
    for req in requests:
        if req.token_times:
            req.token_times[:] = (get(t, t) for t in req.token_times)
