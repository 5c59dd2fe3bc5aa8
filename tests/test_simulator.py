"""The simulated engine: hand-computed timelines, pipeline stages, and the physics it must obey."""

from __future__ import annotations

import dataclasses
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import yaml

from policies import ModelSpec, Request, SchedulerConfig, make_scheduler
from policies.request import RequestState
from simulator import OverheadSpec, SimResult, scale_overhead, simulate
from simulator.cost_model import StepShape, stage_time, step_time
from simulator.hardware import HardwareSpec

CONF = Path(__file__).resolve().parents[1] / "conf"
US = 1e-6


def load(kind: str, name: str) -> dict:
    return yaml.safe_load((CONF / kind / f"{name}.yaml").read_text())


MODEL = ModelSpec.from_dict(load("model", "llama3_8b"))
H100 = HardwareSpec.from_dict(load("hardware", "h100_sxm"))
NONE = OverheadSpec.from_dict(load("overhead", "none"))
V05 = OverheadSpec.from_dict(load("overhead", "vllm_v0_5"))
V06 = OverheadSpec.from_dict(load("overhead", "vllm_v0_6"))
# Round numbers for hand-computed timelines: schedule 1000 + 10/seq + 1/token us,
# output processing 500 + 20/seq us, API server 100 us per token.
HAND = OverheadSpec("hand", 1000.0, 10.0, 1.0, 500.0, 20.0, 100.0)


def run(policy: str, requests: list[Request], *, k: int = 8, hw: HardwareSpec = H100,
        overhead: OverheadSpec = NONE, max_model_len: int | None = None, **kw) -> SimResult:
    params = {"num_steps": k} if policy not in ("single_step", "chunked_prefill") else {}
    max_len = max_model_len or MODEL.max_model_len

    def make(num_blocks: int):
        return make_scheduler(policy, params, SchedulerConfig(), num_blocks, max_len)

    return simulate(requests, make, MODEL, hw, overhead, progress=False,
                    max_model_len=max_model_len, **kw)


def synthetic(n: int, seed: int = 0, *, prompt_max: int = 1000, output_max: int = 300,
              rate: float | None = None) -> list[Request]:
    """Uniform lengths; all at t=0 (offline) or Poisson arrivals at ``rate`` per second."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(4, prompt_max, n)
    outputs = rng.integers(4, output_max, n)
    times = np.zeros(n) if rate is None else np.cumsum(rng.exponential(1.0 / rate, n))
    return [Request(i, float(times[i]), int(prompts[i]), int(outputs[i])) for i in range(n)]


def prefill_shape(p: int) -> StepShape:
    return StepShape(p, 1, p, 1, p * (p + 1) / 2, p, True)


def decode_shape(ctx: int, first: bool = True) -> StepShape:
    """One sequence decoding the token at position ctx - 1 (ctx KV tokens)."""
    return StepShape(1, 1, 0, 1, 0.0, ctx, first)


def g(shape: StepShape, hw: HardwareSpec = H100) -> float:
    return step_time(shape, MODEL, hw)


# ---------------------------------------------------------------- hand-computed timelines


def test_single_step_synchronous_timeline():
    """schedule, GPU, output processing (API server on the engine thread), strictly serial."""
    req = Request(0, 0.0, 100, 3)
    res = run("single_step", [req], overhead=HAND)
    s_prefill, s_decode = (1000 + 10 + 100) * US, (1000 + 10 + 1) * US
    out = (500 + 20 + 100) * US
    t1 = s_prefill + g(prefill_shape(100)) + out
    t2 = t1 + s_decode + g(decode_shape(101)) + out
    t3 = t2 + s_decode + g(decode_shape(102)) + out
    assert req.token_times == pytest.approx([t1, t2, t3], abs=1e-12)
    assert req.finish_time == req.token_times[-1] and res.duration == pytest.approx(t3)
    assert req.first_scheduled_time == 0.0
    busy = s_prefill + 2 * s_decode + 3 * out
    assert res.cpu_busy_fraction == pytest.approx(busy / t3)


def test_front_end_request_work_on_the_engine_thread_delays_entry_and_engine():
    """api_per_request_us on the critical path: the engine thread parses each request in
    turn, and the scheduler sees a request once its parse is done; TTFT counts from the send."""
    spec = dataclasses.replace(HAND, api_per_request_us=300.0)
    reqs = [Request(0, 0.0, 100, 1), Request(1, 0.0, 100, 1)]
    res = run("single_step", reqs, overhead=spec)
    # both parsed (600 us) before the first schedule, which then takes both prompts
    s_prefill = (1000 + 2 * 10 + 200) * US
    t1 = 600 * US + s_prefill + g(StepShape(200, 2, 200, 2, 2 * 100 * 101 / 2, 200, True))
    t1 += (500 + 2 * 20 + 2 * 100) * US
    assert [r.token_times[0] for r in reqs] == pytest.approx([t1, t1], abs=1e-12)
    assert all(r.arrival_time == 0.0 for r in reqs)
    assert res.cpu_busy_fraction == pytest.approx((600 * US + s_prefill + 740 * US) / t1)


def test_front_end_request_work_in_its_own_process_delays_entry_only():
    """Off the critical path the parse runs on the API-server process: the engine thread is
    not charged, and a request that arrives while the engine is busy is parsed meanwhile."""
    spec = dataclasses.replace(HAND, api_per_request_us=300.0, api_server_on_critical_path=False)
    first, second = Request(0, 0.0, 100, 2), Request(1, 0.001, 100, 1)
    run("single_step", [first, second], overhead=spec)
    plain = [Request(0, 0.0, 100, 2), Request(1, 0.001, 100, 1)]
    run("single_step", plain, overhead=dataclasses.replace(spec, api_per_request_us=0.0))
    # the first request enters 300 us late; the second is parsed while the GPU runs the
    # first's prefill, so it joins the same next window as without the parse
    shift = 300 * US
    assert first.token_times[0] == pytest.approx(plain[0].token_times[0] + shift, abs=1e-12)
    assert second.token_times[0] == pytest.approx(plain[1].token_times[0] + shift, abs=1e-12)


def test_handing_tokens_to_a_front_end_process_costs_the_engine_per_window():
    """handoff_*: the engine thread sends the front end one message per window, with one event
    per request that got tokens, so every later token waits for each hand-over before it; a
    multi-step window pays once (once a step when streamed per step, the what-if); a front end
    on the engine thread (one process) has no pipe to pay for."""
    serve = dataclasses.replace(HAND, api_per_token_us=0.0, api_server_on_critical_path=False,
                                api_chunk_per_window=True)
    with_handoff = dataclasses.replace(serve, handoff_per_window_us=70.0,
                                       handoff_per_chunk_us=3.0)
    each = (70 + 2 * 3) * US  # one window's message, two requests' events

    def pair() -> list[Request]:
        return [Request(0, 0.0, 100, 5), Request(1, 0.0, 100, 5)]

    # the windows before each of the 5 tokens: single_step 1..5; multi_step k=4: the prefill
    # window, then one window of 4 steps
    for policy, k, windows, per_step in (("single_step", 1, [1, 2, 3, 4, 5], False),
                                         ("multi_step", 4, [1, 2, 2, 2, 2], False),
                                         ("multi_step", 4, [1, 2, 3, 4, 5], True)):
        plain, handed = pair(), pair()
        base = run(policy, plain, k=k, overhead=serve, stream_per_step=per_step)
        res = run(policy, handed, k=k, overhead=with_handoff, stream_per_step=per_step)
        for a, b in zip(plain, handed, strict=True):
            assert b.token_times == pytest.approx(
                [t + n * each for t, n in zip(a.token_times, windows, strict=True)], abs=1e-12)
        busy = [r.cpu_busy_fraction * r.duration for r in (base, res)]
        assert busy[1] == pytest.approx(busy[0] + windows[-1] * each, abs=1e-12)
    one_process = dataclasses.replace(with_handoff, api_server_on_critical_path=True)
    plain, handed = pair(), pair()
    run("single_step", plain, overhead=dataclasses.replace(one_process, handoff_per_window_us=0.0,
                                                           handoff_per_chunk_us=0.0))
    run("single_step", handed, overhead=one_process)
    assert [r.token_times for r in handed] == [r.token_times for r in plain]


def test_async_output_processing_runs_after_the_next_schedule():
    """vLLM 0.6 order: schedule window n+1, launch it, then process window n's outputs."""
    spec = dataclasses.replace(HAND, async_output_processing=True,
                               api_server_on_critical_path=False)
    req = Request(0, 0.0, 100, 3)
    run("single_step", [req], overhead=spec)
    s_prefill, s_decode = 1110 * US, 1011 * US
    out, api = 520 * US, 100 * US
    g1 = s_prefill + g(prefill_shape(100))
    g2 = g1 + s_decode + g(decode_shape(101))
    g3 = g2 + s_decode + g(decode_shape(102))
    expected = [g1 + s_decode + out + api, g2 + s_decode + out + api, g3 + out + api]
    assert req.token_times == pytest.approx(expected, abs=1e-12)


def test_async_output_not_deferred_is_processed_as_the_window_ends():
    """schedlab's engine order: a window's last outputs are pythonized before the next
    schedule, so each token is out a schedule earlier than in vLLM 0.6's order."""
    spec = dataclasses.replace(HAND, async_output_processing=True, defer_last_output=False,
                               api_server_on_critical_path=False)
    req = Request(0, 0.0, 100, 3)
    run("single_step", [req], overhead=spec)
    s_prefill, s_decode = 1110 * US, 1011 * US
    out, api = 520 * US, 100 * US
    t1 = s_prefill + g(prefill_shape(100)) + out
    t2 = t1 + s_decode + g(decode_shape(101)) + out
    t3 = t2 + s_decode + g(decode_shape(102)) + out
    assert req.token_times == pytest.approx([t1 + api, t2 + api, t3 + api], abs=1e-12)


def test_multi_step_window_tokens_arrive_in_one_burst():
    req = Request(0, 0.0, 100, 5)
    res = run("multi_step", [req], k=4, overhead=HAND)
    out = 620 * US
    t1 = 1110 * US + g(prefill_shape(100)) + out  # a prefill window is one step
    steps = [g(decode_shape(101)), g(decode_shape(102, False)), g(decode_shape(103, False)),
             g(decode_shape(104, False))]
    gpu_end = t1 + 1011 * US + sum(steps)
    assert req.token_times == pytest.approx([t1] + [gpu_end + 4 * out] * 4, abs=1e-12)
    assert res.stats.num_windows == 2 and res.stats.num_wasted_steps == 0


def test_stream_per_step_and_wasted_steps():
    """Per-step streaming delivers each step once processed; a step past max_tokens is wasted."""
    req = Request(0, 0.0, 100, 4)  # 1 token from the prefill, 3 from a 4-step window
    res = run("multi_step", [req], k=4, overhead=HAND, stream_per_step=True)
    t1 = 1110 * US + g(prefill_shape(100)) + 620 * US
    gpu_end = t1 + 1011 * US + g(decode_shape(101)) + sum(
        g(decode_shape(c, False)) for c in (102, 103, 104))
    expected = [t1] + [gpu_end + j * 620 * US for j in (1, 2, 3)]
    assert req.token_times == pytest.approx(expected, abs=1e-12)
    assert res.stats.num_wasted_steps == 1
    # the wasted step is still processed (no API cost): the thread is busy 520 us more
    assert res.duration == pytest.approx(expected[-1])


def test_async_multi_step_processes_each_step_during_the_next():
    """Steps 1..k-1 are processed while the GPU runs on; step k after the next schedule."""
    spec = dataclasses.replace(HAND, async_output_processing=True,
                               api_server_on_critical_path=False)
    req = Request(0, 0.0, 100, 9)  # prefill token + two 4-step windows
    run("multi_step", [req], k=4, overhead=spec, stream_per_step=True)
    s_decode, out = 1011 * US, (520 + 100) * US  # engine-thread processing + API streaming

    def window(start: float, ctx: int) -> list[float]:
        ends, t = [], start
        for j in range(4):
            t += g(decode_shape(ctx + j, first=j == 0))
            ends.append(t)
        return ends

    g1 = 1110 * US + g(prefill_shape(100))
    w2 = window(g1 + s_decode, 101)
    w3 = window(w2[-1] + s_decode, 105)
    expected = ([g1 + s_decode + out] + [t + out for t in w2[:3]] + [w2[3] + s_decode + out]
                + [t + out for t in w3])  # nothing left to schedule after the last window
    assert req.token_times == pytest.approx(expected, abs=1e-12)


def test_pipeline_stages_fill_with_two_virtual_engines():
    """pp=2: each step crosses two stages; a second micro-batch fills the bubble."""
    hw = dataclasses.replace(H100, pp=2)
    alone = Request(0, 0.0, 600, 2)
    res1 = run("single_step", [alone], hw=hw)
    s_pre, s_dec = (stage_time(sh, MODEL, hw) for sh in (prefill_shape(600), decode_shape(601)))
    assert alone.token_times == pytest.approx([2 * s_pre, 2 * s_pre + 2 * s_dec])
    assert res1.gpu_busy_fraction == pytest.approx(0.5)  # one micro-batch: half the stages idle
    pair = [Request(0, 0.0, 600, 2), Request(1, 0.0, 600, 2)]  # round-robin: one per engine
    res2 = run("single_step", pair, hw=hw)
    # Engine 1's prefill waits for stage 0 until s_pre and holds stage 1 until 3 s_pre, so
    # engine 0's (shorter) decode waits for stage 1 in turn; engine 1's decode then follows it.
    assert s_dec < s_pre
    assert pair[0].token_times == pytest.approx([2 * s_pre, 3 * s_pre + s_dec])
    assert pair[1].token_times == pytest.approx([3 * s_pre, 3 * s_pre + 2 * s_dec])
    assert res2.gpu_busy_fraction > 0.6


def test_pipeline_parallel_serves_everything_with_busy_stages():
    hw = dataclasses.replace(H100, pp=2)
    reqs = synthetic(300, seed=3)
    res = run("multi_step", reqs, hw=hw, overhead=V06)
    assert res.num_finished == 300
    assert all(len(r.token_times) == r.max_tokens for r in reqs)
    assert 0.8 < res.gpu_busy_fraction <= 1.0


# ---------------------------------------------------------------- invariants


@pytest.mark.parametrize("policy", ["single_step", "multi_step", "chunked_prefill", "cp1", "cp2",
                                    "cp_promote", "adaptive"])
@pytest.mark.parametrize("overhead", [NONE, V05, V06], ids=["none", "v0_5", "v0_6"])
def test_every_token_is_delivered_in_order(policy, overhead):
    reqs = synthetic(120, seed=1, rate=30.0)
    res = run(policy, reqs, overhead=overhead)
    assert res.num_finished == len(reqs)
    for r in reqs:
        tt = r.token_times
        assert len(tt) == r.max_tokens
        assert all(a <= b for a, b in pairwise(tt))
        assert tt[0] > r.arrival_time and r.first_scheduled_time >= r.arrival_time - 1e-9
        assert r.finish_time == tt[-1]
    assert res.duration == max(r.finish_time for r in reqs)
    assert 0.0 < res.gpu_busy_fraction <= 1.0 + 1e-9
    assert res.cpu_busy_fraction <= 1.0 + 1e-9


def test_same_inputs_same_token_times():
    first, second = synthetic(200, seed=7, rate=20.0), synthetic(200, seed=7, rate=20.0)
    a = run("multi_step", first, overhead=V06)
    b = run("multi_step", second, overhead=V06)
    assert [r.token_times for r in first] == [r.token_times for r in second]
    assert (a.duration, a.stats, a.gpu_busy_fraction) == (b.duration, b.stats, b.gpu_busy_fraction)


def test_multi_step_bursts_unless_streamed_per_step():
    bursts = synthetic(100, seed=2)
    per_step = synthetic(100, seed=2)
    run("multi_step", bursts, overhead=V06)
    run("multi_step", per_step, overhead=V06, stream_per_step=True)

    def zero_gaps(reqs):
        return sum(b == a for r in reqs for a, b in pairwise(r.token_times))

    assert zero_gaps(bursts) > 0.5 * sum(r.max_tokens for r in bursts)
    assert zero_gaps(per_step) == 0
    # the same GPU work either way; per-step streaming only moves deliveries earlier
    for p, b in zip(per_step, bursts, strict=True):
        assert p.token_times[-1] <= b.token_times[-1] + 1e-12


# ---------------------------------------------------------------- physics


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("multi, single", [("multi_step", "single_step"),
                                           ("cp1", "chunked_prefill"),
                                           ("cp2", "chunked_prefill")])
def test_without_cpu_overhead_multi_step_never_beats_single_step(seed, multi, single):
    """With nothing to amortise, k steps only add advance_step and wasted slots.

    The batch fits the 256 seats, so both run the same decode batches: with more requests than
    seats, V0 single-step runs a small prefill batch whenever a request finishes and can lose.
    """
    one = run(single, synthetic(200, seed=seed))
    many = run(multi, synthetic(200, seed=seed))
    assert many.duration >= one.duration


def test_multi_step_gain_grows_with_cpu_overhead_toward_the_amortisation_bound():
    """Per-invocation CPU cost S, GPU step g: k=8 gains (S + g) / (S / 8 + g) over k=1."""
    gains = []
    for scale in (0.0, 1.0, 4.0, 16.0, 64.0):
        spec = scale_overhead(OverheadSpec("schedule_only", schedule_base_us=1000.0), scale)
        one = run("single_step", [Request(i, 0.0, 100, 1025) for i in range(128)], overhead=spec)
        eight = run("multi_step", [Request(i, 0.0, 100, 1025) for i in range(128)],
                    overhead=spec)
        gain = one.duration / eight.duration
        cpu = spec.schedule_base_us * US
        gpu = one.gpu_busy_fraction * one.duration / one.stats.num_steps
        assert gain == pytest.approx((cpu + gpu) / (cpu / 8 + gpu), rel=0.02)
        gains.append(gain)
    assert all(a < b for a, b in pairwise(gains)), gains
    assert gains[0] <= 1.0 and gains[-1] > 3.5


def test_multi_step_gain_grows_as_the_vllm_profile_is_scaled_up():
    gains = []
    for scale in (0.25, 1.0, 4.0):
        spec = scale_overhead(V05, scale)
        one = run("single_step", synthetic(200, seed=5), overhead=spec)
        eight = run("multi_step", synthetic(200, seed=5), overhead=spec)
        gains.append(one.duration / eight.duration)
    assert 1.0 < gains[0] < gains[1] < gains[2], gains


@pytest.mark.parametrize("policy", ["single_step", "multi_step"])
def test_more_kv_memory_never_lowers_offline_throughput(policy):
    """On an A10G the KV cache binds: more of it means larger batches and fewer preemptions."""
    a10g = HardwareSpec.from_dict(load("hardware", "a10g"))
    durations, preemptions = [], []
    for util in (0.8, 0.85, 0.9, 0.95):
        res = run(policy, synthetic(300, seed=0, prompt_max=600), hw=a10g, overhead=V06,
                  gpu_memory_utilization=util, max_model_len=1024)
        durations.append(res.duration)
        preemptions.append(res.stats.num_preemptions)
    assert all(a >= b for a, b in pairwise(durations)), durations
    assert preemptions[0] > preemptions[-1]


def test_async_output_processing_and_a_separate_api_server_raise_throughput():
    v05 = run("single_step", synthetic(200, seed=4), overhead=V05)
    v06 = run("single_step", synthetic(200, seed=4), overhead=V06)
    ideal = run("single_step", synthetic(200, seed=4), overhead=NONE)
    assert ideal.duration < v06.duration < v05.duration
    assert v05.gpu_busy_fraction < v06.gpu_busy_fraction < ideal.gpu_busy_fraction


# ---------------------------------------------------------------- errors and speed


def test_a_model_that_does_not_fit_fails_before_simulating():
    m70 = ModelSpec.from_dict(load("model", "llama3_70b"))
    with pytest.raises(ValueError, match="model llama3_70b does not fit on hardware h100_sxm"):
        simulate([Request(0, 0.0, 10, 10)], lambda n: None, m70, H100, NONE, progress=False)


def test_requests_must_be_fresh():
    reqs = synthetic(5)
    run("single_step", reqs)
    with pytest.raises(ValueError, match="simulate needs fresh requests: request 0"):
        run("single_step", reqs)
    # each sign of a served request alone names the first one that has it
    for served in ({"state": RequestState.FINISHED}, {"token_times": [0.5]},
                   {"num_output_tokens": 1}):
        reqs = synthetic(5)
        for r in reqs[3:]:
            for name, value in served.items():
                setattr(r, name, value)
        with pytest.raises(ValueError, match="fresh requests: request 3 has already been served"):
            run("single_step", reqs)


def test_steps_rows_given_to_fill_must_be_empty_and_of_the_runs_kind():
    from simulator.outcome import StepRows

    for steps in (StepRows(True), StepRows(False, [(0,) * 12])):
        with pytest.raises(ValueError, match="steps must be 1 empty StepRows, one a replica"):
            run("multi_step", synthetic(3), steps=steps)
    filled = StepRows(False)  # the rows the result gives are these
    assert run("multi_step", synthetic(3), steps=filled).steps is filled and len(filled)


def test_a_request_that_can_never_run_is_the_schedulers_error():
    with pytest.raises(ValueError, match="exceeds model.max_model_len"):
        run("single_step", [Request(0, 0.0, 9000, 10)])


def test_progress_bar_counts_finished_requests(capsys):
    make = lambda n: make_scheduler("single_step", {}, SchedulerConfig(), n, 8192)  # noqa: E731
    res = simulate(synthetic(10), make, MODEL, H100, NONE, progress=True)
    assert res.num_finished == 10 and "10/10" in capsys.readouterr().err


def test_a_thousand_online_requests_with_k8_all_finish():
    # speed is measured by benchmarks/sim_speed.py (BENCHMARKS.md), not asserted here
    res = run("multi_step", synthetic(1000, seed=9, rate=50.0), overhead=V06)
    assert res.num_finished == 1000 and res.wall_seconds > 0


def test_input_preparation_grows_with_the_kv_tokens_a_window_attends_over():
    """schedule_per_kv_token_us: the prefill window (100 KV tokens) and each decode window
    (101, 102) pay it on the engine thread before their GPU work."""
    base = run("single_step", [Request(0, 0.0, 100, 3)], overhead=HAND)
    kv = dataclasses.replace(HAND, schedule_per_kv_token_us=2.0)
    req = Request(0, 0.0, 100, 3)
    run("single_step", [req], overhead=kv)
    extra = [2.0 * US * n for n in (100, 100 + 101, 100 + 101 + 102)]
    assert req.token_times == pytest.approx(
        [t + e for t, e in zip(base.requests[0].token_times, extra, strict=True)], abs=1e-12)


def test_time_scale_stretches_every_cost_and_steps_csv_has_each_window():
    """time_scale multiplies every priced cost: offline (all arrivals at t = 0, no clock model)
    the whole run stretches by it exactly. The window rows follow the real engine's columns."""
    base = run("multi_step", synthetic(40), overhead=V06)
    slow = run("multi_step", synthetic(40), overhead=V06, time_scale=2.0)
    assert slow.duration == pytest.approx(2.0 * base.duration, rel=1e-9)
    for a, b in zip(base.requests, slow.requests, strict=True):
        assert b.token_times == pytest.approx([2.0 * t for t in a.token_times], rel=1e-9)
    assert len(base.steps) == base.num_windows
    assert [r["window"] for r in base.steps] == sorted(r["window"] for r in base.steps)
    row = base.steps[0]
    assert row["gpu_s"] == pytest.approx(sum(float(g) for g in row["gpu_step_s"].split(";")),
                                         abs=1e-5)
    assert all(r["t_start"] <= s["t_start"] for r, s in pairwise(base.steps))
    # with the clock model on, its heat follows the scaled steps: the run still stretches by
    # the scale (to the heat's small response to longer steps)
    hw = HardwareSpec.from_dict(load("hardware", "h200_calibrated"))
    assert hw.clock_heat_slowdown > 0
    on = run("multi_step", synthetic(100), hw=hw, overhead=V06)
    for scale in (0.99, 1.01):
        ratio = run("multi_step", synthetic(100), hw=hw, overhead=V06, time_scale=scale).duration
        assert ratio / on.duration == pytest.approx(scale, abs=2e-4)
    assert {r["virtual_engine"] for r in base.steps} == {0}
    for bad in (0.0, -1.0, float("nan"), 1e300):  # 1e300: a clock that overflows the peaks
        with pytest.raises(ValueError, match="backend.time_scale"):
            run("multi_step", synthetic(2), time_scale=bad)


def test_mixed_window_term_is_charged_only_to_windows_mixing_prefill_and_decode():
    from simulator.overhead import OverheadSpec, schedule_time

    spec = OverheadSpec(schedule_base_us=100.0, schedule_mixed_us=50.0,
                        schedule_mixed_per_seq_us=2.0, schedule_prefill_per_layer_us=1.0)
    assert schedule_time(spec, 10, 10, num_layers=16) == pytest.approx(100e-6)  # all decodes
    assert schedule_time(spec, 10, 900, num_prefill_seqs=10,
                         num_layers=16) == pytest.approx(116e-6)  # prefills: per layer
    assert schedule_time(spec, 10, 300, num_prefill_seqs=2,
                         num_layers=16) == pytest.approx(186e-6)  # mixed
