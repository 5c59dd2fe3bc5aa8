"""Overlap scheduling (scheduler.overlap): the scheduler's contract, hand-worked windows, properties
(placeholders never leak or double-free blocks, never more than max_tokens), the simulator's
timeline, and the same decisions as the non-overlapped run would deliver."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_policy_properties import PARAMS, stand_in_step_time  # every policy's test settings

from policies import (
    POLICIES,
    ModelSpec,
    Request,
    RequestState,
    SchedulerConfig,
    make_policy,
    make_scheduler,
)
from simulator import OverheadSpec, SimResult, simulate
from simulator.cost_model import StepShape, step_time
from simulator.hardware import HardwareSpec

EOS = 7
CONF = Path(__file__).resolve().parents[1] / "conf"


def sched(name, params=None, *, overlap=True, blocks=100, budget=None, seqs=256, bs=4,
          watermark=0.0):
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, block_size=bs,
                          watermark=watermark, overlap=overlap)
    return make_scheduler(name, params or {}, cfg, blocks, 4096,
                          stand_in_step_time)


def token(req: Request, j: int) -> int:
    """The j-th output token of ``req`` as a deterministic stand-in model would sample it."""
    return random.Random(req.request_id * 1000 + j).randrange(16)


def sampled_for(batch) -> list[list[int]]:
    """Each sequence's tokens, drawn when its window's update() comes: every earlier window is
    settled by then, so num_output_tokens is where the window's samples start."""
    out = []
    for s in batch.seqs:
        req = s.request
        start = req.num_output_tokens
        out.append([token(req, start + j) for j in range(s.num_steps)])
    return out


def serve(s, reqs: list[Request], *, on_window=None) -> list:
    """The overlap loop of both backends: schedule window n+1, then update window n."""
    pending = sorted(reqs, key=lambda r: r.arrival_time)
    everyone = list(reqs)
    now, last, windows = 0.0, None, []
    while pending or s.has_unfinished or last is not None:
        while pending and pending[0].arrival_time <= now:
            s.add_request(pending.pop(0))
        batch = s.schedule(now)
        if batch is not None:
            windows.append(batch)
            if on_window:
                on_window(s, batch, everyone)
        if last is not None:
            s.update(last, [now + j + 1.0 for j in range(last.num_steps)], sampled_for(last))
            if on_window:
                on_window(s, None, everyone)
            now += last.num_steps
        elif batch is None:
            now = pending[0].arrival_time
        last = batch
        assert len(windows) < 5000, "no progress"
    return windows


def serve_plain(s, reqs: list[Request]) -> None:
    """The loop without overlap: update() before the next schedule()."""
    pending = sorted(reqs, key=lambda r: r.arrival_time)
    now = 0.0
    while pending or s.has_unfinished:
        while pending and pending[0].arrival_time <= now:
            s.add_request(pending.pop(0))
        batch = s.schedule(now)
        if batch is None:
            now = pending[0].arrival_time
            continue
        s.update(batch, [now + j + 1.0 for j in range(batch.num_steps)], sampled_for(batch))
        now += batch.num_steps


def expected(req: Request) -> list[int]:
    out = []
    for j in range(req.max_tokens):
        out.append(token(req, j))
        if req.eos_token_id is not None and out[-1] == req.eos_token_id:
            break
    return out


def shape(batch):
    return [(s.request.request_id, s.num_query_tokens, s.num_cached_tokens, s.num_steps)
            for s in batch.seqs]


# ---------------------------------------------------------------- hand-worked windows


def test_single_step_next_window_assumes_the_one_in_flight():
    s = sched("single_step")
    r0, r1 = Request(0, 0.0, 5, 3), Request(1, 0.0, 6, 2)
    s.add_request(r0)
    s.add_request(r1)
    w1 = s.schedule(0.0)
    assert shape(w1) == [(0, 5, 0, 1), (1, 6, 0, 1)]
    w2 = s.schedule(0.5)  # w1 is in flight: both assumed to continue, decoding their next token
    assert shape(w2) == [(0, 1, 5, 1), (1, 1, 6, 1)]
    assert (r0.num_output_placeholders, r1.num_output_placeholders) == (2, 2)
    # r1's second (last) token is in w2: known done, it leaves running but keeps its blocks
    assert s.running == [r0] and s.finishing == [r1] and len(r1.block_table) == 2
    with pytest.raises(RuntimeError, match="two windows are in flight"):
        s.schedule(0.6)
    with pytest.raises(ValueError, match="window 2 is not the oldest one in flight"):
        s.update(w2, [2.0])
    s.update(w1, [1.0])
    assert (r0.num_output_tokens, r0.num_output_placeholders) == (1, 1)
    w3 = s.schedule(1.0)
    assert shape(w3) == [(0, 1, 6, 1)]  # r1 is not rescheduled
    assert s.finishing == [r1, r0] and s.running == []
    s.update(w2, [2.0])
    assert r1.is_finished and r1.block_table == [] and r1.token_times == [1.0, 2.0]
    assert s.schedule(2.0) is None  # nothing left to form: the backend updates w3 first
    s.update(w3, [3.0])
    assert r0.is_finished and r0.num_output_tokens == 3 and s.stats.num_wasted_steps == 0
    assert not s.has_unfinished and s.block_manager.num_free_blocks == 100


def test_multi_step_placeholders_cover_the_window_and_stop_at_max_tokens():
    s = sched("multi_step", {"num_steps": 4})
    r0 = Request(0, 0.0, 5, 6)
    s.add_request(r0)
    w1 = s.schedule(0.0)  # prefill: one step, samples 1
    w2 = s.schedule(0.1)
    assert shape(w2) == [(0, 1, 5, 4)] and r0.num_output_placeholders == 5
    assert r0.num_computed_tokens == 9 and len(r0.block_table) == 3  # slots 5..8 reserved
    s.update(w1, [1.0])
    w3 = s.schedule(1.0)
    # one token still owed after w2: a 4-step window whose 3 last steps are wasted
    assert shape(w3) == [(0, 1, 9, 4)] and w3.seqs[0].num_placeholders == 1
    assert s.finishing == [r0]
    s.update(w2, [2.0, 3.0, 4.0, 5.0])
    s.update(w3, [6.0, 7.0, 8.0, 9.0])
    assert r0.is_finished and r0.num_output_tokens == 6 and w3.num_wasted_steps == 3


def test_eos_is_found_one_window_late_and_its_slot_counted():
    s = sched("single_step")
    r = Request(0, 0.0, 4, 10, prompt_token_ids=[1, 2, 3, 4], eos_token_id=EOS)
    s.add_request(r)
    w1 = s.schedule(0.0)
    w2 = s.schedule(0.0)
    s.update(w1, [1.0], [[3]])
    w3 = s.schedule(1.0)  # the EOS sampled in w2 is not known yet: r is scheduled again
    assert shape(w3) == [(0, 1, 5, 1)]
    assert s.update(w2, [2.0], [[EOS]]) == [r]
    assert r.output_token_ids == [3, EOS] and r.block_table == [] and not s.has_unfinished
    assert r.num_output_placeholders == 0
    s.update(w3, [3.0], [[5]])  # its tokens are dropped, its slot counted as wasted
    assert r.output_token_ids == [3, EOS] and r.token_times == [1.0, 2.0]
    assert w3.num_wasted_steps == 1 and s.stats.num_late_stop_steps == 1
    assert s.block_manager.num_free_blocks == 100


def test_arrivals_join_the_next_window_formed():
    s = sched("chunked_prefill", budget=16)
    r0 = Request(0, 0.0, 4, 5)
    s.add_request(r0)
    w1 = s.schedule(0.0)
    r1 = Request(1, 0.5, 6, 3)
    s.add_request(r1)  # arrives while w1 runs
    w2 = s.schedule(0.5)
    assert shape(w2) == [(0, 1, 4, 1), (1, 6, 0, 1)]
    s.update(w1, [1.0])
    s.update(w2, [2.0])
    assert r1.first_scheduled_time == 0.5 and r1.token_times == [2.0]


def test_preempted_while_in_flight_keeps_its_tokens_and_recomputes_them():
    # 6 blocks of 2 slots, no watermark: r0 and r1 take 3 blocks each for prompt 5 + 1 slot.
    s = sched("single_step", blocks=6, bs=2)
    r0, r1 = Request(0, 0.0, 5, 3), Request(1, 0.0, 5, 6)
    s.add_request(r0)
    s.add_request(r1)
    w1 = s.schedule(0.0)  # both prefilled: the cache is full
    w2 = s.schedule(0.1)  # decodes at position 5 fit the third blocks
    assert shape(w2) == [(0, 1, 5, 1), (1, 1, 5, 1)]
    s.update(w1, [1.0], [[1], [2]])
    w3 = s.schedule(1.0)  # position 6 needs a fourth block each: r1 (in w2) is preempted
    assert shape(w3) == [(0, 1, 6, 1)] and w3.preempted == [r1]
    assert r1.state is RequestState.PREEMPTED and r1.block_table == []
    assert r1.num_output_placeholders == 1  # w2's token is still to come
    assert s.finishing == [r0]  # w3 samples r0's last token
    s.update(w2, [2.0], [[3], [4]])
    assert r1.output_token_ids == [2, 4] and r1.num_output_placeholders == 0
    assert s.schedule(2.0) is None  # r1 needs 4 blocks; r0 holds its 4 until w3 is updated
    s.update(w3, [3.0], [[5]])
    assert r0.output_token_ids == [1, 3, 5] and s.block_manager.num_free_blocks == 6
    w4 = s.schedule(3.0)
    assert shape(w4) == [(1, 7, 0, 1)]  # recomputes its prompt and both tokens
    s.update(w4, [4.0], [[6]])
    assert r1.output_token_ids == [2, 4, 6] and r1.num_computed_tokens == 7
    s.block_manager.check([r0, r1])


def test_a_request_preempted_in_flight_waits_for_its_tokens_before_readmission():
    """schedule() that formed nothing may be asked again before the in-flight update(): the
    request it preempted is not re-admitted with its newest token still unknown."""
    s = sched("single_step", blocks=6, bs=2)
    r0, r1 = Request(0, 0.0, 5, 2), Request(1, 0.0, 5, 6)
    s.add_request(r0)
    s.add_request(r1)
    w1 = s.schedule(0.0)
    w2 = s.schedule(0.1)  # r0's last token is in w2: known done
    s.update(w1, [1.0], [[1], [2]])
    assert s.schedule(1.0) is None  # r1 needs a fourth block: it preempts itself
    assert r1.state is RequestState.PREEMPTED and s.block_manager.num_free_blocks == 3
    assert s.schedule(1.1) is None  # its blocks are free, but its w2 token is not known
    s.update(w2, [2.0], [[3], [4]])
    assert r0.is_finished
    w3 = s.schedule(2.0)
    assert shape(w3) == [(1, 7, 0, 1)] and r1.output_token_ids == [2, 4]


def test_bad_overlap_setting_is_a_one_line_error():
    with pytest.raises(ValueError, match="scheduler.overlap must be true or false, got 'yes'"):
        sched("multi_step", {"num_steps": 4}, overlap="yes")


def test_every_policy_runs_under_overlap_and_the_old_key_is_refused():
    """Overlap is the engine loop's mode (scheduler.overlap), taken by every policy; the key it
    had as a policy setting is one line saying where it went."""
    # the built-in ones: a test may have registered a policy of its own
    built_in = {n for n, c in POLICIES.items() if c.__module__.startswith("policies.")}
    assert set(PARAMS) == built_in
    for name, params in PARAMS.items():
        assert sched(name, params).overlap is True
        assert "overlap" not in sched(name, params).policy.describe()
    with pytest.raises(ValueError) as err:
        make_policy("multi_step", overlap=True)
    assert str(err.value) == ("policy.overlap is now scheduler.overlap: overlap scheduling is "
                              "a mode of the engine loop, for every policy")


def test_adaptive_with_overlap_pays_only_the_cpu_time_the_window_does_not_hide():
    """goodput(k) = useful / max(overhead_steps, k): k = 1 when the CPU is under one step,
    k = overhead_steps when it is longer; without overlap the cost is overhead + k."""
    def k_of(overlap: bool, overhead: float) -> int:
        s = sched("adaptive", {"num_steps": 16, "overhead_steps": overhead}, overlap=overlap)
        for i in range(4):
            s.add_request(Request(i, 0.0, 4, 100))
        prefill = s.schedule(0.0)
        if not overlap:
            s.update(prefill, [1.0])
        return s.schedule(1.0).num_steps  # with overlap: formed while the prefill runs

    assert k_of(True, 0.5) == 1 and k_of(True, 3.0) == 3
    assert k_of(False, 0.5) == 16


# ---------------------------------------------------------------- the same tokens as without


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_overlap_delivers_the_tokens_of_the_plain_loop(name):
    """Preemption (a small cache) and EOS stops: every request gets exactly the tokens the
    loop without overlap gives it, and both match the stand-in model's sequence."""
    def reqs():
        r = random.Random(3)
        return [Request(i, float(r.randint(0, 6)), r.randint(1, 30), r.randint(1, 20),
                        eos_token_id=EOS if i % 3 else None) for i in range(14)]

    plain, over = reqs(), reqs()
    serve_plain(sched(name, PARAMS[name], overlap=False, blocks=18, budget=64, seqs=6), plain)
    s = sched(name, PARAMS[name], blocks=18, budget=64, seqs=6)
    serve(s, over)
    assert s.stats.num_preemptions > 0
    assert any(r.num_output_tokens < r.max_tokens for r in over)  # some stopped on EOS
    for a, b in zip(plain, over, strict=True):
        assert a.output_token_ids == b.output_token_ids == expected(b)


# ---------------------------------------------------------------- properties

workloads = st.fixed_dictionaries({
    "requests": st.lists(st.tuples(st.integers(0, 30),    # arrival time
                                   st.integers(1, 40),    # prompt_len
                                   st.integers(1, 24),    # max_tokens
                                   st.booleans()),        # stops on EOS
                         min_size=1, max_size=16),
    "block_size": st.sampled_from([1, 2, 4, 8]),
    "spare_blocks": st.integers(0, 12),
    "max_num_seqs": st.integers(1, 6),
    "budget": st.integers(64, 96),
    "watermark": st.sampled_from([0.0, 0.05]),
})


def check_invariants(s, batch, everyone: list[Request]) -> None:
    s.block_manager.check(everyone)  # every block free or in exactly one table
    for r in everyone:
        assert r.num_output_placeholders >= 0
        assert r.num_output_tokens + r.num_output_placeholders <= r.max_tokens
        assert len(r.output_token_ids) == r.num_output_tokens == len(r.token_times)
        if r.state is RequestState.FINISHED or r.state is RequestState.WAITING:
            assert r.block_table == []
    if batch is not None:
        bs = s.block_manager.block_size
        for x in batch.seqs:
            assert x.request.state is RequestState.RUNNING
            assert len(x.request.block_table) * bs >= x.num_cached_tokens + x.num_slots
        assert not {r.request_id for r in batch.preempted} & {x.request.request_id
                                                              for x in batch.seqs}


def check_overlap(name: str, w: dict) -> None:
    bs = w["block_size"]
    reqs = [Request(i, float(a), p, m, eos_token_id=EOS if e else None)
            for i, (a, p, m, e) in enumerate(w["requests"])]
    steps = PARAMS[name].get("num_steps", 1)
    need = max(-(-(r.prompt_len + r.max_tokens + steps) // bs) for r in reqs)
    num_blocks = int((need + w["spare_blocks"] + 1) / (1 - w["watermark"])) + 1
    s = sched(name, PARAMS[name], blocks=num_blocks, budget=w["budget"],
              seqs=w["max_num_seqs"], bs=bs, watermark=w["watermark"])
    serve(s, reqs, on_window=check_invariants)
    assert s.block_manager.num_free_blocks == num_blocks
    assert not s.finishing and not s.running and not s.waiting
    for r in reqs:
        assert r.is_finished and r.output_token_ids == expected(r)
        assert r.num_output_placeholders == 0 and r.block_table == []
        assert r.token_times == sorted(r.token_times) and r.finish_time == r.token_times[-1]


def make_property(name: str):
    @settings(max_examples=120, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(workloads)
    def test(w):
        check_overlap(name, w)
    test.__name__ = f"test_overlap_invariants_{name}"
    return test


for _name in PARAMS:
    globals()[f"test_overlap_invariants_{_name}"] = make_property(_name)


# ---------------------------------------------------------------- the simulator's timeline


def load(kind: str, name: str) -> dict:
    return yaml.safe_load((CONF / kind / f"{name}.yaml").read_text())


def test_property_workloads_preempt_in_flight_and_stop_late():
    """The workloads above do reach the cases overlap adds, for every policy: a request
    preempted while its tokens are in flight, and an EOS found one window late."""
    w = {"requests": [(0, 30, 20, True)] * 6 + [(3, 10, 24, True)] * 4, "block_size": 4,
         "spare_blocks": 2, "max_num_seqs": 6, "budget": 64, "watermark": 0.0}
    for name in PARAMS:
        seen = {"in_flight": 0}

        def count(s, batch, everyone, seen=seen):
            if batch is not None:
                seen["in_flight"] += sum(r.num_output_placeholders > 0 for r in batch.preempted)
            check_invariants(s, batch, everyone)

        bs = w["block_size"]
        reqs = [Request(i, float(a), p, m, eos_token_id=EOS if e else None)
                for i, (a, p, m, e) in enumerate(w["requests"])]
        steps = PARAMS[name].get("num_steps", 1)
        need = max(-(-(r.prompt_len + r.max_tokens + steps) // bs) for r in reqs)
        s = sched(name, PARAMS[name], blocks=need + 2, budget=64, seqs=6, bs=bs)
        serve(s, reqs, on_window=count)
        assert seen["in_flight"] > 0, name
        assert s.stats.num_late_stop_steps > 0, name
        assert all(r.output_token_ids == expected(r) for r in reqs)


MODEL = ModelSpec.from_dict(load("model", "llama3_8b"))
H100 = HardwareSpec.from_dict(load("hardware", "h100_sxm"))
US = 1e-6
# schedule 1000 + 10/seq + 1/token us, output processing 500 + 20/seq us, API 100 us per token
HAND = OverheadSpec("hand", 1000.0, 10.0, 1.0, 500.0, 20.0, 100.0)


def simulate_policy(policy: str, requests: list[Request], overhead: OverheadSpec, *,
                    overlap: bool, hw: HardwareSpec = H100, **params) -> SimResult:
    def make(num_blocks: int):
        return make_scheduler(policy, params, SchedulerConfig(overlap=overlap),
                              num_blocks, MODEL.max_model_len)

    return simulate(requests, make, MODEL, hw, overhead, progress=False)


def synthetic(n: int, seed: int = 0) -> list[Request]:
    r = random.Random(seed)
    return [Request(i, 0.0, r.randint(4, 600), r.randint(4, 300)) for i in range(n)]


def gpu(shape: StepShape) -> float:
    return step_time(shape, MODEL, H100)


def test_sim_overlap_timeline_by_hand():
    """Window n+1 is scheduled while window n runs; window n's outputs are processed after
    that launch, each once its step is done; the GPU starts a window when the CPU has launched
    it and the window before is done."""
    req = Request(0, 0.0, 100, 3)
    res = simulate_policy("single_step", [req], HAND, overlap=True)
    s_prefill, s_decode, out = 1110 * US, 1011 * US, 620 * US
    g1 = s_prefill + gpu(StepShape(100, 1, 100, 1, 100 * 101 / 2, 100, True))
    g2 = max(s_prefill + s_decode, g1) + gpu(StepShape(1, 1, 0, 1, 0.0, 101, True))
    d1 = max(g1, s_prefill + s_decode) + out
    g3 = max(d1 + s_decode, g2) + gpu(StepShape(1, 1, 0, 1, 0.0, 102, True))
    d2 = max(g2, d1 + s_decode) + out
    d3 = max(g3, d2) + out  # nothing is scheduled after the window of its last token
    assert req.token_times == pytest.approx([d1, d2, d3], abs=1e-12)
    assert res.duration == pytest.approx(d3) and res.stats.num_windows == 3
    assert [row["t_start"] for row in res.steps] == pytest.approx([0.0, s_prefill, d1])


def test_sim_overlap_hides_cpu_time_shorter_than_the_gpu_step():
    """At k = 1, with 3 ms of CPU a window (under a decode step of a large batch), overlap
    serves at the GPU-bound rate (no CPU cost at all); without it the CPU time adds up."""
    cpu = OverheadSpec("cpu", schedule_base_us=2000.0, output_base_us=1000.0)
    free = simulate_policy("single_step", synthetic(300), OverheadSpec(), overlap=False)
    plain = simulate_policy("single_step", synthetic(300), cpu, overlap=False)
    over = simulate_policy("single_step", synthetic(300), cpu, overlap=True)
    gpu_bound = 300 / free.duration
    assert 300 / plain.duration < 0.85 * gpu_bound
    assert 300 / over.duration > 0.98 * gpu_bound
    assert over.gpu_busy_fraction > 0.98 > plain.gpu_busy_fraction
    # with CPU work longer than the GPU's, the GPU waits for it: the CPU is the bound
    slow = OverheadSpec("slow", schedule_base_us=40000.0)
    over_slow = simulate_policy("single_step", synthetic(300), slow, overlap=True)
    assert over_slow.duration >= over_slow.stats.num_windows * 0.04
    assert over_slow.cpu_busy_fraction > 0.9 > 0.5 > over_slow.gpu_busy_fraction


def test_sim_overlap_off_is_unchanged_and_overlap_is_refused_with_pipeline_stages():
    a = simulate_policy("multi_step", synthetic(50), HAND, overlap=False, num_steps=4)
    b = simulate_policy("multi_step", synthetic(50), HAND, overlap=False, num_steps=4)
    assert a.duration == b.duration
    pp2 = dataclasses.replace(H100, pp=2)
    with pytest.raises(ValueError, match="scheduler.overlap with parallel.pipeline_parallel_size = 2 is "
                                         "not modelled"):
        simulate_policy("single_step", synthetic(4), HAND, overlap=True, hw=pp2)


@pytest.mark.slow
def test_overlap_suite_smoke(tmp_path, monkeypatch, capsys):
    """benchmarks/overlap_suite.py --smoke: every run of the H200 script on the tiny model,
    each recorded with its overlap setting, then the table and the acceptance checks (its
    main() in this process: a command of its own re-imported torch)."""
    import json
    import sys

    root = Path(__file__).resolve().parents[1]
    monkeypatch.syspath_prepend(str(root / "benchmarks"))
    import overlap_suite

    monkeypatch.setattr(sys, "argv", ["overlap_suite.py", str(tmp_path), "--smoke", "--prompts",
                                      "3", "--poisson-prompts", "3", "--rates", "40"])
    overlap_suite.main()
    printed = capsys.readouterr().out
    runs = {p.parent.relative_to(tmp_path).as_posix(): json.loads(p.read_text())
            for p in tmp_path.rglob("result.json")}
    assert len(runs) == 12 and "poisson/multi_step_k8_rate40" in runs
    assert "grid/chunked_prefill" in runs and "poisson/chunked_prefill_rate40" in runs
    for tag, res in runs.items():
        assert res["completed"] == 3
        assert res["schedlab"]["overlap"] == tag.split("_rate")[0].endswith(
            "overlap"), tag
    assert runs["grid/multi_step_k4_overlap"]["schedlab"]["k"] == 4
    table = printed[printed.index("req/s"):]
    assert "FAILED" not in table and "single_step+overlap / multi_step k=8 req/s" in table
    assert "rate 40: median TTFT" in table
