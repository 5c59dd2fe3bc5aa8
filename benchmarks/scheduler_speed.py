"""Benchmark: CPU cost of Scheduler.schedule() + update() with 256 running requests.

Usage: python benchmarks/scheduler_speed.py
Prints microseconds per window (one schedule() and one update()) for each policy, median
over many windows in steady state (every request decoding, none finishing).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.model_spec import ModelSpec  # noqa: E402
from policies import Request, SchedulerConfig, make_scheduler  # noqa: E402
from simulator.cost_model import step_time_fn  # noqa: E402
from simulator.hardware import HardwareSpec  # noqa: E402

CASES = [("single_step", {}), ("multi_step", {"num_steps": 8}), ("chunked_prefill", {}),
         ("cp1", {"num_steps": 8}), ("cp2", {"num_steps": 8}), ("cp_promote", {"num_steps": 8}),
         ("adaptive", {"num_steps": 8}), ("priority", {}), ("sjf", {}), ("edf", {}),
         ("sarathi", {}), ("mlfq", {}), ("slo_adaptive", {"num_steps": 8})]
NUM_SEQS = 256
# sarathi and slo_adaptive price windows: Llama-3-8B on the calibrated H200 profile
_CONF = Path(__file__).resolve().parents[1] / "conf"
STEP_TIME = step_time_fn(
    ModelSpec.from_dict(yaml.safe_load((_CONF / "model" / "llama3_8b.yaml").read_text())),
    HardwareSpec.from_dict(
        yaml.safe_load((_CONF / "hardware" / "h200_calibrated.yaml").read_text())))
WINDOWS = 400


def measure(name: str, params: dict) -> float:
    s = make_scheduler(name, params, SchedulerConfig(max_num_batched_tokens=1 << 20),
                       num_blocks=200_000, max_model_len=1 << 20, step_time_fn=STEP_TIME)
    for i in range(NUM_SEQS):
        s.add_request(Request(i, 0.0, 500, 100_000))
    now = 0.0
    while s.num_waiting:  # admit and prefill everybody
        b = s.schedule(now)
        s.update(b, [now] * b.num_steps)
    costs = []
    for _ in range(WINDOWS):
        t0 = time.perf_counter()
        b = s.schedule(now)
        s.update(b, [now + j for j in range(b.num_steps)])
        costs.append(time.perf_counter() - t0)
        assert len(b.seqs) == NUM_SEQS
        now += b.num_steps
    return statistics.median(costs) * 1e6


if __name__ == "__main__":
    print(f"{'policy':<16}{'us/window':>10}")
    for name, params in CASES:
        print(f"{name:<16}{measure(name, params):>10.0f}")
