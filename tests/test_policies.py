"""Hand-worked scenarios for each policy: the expected batches were derived on paper."""

from __future__ import annotations

import pytest

from policies import Request, RequestState, SchedulerConfig, make_policy, make_scheduler


def sched(name, params=None, *, blocks=100, budget=None, seqs=256, bs=4, max_len=1024):
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, block_size=bs,
                          watermark=0.0)
    return make_scheduler(name, params or {}, cfg, blocks, max_len)


def shape(batch):
    """(request_id, num_query_tokens, num_cached_tokens, num_steps) per scheduled seq."""
    return [(s.request.request_id, s.num_query_tokens, s.num_cached_tokens, s.num_steps)
            for s in batch.seqs]


def run_window(s, batch, t0=0.0):
    return s.update(batch, [t0 + j + 1 for j in range(batch.num_steps)])


def test_single_step_prefill_batches_then_decode():
    s = sched("single_step", budget=40)
    reqs = [Request(i, 0.0, p, 3) for i, p in enumerate([10, 20, 30])]
    for r in reqs:
        s.add_request(r)
    b = s.schedule(0.0)
    # 10 + 20 fit the 40-token budget, 30 more would not: prefill-only batch, one step.
    assert shape(b) == [(0, 10, 0, 1), (1, 20, 0, 1)] and b.num_steps == 1
    run_window(s, b)
    b = s.schedule(1.0)
    assert shape(b) == [(2, 30, 0, 1)]  # prompts still wait: prefill before decode
    run_window(s, b, 1.0)
    b = s.schedule(2.0)
    assert shape(b) == [(0, 1, 10, 1), (1, 1, 20, 1), (2, 1, 30, 1)]
    assert [r.num_output_tokens for r in reqs] == [1, 1, 1]
    assert reqs[0].first_scheduled_time == 0.0 and reqs[2].first_scheduled_time == 1.0


def test_multi_step_window_lookahead_and_wasted_steps():
    s = sched("multi_step", {"num_steps": 4})
    r0, r1 = Request(0, 0.0, 5, 6), Request(1, 0.0, 5, 2)
    s.add_request(r0)
    s.add_request(r1)
    b = s.schedule(0.0)
    assert shape(b) == [(0, 5, 0, 1), (1, 5, 0, 1)] and b.num_steps == 1  # prefill: one step
    assert len(r0.block_table) == 2  # 5 slots, block size 4
    run_window(s, b)
    b = s.schedule(1.0)
    assert shape(b) == [(0, 1, 5, 4), (1, 1, 5, 4)] and b.num_steps == 4
    # lookahead: slots for positions 5..8 are reserved -> 9 slots -> 3 blocks
    assert len(r0.block_table) == 3
    finished = s.update(b, [10.0, 11.0, 12.0, 13.0])
    # r1 owed one token: it finishes at step 1 and its 3 other steps are wasted
    assert finished == [r1] and r1.finish_time == 10.0 and r1.token_times == [1.0, 10.0]
    assert b.num_wasted_steps == 3 and r0.num_output_tokens == 5
    assert r1.block_table == [] and r1.state is RequestState.FINISHED
    b = s.schedule(14.0)
    assert shape(b) == [(0, 1, 9, 4)]
    s.update(b, [15.0, 16.0, 17.0, 18.0])
    assert r0.is_finished and r0.num_output_tokens == 6 and s.stats.num_wasted_steps == 6
    assert s.block_manager.num_free_blocks == 100


def test_chunked_prefill_decodes_first_then_chunks():
    s = sched("chunked_prefill", budget=8)
    r0 = Request(0, 0.0, 3, 10)
    s.add_request(r0)
    run_window(s, s.schedule(0.0))  # r0 prefilled whole (3 <= 8)
    r1 = Request(1, 0.0, 20, 2)
    s.add_request(r1)
    b = s.schedule(1.0)
    assert shape(b) == [(0, 1, 3, 1), (1, 7, 0, 1)]
    assert not b.seqs[1].samples
    run_window(s, b)
    assert r1.num_computed_tokens == 7 and r1.num_output_tokens == 0
    assert shape(s.schedule(2.0)) == [(0, 1, 4, 1), (1, 7, 7, 1)]


def test_chunked_prefill_last_chunk_samples():
    s = sched("chunked_prefill", budget=8)
    r1 = Request(1, 0.0, 12, 2)
    s.add_request(r1)
    b = s.schedule(0.0)
    assert shape(b) == [(1, 8, 0, 1)] and not b.seqs[0].samples
    run_window(s, b)
    b = s.schedule(1.0)
    assert shape(b) == [(1, 4, 8, 1)] and b.seqs[0].samples
    run_window(s, b, 1.0)
    assert r1.num_output_tokens == 1 and r1.token_times == [2.0]


def test_cp1_single_step_with_prefill_else_k():
    s = sched("cp1", {"num_steps": 4}, budget=16)
    r0 = Request(0, 0.0, 4, 10)
    s.add_request(r0)
    b = s.schedule(0.0)
    assert shape(b) == [(0, 4, 0, 1)] and b.num_steps == 1
    run_window(s, b)
    b = s.schedule(1.0)
    assert shape(b) == [(0, 1, 4, 4)] and b.num_steps == 4
    run_window(s, b, 1.0)
    s.add_request(Request(1, 0.0, 6, 3))
    b = s.schedule(6.0)
    assert shape(b) == [(0, 1, 8, 1), (1, 6, 0, 1)] and b.num_steps == 1


def test_cp2_prefill_takes_part_in_first_step_only():
    s = sched("cp2", {"num_steps": 4}, budget=16)
    r0 = Request(0, 0.0, 4, 10)
    s.add_request(r0)
    b = s.schedule(0.0)
    # only a prefill: it takes part in step 1 alone, so no empty steps 2..4 are run
    assert b.num_steps == 1 and shape(b) == [(0, 4, 0, 1)]
    run_window(s, b)
    assert r0.num_output_tokens == 1 and r0.token_times == [1.0]
    s.add_request(Request(1, 0.0, 6, 3))
    b = s.schedule(5.0)
    assert b.num_steps == 4 and shape(b) == [(0, 1, 4, 4), (1, 6, 0, 1)]
    assert [len(b.seqs_in_step(j)) for j in range(4)] == [2, 1, 1, 1]


def test_cp_promote_whole_prompt_then_decodes_and_no_chunking():
    s = sched("cp_promote", {"num_steps": 4}, budget=12)
    r0 = Request(0, 0.0, 3, 8)
    s.add_request(r0)
    b = s.schedule(0.0)
    assert shape(b) == [(0, 3, 0, 4)] and b.num_steps == 4
    # prompt slots + 3 lookahead decode slots = 6 -> 2 blocks of 4
    assert len(r0.block_table) == 2
    run_window(s, b)
    assert r0.num_output_tokens == 4 and r0.num_computed_tokens == 6
    s.add_request(Request(1, 0.0, 11, 1))  # 1 decode + 11 = 12 fits the budget
    s.add_request(Request(2, 0.0, 2, 5))  # the budget is gone: waits, is not chunked
    b = s.schedule(5.0)
    assert shape(b) == [(0, 1, 6, 4), (1, 11, 0, 4)]
    assert s.num_waiting == 1


def test_adaptive_rule():
    pol = make_policy("adaptive", num_steps=8, overhead_steps=1.0, min_steps=2)

    class View:
        def __init__(self, rems, waiting=()):
            self.running = [Request(i, 0.0, 4, 100) for i in range(len(rems))]
            for r, rem in zip(self.running, rems, strict=False):
                r.num_output_tokens = 100 - rem
            self.waiting = list(waiting)
            self.rate, self.step_time, self.overlap = 0.0, None, False

        def arrival_rate(self):
            return self.rate

    # one nearly-done request does not force k = 1: (1 + 2k) / (1 + k) grows with k
    assert pol.window_steps(View([1, 100, 100]), False) == 8
    # everybody owes 2 tokens: goodput(1) = n/2, goodput(2) = 2n/3, goodput(3) = 2n/4
    assert pol.window_steps(View([2, 2, 2]), False) == 2
    # requests wait: shrink to the earliest finish, not below backlog_min_steps
    pol = make_policy("adaptive", num_steps=8, overhead_steps=1.0, min_steps=2,
                      backlog_min_steps=3)
    assert pol.window_steps(View([5, 100], waiting=[1]), False) == 5
    assert pol.window_steps(View([1, 100, 100], waiting=[1]), False) == 3
    assert pol.window_steps(View([100]), True) == 1
    # online: 20 req/s and 10 ms steps -> 0.2 arrivals per step; 0.5 per window -> k = 2
    v = View([100, 100])
    v.rate, v.step_time = 20.0, 0.010
    assert make_policy("adaptive", num_steps=8, arrivals_per_window=0.5).window_steps(v, False) == 2
    v.rate = 2.0  # 0.02 per step -> 25 steps allowed -> k_max
    assert make_policy("adaptive", num_steps=8, arrivals_per_window=0.5).window_steps(v, False) == 8


def test_scheduler_observes_arrival_rate_and_step_time():
    s = sched("multi_step", {"num_steps": 4})
    for i in range(3):
        s.add_request(Request(i, 0.5 + 0.1 * i, 4, 20))
    b = s.schedule(1.0)  # prefill window, k = 1
    s.update(b, [1.0])
    # three arrivals 0.1 s apart within the last second: 2 gaps over the 0.5 s since the first
    assert s.arrival_rate() == pytest.approx(4.0)
    b = s.schedule(1.02)  # 20 ms after a 1-step window
    assert s.step_time is None  # the gap after a prefill window is not a decode step
    s.update(b, [1.03, 1.04, 1.05, 1.06])
    s.schedule(1.10)  # 80 ms after a 4-step decode window
    assert s.step_time == pytest.approx(0.02)
    assert s.arrival_rate() == pytest.approx(2 / 0.6)
    s.now = 5.0
    assert s.arrival_rate() == 0.0
    offline = sched("multi_step")
    for i in range(5):
        offline.add_request(Request(i, 0.0, 4, 4))
    offline.schedule(0.5)
    assert offline.arrival_rate() == 0.0  # one batch at t=0 is no arrival stream


def test_preemption_recomputes_latest_admitted():
    # 4 blocks of 4 slots; two requests of 7-token prompts take 2 blocks each.
    s = sched("single_step", blocks=4)
    r0, r1 = Request(0, 0.0, 7, 4), Request(1, 0.0, 7, 4)
    s.add_request(r0)
    s.add_request(r1)
    run_window(s, s.schedule(0.0))  # both prefilled: 7 slots each, 0 free blocks
    b = s.schedule(1.0)  # both decode at position 7: fits in block 2 of each
    assert shape(b) == [(0, 1, 7, 1), (1, 1, 7, 1)]
    run_window(s, b, 1.0)
    # next decode writes position 8: each needs a third block, none free -> r1 (latest) preempted
    b = s.schedule(2.0)
    assert shape(b) == [(0, 1, 8, 1)] and b.preempted == [r1]
    assert r1.state is RequestState.PREEMPTED and r1.num_computed_tokens == 0
    assert r1.block_table == [] and list(s.waiting) == [r1] and s.stats.num_preemptions == 1
    while s.has_unfinished:
        b = s.schedule(3.0)
        if r1 in [x.request for x in b.seqs] and b.seqs[0].is_prefill:
            # recompute: prompt plus the 2 tokens it already had
            assert shape(b) == [(1, 9, 0, 1)]
        run_window(s, b, 3.0)
    assert r0.num_output_tokens == r1.num_output_tokens == 4
    assert s.block_manager.num_free_blocks == 4


@pytest.mark.parametrize("name,params,msg", [
    ("nope", {}, "unknown policy 'nope'"),
    ("multi_step", {"num_steps": 0}, "policy.num_steps must be an integer >= 1"),
    ("cp2", {"num_steps": -3}, "policy.num_steps"),
    ("adaptive", {"min_steps": 0}, "policy.min_steps"),
    ("single_step", {"num_steps": 4}, "policy single_step has no setting 'num_steps'"),
])
def test_bad_policy_settings(name, params, msg):
    with pytest.raises(ValueError, match=msg):
        make_policy(name, **params)


def test_bad_scheduler_settings_and_requests():
    with pytest.raises(ValueError, match="scheduler.max_num_batched_tokens must be an integer >= 1"):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="scheduler.max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    s = sched("single_step", budget=64, blocks=100)
    with pytest.raises(ValueError, match="scheduler.max_num_batched_tokens 64"):
        s.add_request(Request(0, 0.0, 60, 10))
    s = sched("single_step", blocks=3)
    with pytest.raises(ValueError, match="needs 4 KV blocks"):
        s.add_request(Request(0, 0.0, 10, 4))
    s = sched("chunked_prefill", max_len=32)
    with pytest.raises(ValueError, match="model.max_model_len 32"):
        s.add_request(Request(0, 0.0, 30, 4))
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        Request(0, 0.0, 3, 0)


def test_default_token_budget_follows_vllm():
    assert sched("single_step", max_len=8192).max_num_batched_tokens == 8192
    assert sched("multi_step", max_len=1024).max_num_batched_tokens == 2048
    assert sched("chunked_prefill", max_len=8192).max_num_batched_tokens == 2048


def test_eos_stops_early_when_set():
    s = sched("multi_step", {"num_steps": 4})
    r = Request(0, 0.0, 4, 10, prompt_token_ids=[1, 2, 3, 4], eos_token_id=7)
    s.add_request(r)
    b = s.schedule(0.0)
    s.update(b, [1.0], [[5]])
    b = s.schedule(1.0)
    s.update(b, [2.0, 3.0, 4.0, 5.0], [[6, 7, 8, 9]])
    assert r.is_finished and r.output_token_ids == [5, 6, 7] and b.num_wasted_steps == 2


def test_mixed_policy_does_not_readmit_a_victim_in_the_same_window():
    s = sched("cp1", {"num_steps": 4}, blocks=4, budget=16)
    r0, r1 = Request(0, 0.0, 5, 7), Request(1, 0.0, 3, 3)
    s.add_request(r0)
    s.add_request(r1)
    run_window(s, s.schedule(0.0))  # both prefilled: r0 2 blocks, r1 1 block
    b = s.schedule(1.0)  # decodes need 5+4 and 3+4 slots: 3 + 2 blocks > 4, r1 preempted
    assert b.preempted == [r1] and shape(b) == [(0, 1, 5, 4)]
    assert list(s.waiting) == [r1]


def test_shuffled_free_list_scatters_block_tables_reproducibly():
    from policies.block_manager import BlockManager

    def tables(seed):
        bm = BlockManager(64, 4, 0.0)
        bm.shuffle_free(seed)
        reqs = [Request(i, 0.0, 8, 4) for i in range(4)]
        for r in reqs:
            assert bm.ensure_slots(r, 12)
        return [r.block_table for r in reqs]

    a = tables(3)
    assert a == tables(3) and a != tables(4)
    assert sorted(b for t in a for b in t) != list(range(12))  # not handed out in order
    assert len({b for t in a for b in t}) == 12
