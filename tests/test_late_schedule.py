"""Overlap's late schedule: the shared estimate of when the window in flight ends, the
scheduler's rule for when to use it, and its effect in the simulator."""

from __future__ import annotations

import pytest

from experiments.run import run
from policies import Request, SchedulerConfig, make_policy, make_scheduler
from policies.batch import Batch, ScheduledSeq
from policies.late_schedule import LateSchedule


def _batch(prefill_tokens: list[int], decodes: int, k: int = 1) -> Batch:
    seqs = [ScheduledSeq(Request(i, 0.0, t, 4), t, 0, 1, True)
            for i, t in enumerate(prefill_tokens)]
    seqs += [ScheduledSeq(Request(100 + i, 0.0, 8, 4), 1, 8, k, False) for i in range(decodes)]
    return Batch(seqs, k)


def test_estimates_err_short_and_need_observations():
    late = LateSchedule(margin_s=1e-4)
    decode = _batch([], 8)
    assert late.schedule_at(decode, 10.0) is None  # nothing observed yet
    late.observe_window(decode, 0.010)
    assert late.schedule_at(decode, 10.0) is None  # no formation time yet
    late.observe_form(0.002)
    assert late.schedule_at(decode, 10.0) == pytest.approx(10.0 + 0.010 - 0.002 - 1e-4)
    assert late.schedule_at(_batch([], 8, k=4), 10.0) is None  # no window of 4 steps seen
    # decode windows: the longest recent one with no more sequences
    late.observe_window(_batch([], 4), 0.006)
    assert late.gpu_time(_batch([], 6)) == pytest.approx(0.006)  # the 8-sequence one is longer
    assert late.gpu_time(_batch([], 8)) == pytest.approx(0.010)
    assert late.gpu_time(_batch([], 2)) is None  # smaller than anything seen: form at once
    # windows with prefills: the longest recent one with no more prefill tokens
    late.observe_window(_batch([100], 0), 0.004)
    late.observe_window(_batch([300], 0), 0.009)
    late.observe_window(_batch([200], 2), 0.006)
    assert late.gpu_time(_batch([250], 0)) == pytest.approx(0.006)
    assert late.gpu_time(_batch([50], 0)) is None  # shorter than anything seen
    assert late.gpu_time(_batch([1000], 0)) == pytest.approx(0.009)


def test_the_scheduler_defers_only_with_overlap_late_schedule_and_nothing_waiting():
    def sched(**settings):
        return make_scheduler("single_step", {}, SchedulerConfig(block_size=16, **settings), 1000,
                              4096)

    s = sched(overlap=True)
    s.add_request(Request(0, 0.0, 10, 8))
    assert not s.defers_schedule()  # nothing in flight
    s.schedule(0.0)
    assert s.defers_schedule()  # in flight, nobody waiting
    s.add_request(Request(1, 0.0, 10, 8))
    assert not s.defers_schedule()  # a request waits: form at once
    off = sched(overlap=True, overlap_late_schedule=False)
    off.add_request(Request(0, 0.0, 10, 8))
    off.schedule(0.0)
    assert not off.defers_schedule()
    plain = sched()
    plain.add_request(Request(0, 0.0, 10, 8))
    plain.schedule(0.0)
    assert not plain.defers_schedule()
    with pytest.raises(ValueError, match="scheduler.overlap_late_schedule must be true or false"):
        SchedulerConfig(overlap=True, overlap_late_schedule="yes")
    with pytest.raises(ValueError, match="policy.overlap_late_schedule is now "
                                         "scheduler.overlap_late_schedule"):
        make_policy("single_step", overlap_late_schedule=False)


def _sim(tmp_path, name, rate, *extra):
    from hydra import compose, initialize_config_dir

    from common.paths import conf_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose("config", overrides=[
            "policy=single_step", "hardware=h200_calibrated", "overhead=schedlab_h200",
            f"workload.request_rate={rate}", "workload.num_prompts=300", "workload.seed=1",
            "progress=false", *extra])
    return run(cfg, tmp_path / name)


def test_late_schedule_lets_arrivals_join_the_next_window_in_the_simulator(tmp_path):
    """Poisson 40 req/s, Llama-3-8B on the calibrated H200: formed at once, overlap's windows
    close a window early and median TTFT rises ~60% over no overlap; formed late, it stays
    within 10%. At t=0 (a queue all along) the late schedule changes nothing."""
    base = _sim(tmp_path, "base", 40)["median_ttft_ms"]
    early = _sim(tmp_path, "early", 40, "scheduler.overlap=true",
                 "scheduler.overlap_late_schedule=false")["median_ttft_ms"]
    late = _sim(tmp_path, "late", 40, "scheduler.overlap=true")["median_ttft_ms"]
    assert early > 1.4 * base
    assert late < 1.1 * base
    t0 = [_sim(tmp_path, f"t0{v}", "inf", "scheduler.overlap=true",
               f"scheduler.overlap_late_schedule={v}") for v in ("true", "false")]
    assert t0[0]["request_throughput"] == pytest.approx(t0[1]["request_throughput"], rel=1e-3)


def test_steps_finishing_during_the_late_schedule_wait_stream_one_by_one(tmp_path):
    """multi_step k=4 with overlap at Poisson 20 req/s: the engine pythonizes the window in
    flight while it waits to form the next one, so each step's tokens reach the client as the
    step ends; median ITL is a step's time, as without overlap (not ~0, the window at once)."""
    over = _sim(tmp_path, "k4o", 20, "policy=multi_step", "policy.num_steps=4",
                "scheduler.overlap=true", "backend.stream_per_step=true")
    plain = _sim(tmp_path, "k4", 20, "policy=multi_step", "policy.num_steps=4",
                 "backend.stream_per_step=true")
    assert over["median_itl_ms"] > 0.5 * plain["median_itl_ms"] > 1.0
