"""The power-limited clock term: off by default, slows sustained compute, recovers at rest, and
its calibration recovers known parameters from a replayed load history."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from experiments.fit import fit_clock
from policies import ModelSpec
from simulator.clock import PowerClock
from simulator.cost_model import StepShape, stage_time, step_cost
from simulator.hardware import HardwareSpec

CONF = Path(__file__).resolve().parents[1] / "conf"
MODEL = ModelSpec.from_dict(yaml.safe_load((CONF / "model" / "llama3_8b.yaml").read_text()))
H200 = HardwareSpec.from_dict(yaml.safe_load((CONF / "hardware" / "h200.yaml").read_text()))
PREFILL = StepShape(4096, 4, 4096, 4, 4 * 1024 * 1025 / 2, 4096, True)  # 4 x 1024-token prompts
DECODE = StepShape(8, 8, 0, 8, 0.0, 8 * 500, True, 500)  # memory-bound


def hot(**kw) -> HardwareSpec:
    return dataclasses.replace(H200, **{"clock_power_slowdown": 0.1, "clock_heat_slowdown": 0.15,
                                        "clock_tau_s": 2.0, **kw})


def test_off_by_default_prices_as_before_the_clock_term():
    """The datasheet profile's prices, pinned to what the cost model gave before the clock
    term, the p-norm roofline and the mixed-step kernels existed (all off by default)."""
    pc = PowerClock(MODEL, H200)
    assert not pc.on
    mixed = StepShape(300, 33, 268, 33, 268 * 269 / 2, 20000, True, 900)
    assert pc.window_times([PREFILL, DECODE, mixed], 5.0) == pytest.approx(
        [0.0855566953697775, 0.0044700602256410255, 0.007268320880738872], rel=1e-12)


def test_tensor_core_share_is_high_for_prefill_and_low_for_small_decode():
    tp, busy = step_cost(PREFILL, MODEL, H200)
    assert 0.9 < busy / tp <= 1.0
    td, busy_d = step_cost(DECODE, MODEL, H200)
    assert busy_d / td < 0.05
    slow_t, slow_busy = step_cost(PREFILL, MODEL, H200, 1.2)
    assert slow_t == pytest.approx(1.2 * tp, rel=0.05) and slow_busy > busy


def test_sustained_prefill_slows_and_rest_recovers():
    pc = PowerClock(MODEL, hot())
    t = 0.0
    first = pc.window_times([PREFILL], t)[0]
    for _ in range(2000):  # ~ many tau of back-to-back prefills
        t = pc.t
        last = pc.window_times([PREFILL], t)[0]
    cold = stage_time(PREFILL, MODEL, H200)
    assert first == pytest.approx(cold * (1 + 0.1 * step_cost(PREFILL, MODEL, H200)[1] / cold),
                                  rel=0.02)  # the instant power slowdown only
    assert last > first * 1.1  # the heat adds on top under sustained load
    rested = pc.window_times([PREFILL], pc.t + 20.0)[0]  # 10 tau idle
    assert rested == pytest.approx(first, rel=0.01)
    # memory-bound decode barely feels the heat
    pc2 = PowerClock(MODEL, hot())
    pc2.heat = 1.0
    assert pc2.window_times([DECODE], 0.0)[0] < stage_time(DECODE, MODEL, H200) * 1.01


def test_fit_clock_recovers_known_parameters():
    truth = hot(clock_power_slowdown=0.08, clock_heat_slowdown=0.12, clock_tau_s=3.0)
    rng = np.random.default_rng(0)
    # a load history: bursts of prefill and decode windows with idle gaps
    windows = {1: PREFILL, 2: DECODE}
    rows = [{"window": w, **dataclasses.asdict(s), "max_sm_mhz": 1980.0}
            for w, s in windows.items()]
    data = pd.DataFrame(rows)
    pc = PowerClock(MODEL, truth)
    timeline, samples = [], []
    t = 0.0
    for burst in range(12):
        wid = 1 if burst % 3 else 2
        t += rng.uniform(0.2, 6.0)
        pc.rest_until(t)
        for _ in range(int(rng.integers(50, 600))):
            start = pc.t if pc.t > t else t
            dur = pc.window_times([windows[wid]], start)[0]
            t = start + dur
            timeline.append((wid, start, t, dur))
            full, busy = step_cost(windows[wid], MODEL, truth)
            slow = pc.slowdown(busy / full)  # the clock while the next window would run
            samples.append((t - dur / 2, 1980.0 / slow, 0.0, 0))
    tl = pd.DataFrame(timeline, columns=["window", "start_s", "end_s", "gpu_s"])
    clock = pd.DataFrame(samples, columns=["t", "sm_mhz", "power_w", "temp_c"])
    hw, err = fit_clock(data, tl, clock, MODEL, H200)
    assert err["clock slowdown rms"] < 0.01
    assert hw.clock_power_slowdown == pytest.approx(0.08, abs=0.02)
    assert hw.clock_heat_slowdown == pytest.approx(0.12, abs=0.02)
    assert hw.clock_tau_s == pytest.approx(3.0, rel=0.3)


def test_fit_clock_without_samples_leaves_the_term_off():
    data = pd.DataFrame([{"window": 1, **dataclasses.asdict(DECODE), "max_sm_mhz": 1980.0}])
    timeline = pd.DataFrame({"window": [1], "start_s": [0.0], "end_s": [1.0], "gpu_s": [1.0]})
    empty = pd.DataFrame(columns=["t", "sm_mhz", "power_w", "temp_c"])
    hw, err = fit_clock(data, timeline, empty, MODEL, H200)
    assert hw == H200 and err == {}
    few = pd.DataFrame({"t": [0.5] * 5, "sm_mhz": [1500] * 5, "power_w": 0.0, "temp_c": 0})
    assert fit_clock(data, timeline, few, MODEL, H200) == (H200, {})  # too few to fit


def test_bad_time_constant_is_one_line_error():
    with pytest.raises(ValueError, match="hardware.clock_tau_s"):
        dataclasses.replace(H200, clock_tau_s=0.0)


def test_clock_sampler_is_none_without_a_gpu():
    from real_backend.gpu_clock import ClockSampler

    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert ClockSampler.for_device(0) is None


@pytest.mark.parametrize("follows,given", [(1.0, None), (0.0, None), (1.0, 1.0)])
def test_fit_gpu_finds_how_much_of_the_sampled_clock_shows_in_step_times(follows, given):
    """Fitted (given None), the elasticity comes out as the data's; held at 1 (the default)
    on data that follows the clock, the rest of the fit is as good."""
    from experiments.fit import SHAPE_COLS, fit_gpu

    truth = dataclasses.replace(H200, roofline_exponent=2.0, kernel_launch_us=5.0)
    rng = np.random.default_rng(1)
    rows = []
    for i, (n, q) in enumerate([(1, 2048), (4, 1024), (8, 512), (2, 4096), (1, 8192), (16, 256)]
                               * 3):
        shape = StepShape(n * q, n, n * q, n, n * q * (q + 1) / 2, n * q, True)
        mhz = float(rng.uniform(1450, 1980))
        slow = 1 + follows * (1980 / mhz - 1)
        rows.append({"kind": "prefill", "k": 1, "step": 0, "window": i,
                     **{c: getattr(shape, c) for c in SHAPE_COLS},
                     "gpu_s": stage_time(shape, MODEL, truth, slow), "sm_mhz": mhz,
                     "max_sm_mhz": 1980.0})
    for i, (b, c) in enumerate([(8, 500), (64, 800), (128, 300), (256, 500), (32, 1500)] * 3):
        shape = StepShape(b, b, 0, b, 0.0, b * c, True, c)
        rows.append({"kind": "decode", "k": 1, "step": 0, "window": 100 + i,
                     **{c: getattr(shape, c) for c in SHAPE_COLS},
                     "gpu_s": stage_time(shape, MODEL, truth), "sm_mhz": 1980.0,
                     "max_sm_mhz": 1980.0})
    # the terms the fit holds, at the truth's values (its longest-sequence term is off: any
    # attn_seq_gbps that never binds fits these steps)
    held = {k: (getattr(truth, k), "given") for k in ("kernel_launch_us", "advance_step_us",
                                                       "sampler_us", "mixed_kernels_per_layer")}
    hw, steps, elasticity = fit_gpu(pd.DataFrame(rows), MODEL, H200, elasticity=given,
                                    fixed=held)
    assert elasticity == pytest.approx(follows, abs=1e-3)
    assert steps["rel_error"].abs().max() < 1e-3
    for key in ("matmul_efficiency", "mem_bw_efficiency", "attn_prefill_efficiency",
                "attn_decode_efficiency", "roofline_exponent", "cuda_graph_replay_us"):
        assert getattr(hw, key) == pytest.approx(getattr(truth, key), rel=1e-3), key
