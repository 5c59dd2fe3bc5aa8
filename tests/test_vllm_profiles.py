"""vLLM V0's multi-step output path in the overhead model and the vllm_v0_5/vllm_v0_6 profiles:
per-window request and SSE-chunk terms, per-token work, and what they do to CPU time per token."""

from __future__ import annotations

import dataclasses

import pytest

from experiments.calibrate import load_conf
from policies import ModelSpec, Request, SchedulerConfig, make_scheduler
from simulator import OverheadSpec, SimResult, simulate
from simulator.cost_model import StepShape, step_time
from simulator.hardware import HardwareSpec
from simulator.overhead import output_time, sse_chunks, window_output_times

US = 1e-6


MODEL = ModelSpec.from_dict(load_conf("model", "llama3_8b"))
H100 = HardwareSpec.from_dict(load_conf("hardware", "h100_sxm"))
PROFILES = {name: OverheadSpec.from_dict(load_conf("overhead", name))
            for name in ("vllm_v0_5", "vllm_v0_6", "schedlab_h200")}


def run(requests: list[Request], k: int, spec: OverheadSpec, **kw) -> SimResult:
    def make(num_blocks: int):
        return make_scheduler("multi_step", {"num_steps": k}, SchedulerConfig(), num_blocks,
                              MODEL.max_model_len)

    return simulate(requests, make, MODEL, H100, spec, progress=False, **kw)


def engine_cpu_seconds(res: SimResult) -> float:
    return res.cpu_busy_fraction * res.duration


# ---------------------------------------------------------------- the profiles at k = 1


@pytest.mark.parametrize("name", ["vllm_v0_5", "vllm_v0_6"])
def test_single_step_costs_are_the_published_breakdowns_totals(name):
    """At k = 1 the split profile costs what the unsplit one did: 200 us + 15 us per sequence
    of output processing and 23 us per token of API server (on the engine thread in v0.5)."""
    spec = PROFILES[name]
    assert spec.output_per_window
    api = 23 if spec.api_server_on_critical_path else 0
    for n in (1, 7, 256):
        assert output_time(spec, n, n) == (200 + 15 * n + api * n) * US  # exactly
        per_step = dataclasses.replace(spec, output_per_window=False)
        assert window_output_times(per_step, [n], [n], [n]) == [output_time(spec, n, n)]


def test_per_step_profiles_cost_as_before():
    """A profile without output_per_window (schedlab's engine) prices each step as
    output_base_us + output_per_seq_us * seqs (+ api_per_token_us * tokens), as it always did."""
    spec = dataclasses.replace(PROFILES["schedlab_h200"], api_per_token_us=3.0)
    seqs, delivered = [40, 40, 31, 0], [40, 35, 31, 0]
    got = window_output_times(spec, seqs, delivered, sse_chunks(spec, delivered, False))
    want = [(spec.output_base_us + spec.output_per_seq_us * n + 3.0 * d) * US if n else 0.0
            for n, d in zip(seqs, delivered, strict=True)]
    assert got == want


def test_one_chunk_per_request_and_window():
    per_window = PROFILES["vllm_v0_5"]
    per_step = dataclasses.replace(per_window, output_per_window=False)
    delivered = [10, 10, 9, 4]  # 10 requests get tokens; 6 stop during the window
    assert sse_chunks(per_window, delivered, False) == [0, 0, 0, 10]
    assert sse_chunks(per_window, delivered, True) == delivered  # streamed per step
    assert sse_chunks(per_step, delivered, False) == delivered


# ---------------------------------------------------------------- a hand-computed timeline


def test_window_tokens_reach_the_client_after_one_call_and_one_chunk():
    """Sync output processing, API server in its own process: a 4-step window is pythonized
    step by step, processed once (base + per request + per token) and streamed as one chunk."""
    spec = OverheadSpec("w", output_base_us=500.0, output_per_window=True,
                        output_pythonize_per_seq_us=10.0, output_per_seq_us=20.0,
                        output_per_token_us=30.0, api_per_chunk_us=100.0, api_per_token_us=7.0,
                        api_server_on_critical_path=False)
    req = Request(0, 0.0, 100, 5)  # the prefill's token, then one 4-step window
    run([req], 4, spec)
    prefill = StepShape(100, 1, 100, 1, 100 * 101 / 2, 100, True)
    steps = [StepShape(1, 1, 0, 1, 0.0, 101 + j, j == 0) for j in range(4)]
    out1 = (500 + 10 + 20 + 30) * US
    t1 = step_time(prefill, MODEL, H100) + out1
    gpu_end = t1 + sum(step_time(s, MODEL, H100) for s in steps)
    out4 = (4 * 10 + 4 * 30 + 500 + 20) * US  # per step x4, then the one call
    api4 = (100 + 4 * 7) * US  # one chunk carrying four tokens
    assert req.token_times == pytest.approx([t1 + (100 + 7) * US] + [gpu_end + out4 + api4] * 4,
                                            abs=1e-12)


# ---------------------------------------------------------------- CPU time per generated token

N, PROMPT, DECODE = 64, 16, 64  # DECODE tokens after the prefill's: a multiple of every k


def decode_cpu_per_token(spec: OverheadSpec, k: int) -> float:
    """Engine-thread seconds per decoded token: a run that prefills N prompts together and
    decodes DECODE tokens each, less a run of the same prefill alone."""
    full = [Request(i, 0.0, PROMPT, 1 + DECODE) for i in range(N)]
    res = run(full, k, spec)
    assert res.num_windows == 1 + DECODE // k and res.stats.num_wasted_steps == 0
    prefill_only = run([Request(i, 0.0, PROMPT, 1) for i in range(N)], k, spec)
    assert prefill_only.num_windows == 1
    return (engine_cpu_seconds(res) - engine_cpu_seconds(prefill_only)) / (N * DECODE)


def analytic_cpu_per_token(spec: OverheadSpec, k: int) -> float:
    """The profile's formula for a k-step window of N decoding sequences, per token: once per
    window the schedule and the output call (with the SSE chunks when the API server shares
    the engine thread), per step and sequence the pythonization, per token the rest."""
    assert spec.output_per_window and not spec.schedule_per_kv_token_us
    assert not spec.schedule_multi_step_us and not spec.schedule_multi_step_per_seq_us
    api = spec.api_server_on_critical_path
    per_window = (spec.schedule_base_us + spec.output_base_us
                  + (spec.schedule_per_seq_us + spec.schedule_per_token_us
                     + spec.output_per_seq_us + (spec.api_per_chunk_us if api else 0.0)) * N)
    per_token = (spec.output_pythonize_per_seq_us + spec.output_per_token_us
                 + (spec.api_per_token_us if api else 0.0))
    return (per_window / (k * N) + per_token) * US


@pytest.mark.parametrize("name", ["vllm_v0_5", "vllm_v0_6"])
def test_cpu_time_per_generated_token_falls_with_k_as_the_profile_says(name):
    spec = PROFILES[name]
    ks = (1, 2, 4, 8)
    measured = [decode_cpu_per_token(spec, k) for k in ks]
    for k, got in zip(ks, measured, strict=True):
        assert got == pytest.approx(analytic_cpu_per_token(spec, k), rel=1e-9)
    assert all(a > b for a, b in zip(measured, measured[1:], strict=False))
    # the part that does not fall with k is the per-token work alone
    floor = (spec.output_pythonize_per_seq_us + spec.output_per_token_us
             + (spec.api_per_token_us if spec.api_server_on_critical_path else 0.0)) * US
    assert measured[-1] - floor == pytest.approx((measured[0] - floor) / 8, rel=1e-9)
    # charged per step, as before this model, the output call would not amortise
    per_step = dataclasses.replace(spec, output_per_window=False)
    assert decode_cpu_per_token(per_step, 1) == pytest.approx(measured[0], rel=1e-12)
    assert decode_cpu_per_token(per_step, 8) > measured[-1] * 1.5
