"""The simulator's fast paths (wake-ups at absolute times, the scheduler's and the
block manager's hot loops, the streamed per-request results, the decode group) against the
implementation before them: on small runs covering every engine loop (blocking and async output processing, deferred
last output, overlap with and without late scheduling, pipeline stages, per-step streaming, a
separate API-server process, max_concurrency, preemption), every window is the same and every
request's token times are the same to the nanosecond.

Tolerance: 1e-9 s. The old engine slept ``timeout(t - now)`` and woke at ``now + (t - now)``,
which can differ from ``t`` in the last bit; the engine now wakes at ``t`` (simulator/events.py).
The reference values in tests/data/sim_fast_paths.json were taken from that first simpy engine
(regenerate with ``python tests/test_sim_fast_paths.py --write`` only for a deliberate change of
results)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import yaml

from common.model_spec import ModelSpec
from common.parallel import ParallelConfig
from experiments.run import CONF_DIR
from experiments.workload import build_workload, to_request
from policies import SchedulerConfig, make_policy
from policies.scheduler import Scheduler
from simulator.engine import simulate
from simulator.hardware import HardwareSpec
from simulator.overhead import OverheadSpec

REFERENCE = Path(__file__).parent / "data" / "sim_fast_paths.json"
TOLERANCE_S = 1e-9

# name: (policy, params, overlap, rate, hardware, overhead, pp, stream_per_step, max_conc, blocks)
CASES = {
    "multi_step-t0-async": ("multi_step", {"num_steps": 8}, False, "inf", "h200_calibrated",
                            "schedlab_h200", 1, False, None, 900),
    "multi_step-poisson-blocking": ("multi_step", {"num_steps": 4}, False, 25.0, "h100_sxm",
                                    "vllm_v0_5", 1, False, None, None),
    "cp1-poisson-overlap": ("cp1", {"num_steps": 8}, True, 30.0, "h200_calibrated",
                            "schedlab_h200", 1, False, None, 900),
    "chunked-t0-overlap-early": ("chunked_prefill", {"overlap_late_schedule": False}, True,
                                 "inf", "h200_calibrated", "schedlab_h200", 1, False, None, 600),
    "single_step-pp2-stream": ("single_step", {}, False, 20.0, "h100_sxm", "vllm_v0_6", 2, True,
                               None, None),
    "multi_step-deferred-maxconc": ("multi_step", {"num_steps": 8}, False, 40.0, "h100_sxm",
                                    "vllm_v0_6", 1, False, 24, None),
    "priority-preempting": ("priority", {}, False, 60.0, "h200_calibrated", "schedlab_h200", 1,
                            False, None, 300),
}


def _conf(group: str, name: str) -> dict:
    return yaml.safe_load((Path(CONF_DIR) / group / f"{name}.yaml").read_text())


def run_case(name: str) -> dict:
    """The case's window digest and each request's token count, first and last token times,
    finish time and preemptions."""
    policy, params, overlap, rate, hardware, overhead, pp, stream, max_conc, blocks = CASES[name]
    model = ModelSpec.from_dict(_conf("model", "llama3_8b"))
    lengths = {**_conf("workload", "synthetic")["lengths"], "dist": "lognormal",
               "prompt_mean": 500, "output_mean": 150, "prompt_max": 1500, "output_max": 300}
    classes = {"a": {"share": 0.3, "priority": 0}, "b": {"share": 0.7, "priority": 1}}
    specs = build_workload({"kind": "synthetic", "num_prompts": 160, "seed": 11,
                            "request_rate": float(rate), "burstiness": 1.0, "lengths": lengths,
                            "classes": classes}, max_model_len=model.max_model_len)
    requests = [to_request(s, i, with_token_ids=False) for i, s in enumerate(specs)]
    digest = hashlib.sha256()

    def new_scheduler(num_blocks: int) -> Scheduler:
        late = params.get("overlap_late_schedule", True)
        sched = Scheduler(make_policy(policy, **{k: v for k, v in params.items()
                                                 if k != "overlap_late_schedule"}),
                          SchedulerConfig(max_num_seqs=48, overlap=overlap,
                                          overlap_late_schedule=late),
                          num_blocks, model.max_model_len)
        schedule = sched.schedule

        def recorded(now: float):
            batch = schedule(now)
            if batch is not None:
                seqs = [(req.request_id, q, cached, steps)
                        for req, q, cached, steps, _ in sched.window_seqs(batch)]
                digest.update(repr((batch.num_steps, seqs,
                                    [r.request_id for r in batch.preempted])).encode())
            return batch

        sched.schedule = recorded
        return sched

    hw = HardwareSpec.from_dict(_conf("hardware", hardware), ParallelConfig(1, pp))
    res = simulate(requests, new_scheduler, model, hw,
                   OverheadSpec.from_dict(_conf("overhead", overhead)), num_blocks=blocks,
                   stream_per_step=stream, max_concurrency=max_conc, progress=False)
    return {"windows": digest.hexdigest()[:16], "num_windows": res.num_windows,
            "duration": res.duration,
            "requests": [[len(r.token_times), r.arrival_time,
                          r.token_times[0] if r.token_times else None,
                          r.token_times[-1] if r.token_times else None,
                          sum(r.token_times), r.finish_time, r.num_preemptions]
                         for r in requests]}


def _close(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= TOLERANCE_S


@pytest.mark.parametrize("name", list(CASES))
def test_fast_paths_match_the_reference(name):
    ref = json.loads(REFERENCE.read_text())[name]
    got = run_case(name)
    assert got["windows"] == ref["windows"]
    assert got["num_windows"] == ref["num_windows"]
    assert _close(got["duration"], ref["duration"])
    assert len(got["requests"]) == len(ref["requests"])
    for g, r in zip(got["requests"], ref["requests"], strict=True):
        assert g[0] == r[0] and g[6] == r[6]  # token count, preemptions
        # token times summed over ~150 tokens: the tolerance scaled by the count
        assert all(_close(x, y) for x, y in zip(g[1:4] + g[5:6], r[1:4] + r[5:6], strict=True))
        assert abs(g[4] - r[4]) <= TOLERANCE_S * max(1, g[0])


if __name__ == "__main__" and "--write" in sys.argv:
    REFERENCE.write_text(json.dumps({name: run_case(name) for name in CASES}) + "\n")


def test_a_finish_hook_that_keeps_the_lists_changes_nothing(monkeypatch):
    """A finish hook that records each window's finished requests (a decode group's with their
    runs of its delivery log) and keeps their lists: its table is the table of the requests'
    final token times, and those are the reference's."""
    import numpy as np

    from experiments.request_times import TimesRecorder, TimesTable

    seen = {}
    real_simulate = simulate

    def simulate_recording(requests, *args, **kwargs):
        recorder = seen["recorder"] = TimesRecorder(len(requests))
        seen["requests"], seen["runs"] = requests, 0

        def hook(finished, replica, runs):
            seen["runs"] += runs is not None
            recorder.record([r.request_id for r in finished], finished, runs)

        return real_simulate(requests, *args, on_finish=hook, **kwargs)

    monkeypatch.setattr(sys.modules[__name__], "simulate", simulate_recording)
    name = "multi_step-poisson-blocking"
    got, ref = run_case(name), json.loads(REFERENCE.read_text())[name]
    assert seen["runs"] > 10  # the decode group's windows handed their runs over
    assert [g[0] for g in got["requests"]] == [r[0] for r in ref["requests"]]
    assert all(_close(g[4], r[4]) for g, r in zip(got["requests"], ref["requests"], strict=True))
    table, whole = seen["recorder"].table(), TimesTable.of_requests(seen["requests"])
    for column in ("completed", "output_len", "num_chunks", "itl_start", "ttft", "e2el"):
        assert np.array_equal(getattr(table, column), getattr(whole, column)), column
    assert np.array_equal(table.itls, whole.itls)
