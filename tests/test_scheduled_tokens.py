"""The contract of a scheduled sequence: the tokens it computes and may emit at each step of a
window (policies/batch.py ScheduledSeq), and the slots, tokens and times the scheduler and the
step shapes count from them. A decode computes one token a step and may emit one today; a
sequence that computes several a step (a verified draft) is counted from the same numbers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import pytest

from common.spec_acceptance import acceptance_process
from policies import Policy, Request, SchedulerConfig, make_scheduler
from policies.batch import Batch, ScheduledSeq
from policies.scheduler import Scheduler
from policies.speculation import Speculation, SpeculationPolicy
from policies.user_code import HookError
from simulator.step_shape import window_shapes


def sched(name, params=None, *, budget=None, bs=4):
    cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget, block_size=bs,
                          watermark=0.0)
    return make_scheduler(name, params or {}, cfg, 100, 1024)


def decoding(s, prompt=6, max_tokens=20):
    """A request of ``s`` past its prefill, decoding (no decode group: per-sequence windows)."""
    req = Request(0, 0.0, prompt, max_tokens)
    s.add_request(req)
    b = s.schedule(0.0)
    s.update(b, [1.0])
    return req


def test_a_scheduled_decode_computes_one_token_a_step_and_may_emit_one():
    s = sched("multi_step", {"num_steps": 4})
    req = decoding(s)
    b = s.schedule(1.0)
    (seq,) = b.seqs
    assert (seq.num_query_tokens, seq.num_decode_tokens, seq.num_sampled_tokens) == (1, 1, 1)
    assert seq.num_slots == 4 and seq.num_emitted_tokens == 4
    # block slots cover every token the window computes
    assert len(req.block_table) * 4 >= seq.num_cached_tokens + seq.num_slots
    s.update(b, [2.0, 3.0, 4.0, 5.0])
    assert req.num_computed_tokens == 6 + 4 and req.num_output_tokens == 5


def test_a_chunk_that_leaves_the_prompt_uncomputed_emits_nothing():
    s = sched("chunked_prefill", budget=8)
    req = Request(0, 0.0, 20, 4)
    s.add_request(req)
    b = s.schedule(0.0)
    (seq,) = b.seqs
    assert seq.num_query_tokens == 8 and seq.num_sampled_tokens == 0
    assert seq.num_emitted_tokens == 0 and not seq.samples
    s.update(b, [1.0])
    assert req.num_computed_tokens == 8 and req.num_output_tokens == 0 and not req.token_times


def test_a_final_chunk_emits_one_token_though_update_grows_the_sequence():
    """What a window emits is fixed when it is formed: update() lengthens the request, and the
    chunk that completed it still counts as having sampled."""
    s = sched("single_step")
    req = Request(0, 0.0, 5, 3)
    s.add_request(req)
    b = s.schedule(0.0)
    (seq,) = b.seqs
    assert seq.num_sampled_tokens == 1
    s.update(b, [1.0])
    assert req.num_output_tokens == 1 and seq.samples and seq.num_emitted_tokens == 1


def test_a_decode_step_of_three_tokens_takes_three_slots_and_gives_three_tokens():
    """A window whose decode computes 3 tokens a step (the newest one and a draft of 2, all
    accepted): 3 KV slots a step, 3 tokens a step, each at its step's time; the request's
    computed tokens catch up by all 6."""
    s = sched("single_step")
    req = decoding(s)  # 6 prompt tokens computed, 1 sampled
    seq = ScheduledSeq(req, 3, req.num_computed_tokens, 2, False, num_decode_tokens=3)
    assert (seq.num_sampled_tokens, seq.num_slots, seq.num_emitted_tokens) == (3, 6, 6)
    assert s.block_manager.ensure_slots(req, seq.num_cached_tokens + seq.num_slots)
    assert len(req.block_table) == 3  # 12 slots for positions 0..11, block size 4
    shapes = window_shapes(Batch([seq], 2))
    assert [(x.num_tokens, x.num_sampled, x.kv_tokens) for x in shapes] == [(3, 3, 9), (3, 3, 12)]
    finished = s.update(Batch([seq], 2), [2.0, 3.0])
    assert not finished
    assert req.num_computed_tokens == 12 and req.num_output_tokens == 7
    assert req.token_times == [1.0, 2.0, 2.0, 2.0, 3.0, 3.0, 3.0]
    assert not req.in_prefill  # all but the newest token computed


def test_a_wide_decode_ends_at_the_step_of_its_last_owed_token():
    """max_tokens caps a several-token step: a request owing 2 of a window's 6 tokens finishes
    at step 1 and the window's step 2 is wasted for it."""
    s = sched("single_step")
    req = decoding(s, max_tokens=3)
    seq = ScheduledSeq(req, 3, req.num_computed_tokens, 2, False, num_decode_tokens=3)
    s.block_manager.ensure_slots(req, seq.num_cached_tokens + seq.num_slots)
    b = Batch([seq], 2)
    assert s.update(b, [2.0, 3.0]) == [req]
    assert req.num_output_tokens == 3 and req.token_times == [1.0, 2.0, 2.0]
    assert req.finish_time == 2.0 and b.num_wasted_steps == 1
    assert seq.steps_for(2) == 1 and seq.steps_for(4) == 2


def test_a_wide_decode_delivers_its_tokens_a_step_in_one_chunk():
    """The simulator's deliveries count tokens and its SSE chunks sequences: a 3-token decode
    owing 4 tokens over a 2-step window delivers 3 then 1 (2 and 0 beyond one a step), and
    step 1 samples 3 rows (2 beyond the one a sequence)."""
    s = sched("single_step")
    req = decoding(s, max_tokens=5)  # owes 4
    seq = ScheduledSeq(req, 3, req.num_computed_tokens, 2, False, num_decode_tokens=3)
    assert seq.step_tokens(4) == [3, 1] and seq.step_tokens(2) == [2]
    assert seq.step_tokens(9) == [3, 3, 3]
    ending, surplus = [0, 0, 0], []
    window_shapes(Batch([seq], 2), ending, surplus)
    assert ending == [0, 0, 1] and surplus == [2, 0, 2]
    one = ScheduledSeq(req, 1, req.num_computed_tokens, 2, False)  # one token a step: none
    surplus = []
    window_shapes(Batch([one], 2), [0, 0, 0], surplus)
    assert surplus == []


def test_a_policys_step_time_prices_a_wide_decode_as_its_window_shape():
    """step_budget's estimate of the window being formed (Sarathi's budget, slo_adaptive) counts
    a decode's tokens, so it prices the step the cost model prices when it runs."""
    from common.model_spec import ModelSpec
    from policies.step_budget import step_seconds
    from simulator.cost_model import step_time, step_time_fn
    from simulator.hardware import HardwareSpec
    from tests.test_policy_semantics import _conf

    model = ModelSpec.from_dict(_conf("model", "llama3_8b"))
    hw = HardwareSpec.from_dict(_conf("hardware", "h200_calibrated"))
    s = sched("single_step")
    s.step_time_fn = step_time_fn(model, hw)
    req = decoding(s)
    for w in (1, 4):
        s.forming = [ScheduledSeq(req, w, req.num_computed_tokens, 1, False, num_decode_tokens=w)]
        want = step_time(window_shapes(Batch(s.forming, 1))[0], model, hw)
        assert step_seconds(s) == want


@dataclass(frozen=True)
class TwoDrafts(SpeculationPolicy):
    """A user's speculation policy (defined outside schedlab, so its answers are checked) whose
    decodes draft 2 tokens a step, computing 3."""

    tokens: Any = 2

    def request_tokens(self, req, k, sched):
        return self.tokens


def all_accepted(policy=None):
    """Speculation drafting 2 tokens a step, every draft accepted: 3 tokens a step."""
    policy = policy or TwoDrafts(num_tokens=2)
    return Speculation("ngram", policy.num_tokens, None, policy, acceptance_process({"rate": 1.0}, 0))


def simulated(policy, n=4, prompt=64, max_tokens=31, speculation=None):
    """``n`` requests at t=0 simulated under ``policy`` (Llama-3-8B, the H200 profile) and
    ``speculation``: the requests, and each window's decodes as (cached tokens, slots, blocks
    held) per request."""
    from simulator.engine import simulate
    from tests.test_policy_semantics import HW, MODEL, OVERHEAD

    reqs = [Request(i, 0.0, prompt, max_tokens) for i in range(n)]
    windows = []

    def new(blocks):
        s = Scheduler(policy, SchedulerConfig(max_num_seqs=16), blocks, MODEL.max_model_len,
                      speculation=speculation)
        schedule = s.schedule

        def recorded(now):
            batch = schedule(now)
            if batch is not None and not batch.has_prefill:
                windows.append([(d.num_cached_tokens, d.num_slots, len(d.request.block_table))
                                for d in batch.seqs])
            return batch

        s.schedule = recorded
        return s

    simulate(reqs, new, MODEL, HW, OVERHEAD, num_blocks=400, progress=False)
    return reqs, windows


def test_a_policy_that_decodes_three_tokens_a_step_finishes_in_a_third_of_the_steps():
    """A whole simulation under a user's speculation policy drafting 2 tokens, all accepted
    (3 tokens a step): each request's 30
    tokens after its first come 3 a step in 10 decode windows (30 at one a step), every one
    counted with its step's time, each window's slots held in exactly the blocks they need,
    and TPOT a third of a step's time."""
    one, one_windows = simulated(Policy())
    three, three_windows = simulated(Policy(), speculation=all_accepted())
    assert len(one_windows) == 30 and len(three_windows) == 10
    for req in one + three:
        assert req.num_output_tokens == 31 and len(req.token_times) == 31
        assert req.finish_time == req.token_times[-1]
    for req in three:  # 3 tokens at each decode step's time
        decode = req.token_times[1:]
        assert all(decode[i] == decode[i + 1] == decode[i + 2] < decode[i + 3]
                   for i in range(0, 27, 3))
    for j, window in enumerate(three_windows):  # 3 slots a step from the newest token on
        for cached, slots, blocks in window:
            assert (cached, slots) == (64 + 3 * j, 3)
            assert blocks == -(-(cached + slots) // 16)  # 16-token blocks: just enough

    def tpot(req):
        return (req.token_times[-1] - req.token_times[0]) / (req.num_output_tokens - 1)

    for req in three:  # a third of its steps' mean time
        steps = sorted(set(req.token_times))
        gaps = [b - a for a, b in zip(steps, steps[1:], strict=False)]
        assert tpot(req) == pytest.approx(sum(gaps) / len(gaps) / 3, rel=1e-12)
    # a 3-token step of 4 decodes costs less than 1.8 one-token steps (memory bound, though
    # it runs outside the decode CUDA graphs)
    assert max(tpot(r) for r in three) < 0.6 * min(tpot(r) for r in one)


@pytest.mark.parametrize("answer", [-1, 3, True, 2.0, None])
def test_a_speculation_policys_bad_request_tokens_is_one_line_naming_the_hook(answer):
    s = Scheduler(Policy(), SchedulerConfig(max_num_seqs=16, block_size=4, watermark=0.0), 100,
                  1024, speculation=all_accepted(TwoDrafts(num_tokens=2, tokens=answer)))
    req = Request(0, 0.0, 6, 20)
    s.add_request(req)
    s.update(s.schedule(0.0), [1.0])
    with pytest.raises(HookError) as err:
        s.schedule(1.0)
    assert str(err.value) == (f"speculation policy TwoDrafts.request_tokens returned {answer!r} "
                              "for request 0; it must return an int from 0 to the window's k = 2")


def test_a_policy_with_the_old_decode_tokens_hook_is_one_line():
    """The tokens a decode computes have one home, the speculation policy: a policy that still
    defines decode_tokens is told where it went rather than silently ignored."""

    @dataclass(frozen=True)
    class ThreeTokens(Policy):
        name: ClassVar[str] = "three_tokens"

        def decode_tokens(self, req, sched):
            return 3

    with pytest.raises(HookError, match=r"^policy ThreeTokens defines decode_tokens: .*spec\.policy"):
        Scheduler(ThreeTokens(), SchedulerConfig(), 100, 1024)
