"""Scheduler.abort: a request ended from outside (a client gone) leaves no block or queue entry
behind, wherever it was, overlap's in-flight window included."""

from __future__ import annotations

import dataclasses

from policies import Request, RequestState, SchedulerConfig, make_scheduler


def sched(name="multi_step", params=None, *, overlap=False, blocks=40, bs=4):
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, block_size=bs,
                          watermark=0.0)
    return make_scheduler(name, params or {}, dataclasses.replace(cfg, overlap=overlap), blocks,
                          256)


def every_request_accounted(s, reqs):
    held = [r for r in reqs if r.state is not RequestState.FINISHED]
    s.block_manager.check(held)
    assert all(not r.block_table for r in reqs if r.state is RequestState.FINISHED)


def test_abort_waiting_running_and_unknown():
    s = sched(params={"num_steps": 2})
    a, b, c = (Request(i, 0.0, 6, 8) for i in range(3))
    for r in (a, b):
        s.add_request(r)
    batch = s.schedule(0.0)  # both prefill
    s.update(batch, [1.0])
    s.add_request(c)
    assert s.abort(0) and s.abort(2)  # running with blocks, and still waiting
    assert a.state is RequestState.FINISHED and c.state is RequestState.FINISHED
    assert s.running == [b] and not s.waiting
    every_request_accounted(s, [a, b, c])
    assert not s.abort(0) and not s.abort(99)
    while s.has_unfinished:  # the rest runs as if the others never were
        batch = s.schedule(0.0)
        s.update(batch, [1.0] * batch.num_steps)
    assert b.num_output_tokens == 8 and s.block_manager.num_free_blocks == 40


def test_abort_in_flight_with_overlap_frees_once_and_update_skips_it():
    s = sched(params={"num_steps": 2}, overlap=True)
    a, b = Request(0, 0.0, 6, 8), Request(1, 0.0, 6, 8)
    for r in (a, b):
        s.add_request(r)
    w1 = s.schedule(0.0)  # prefill, in flight
    w2 = s.schedule(0.0)  # the decode window after it, formed while w1 is in flight
    s.update(w1, [1.0], [[5], [5]])
    assert a in s.running and a.num_output_placeholders == 2
    assert s.abort(0)  # a is in w2, still in flight
    assert a.state is RequestState.FINISHED and a.num_output_placeholders == 0
    every_request_accounted(s, [a, b])
    w3 = s.schedule(0.0)  # formed without a; may take a's freed blocks
    assert [x.request for x in w3.seqs] == [b]
    before = s.stats.num_wasted_steps
    s.update(w2, [2.0, 3.0], [[5, 5], [5, 5]])  # no second free, no tokens for a
    assert a.num_output_tokens == 1 and s.stats.num_wasted_steps == before + 2
    s.update(w3, [4.0, 5.0], [[5, 5]])
    every_request_accounted(s, [a, b])
    while s.has_unfinished:
        batch = s.schedule(0.0)
        if batch is None:
            break
        s.update(batch, [6.0] * batch.num_steps, [[5] * batch.num_steps] * len(batch.seqs))
    assert b.num_output_tokens == 8 and s.block_manager.num_free_blocks == 40


def test_abort_a_request_known_done_in_flight():
    s = sched("single_step", overlap=True)
    a = Request(0, 0.0, 6, 2)
    s.add_request(a)
    w1 = s.schedule(0.0)
    s.update(w1, [1.0], [[5]])
    w2 = s.schedule(0.0)  # samples a's last token: a moves to finishing
    assert s.finishing == [a]
    assert s.abort(0) and not s.finishing and not s.has_unfinished
    s.update(w2, [2.0], [[5]])
    assert a.num_output_tokens == 1 and s.block_manager.num_free_blocks == 40
