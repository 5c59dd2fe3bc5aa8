"""The simulator's results, exactly: small workloads through each path of the event engine (one
replica at t=0 and at Poisson arrivals, with async output and a separate API server; overlap with late scheduling and the front
end's per-request work; a cluster of mixed replicas behind a router; multi-turn conversations with
think time and prefix caching; pipeline stages with max_concurrency and per-step streaming), every
request's times and a digest of every window compared to the values in
tests/data/sim_results_unchanged.json, to the last bit.

The reference values were taken from the event engine before it ran on SimPy (commit 0d96c12):
the port keeps every wake-up at the absolute time it was computed for and every tie in the order
it had. Hardware, overhead, policy and scheduler settings are named here, not taken from the
defaults, so that a change of a default does not move them. Regenerate with
``python tests/test_sim_results_unchanged.py --write`` only for a deliberate change of results.
"""

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
from policies.request import Request
from policies.routers import make_router
from policies.scheduler import Scheduler
from simulator.engine import simulate_cluster
from simulator.hardware import HardwareSpec
from simulator.outcome import ReplicaSpec
from simulator.overhead import OverheadSpec

REFERENCE = Path(__file__).parent / "data" / "sim_results_unchanged.json"


def _conf(group: str, name: str) -> dict:
    return yaml.safe_load((Path(CONF_DIR) / group / f"{name}.yaml").read_text())


MODEL = ModelSpec.from_dict(_conf("model", "llama3_8b"))


def _replica(policy: str, params: dict, hardware: str, overhead: str, *, overlap: bool = False,
             pp: int = 1, num_blocks: int | None = 1200, stream_per_step: bool = False,
             max_num_seqs: int = 48) -> ReplicaSpec:
    def new_scheduler(blocks: int) -> Scheduler:
        return Scheduler(make_policy(policy, **params),
                         SchedulerConfig(max_num_seqs=max_num_seqs, overlap=overlap,
                                         overlap_late_schedule=True, enable_prefix_caching=True),
                         blocks, MODEL.max_model_len)

    return ReplicaSpec(new_scheduler, MODEL,
                       HardwareSpec.from_dict(_conf("hardware", hardware), ParallelConfig(1, pp)),
                       OverheadSpec.from_dict(_conf("overhead", overhead)),
                       num_blocks=num_blocks, stream_per_step=stream_per_step)


def _synthetic(n: int, rate: float, seed: int) -> list[Request]:
    lengths = {"dist": "lognormal", "prompt_mean": 400, "prompt_sigma": 0.8, "output_mean": 120,
               "output_sigma": 0.8, "prompt_min": 4, "output_min": 4, "prompt_max": 1500,
               "output_max": 300}
    specs = build_workload({"kind": "synthetic", "num_prompts": n, "seed": seed,
                            "request_rate": rate, "burstiness": 1.0, "lengths": lengths},
                           max_model_len=MODEL.max_model_len)
    return [to_request(s, i, with_token_ids=False) for i, s in enumerate(specs)]


def _conversations(n: int, rate: float, seed: int) -> list[Request]:
    """``n`` conversations of 1 to 4 turns, each turn's prompt the conversation so far (its
    content segments shared with the turn before it), sent think_time after that turn's last
    token; the first turns at Poisson times."""
    import numpy as np

    rng = np.random.default_rng(seed)
    starts = np.cumsum(rng.exponential(1.0 / rate, n))
    out: list[Request] = []
    for c in range(n):
        segments: tuple[tuple[int, int], ...] = ()
        previous = None
        for turn in range(int(rng.integers(1, 5))):
            message = (c * 100 + 2 * turn, int(rng.integers(20, 300)))
            segments = (*segments, message)
            output = int(rng.integers(8, 160))
            req = Request(len(out), float(starts[c]), sum(s[1] for s in segments), output,
                          prefix_segments=segments, previous_turn=previous,
                          think_time=0.0 if previous is None else float(rng.uniform(0.2, 2.0)),
                          conversation_id=c)
            out.append(req)
            previous = req.request_id
            segments = (*segments, (c * 100 + 2 * turn + 1, output))  # its reply
    return out


# name: (requests, replicas, router, max_concurrency)
CASES = {
    "one-replica-t0": (
        lambda: _synthetic(150, float("inf"), seed=4),
        lambda: [_replica("multi_step", {"num_steps": 8}, "h200_calibrated", "schedlab_h200",
                          num_blocks=900)],
        "round_robin", None),
    "one-replica-async-api-server": (
        lambda: _synthetic(120, 25.0, seed=5),
        lambda: [_replica("multi_step", {"num_steps": 8}, "h100_sxm", "vllm_v0_6",
                          num_blocks=250)],
        "round_robin", None),
    "one-replica-overlap-front-end": (
        lambda: _synthetic(120, 30.0, seed=6),
        lambda: [_replica("cp1", {"num_steps": 4}, "h200_calibrated", "schedlab_h200_server",
                          overlap=True)],
        "round_robin", None),
    "cluster-mixed": (
        lambda: _synthetic(150, 70.0, seed=7),
        lambda: [_replica("multi_step", {"num_steps": 4}, "h100_sxm", "vllm_v0_5"),
                 _replica("chunked_prefill", {}, "h200_calibrated", "schedlab_h200_server",
                          overlap=True),
                 _replica("multi_step", {"num_steps": 8}, "h200_calibrated", "schedlab_h200")],
        "least_outstanding", None),
    "multi-turn-cluster": (
        lambda: _conversations(40, 8.0, seed=8),
        lambda: [_replica("multi_step", {"num_steps": 4}, "h100_sxm", "vllm_v0_6",
                          num_blocks=600),
                 _replica("cp1", {"num_steps": 4}, "h200_calibrated", "schedlab_h200",
                          overlap=True, num_blocks=600)],
        "prefix_affinity", None),
    "multi-turn-one-replica-max-concurrency": (
        lambda: _conversations(30, 10.0, seed=9),
        lambda: [_replica("multi_step", {"num_steps": 8}, "h100_sxm", "vllm_v0_5")],
        "round_robin", 6),
    "pipeline-stages-stream": (
        lambda: _synthetic(80, 20.0, seed=10),
        lambda: [_replica("single_step", {}, "h100_sxm", "vllm_v0_6", pp=2,
                          stream_per_step=True, num_blocks=None)],
        "round_robin", 16),
}


def _digest(value) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


def run_case(name: str, processes: list | None = None) -> dict:
    """Each request's replica, send time, first scheduled time, first and last token times,
    finish time, token count and preemptions, a digest of its token times, and a digest of
    every replica's steps.csv rows."""
    make_requests, make_replicas, router, max_concurrency = CASES[name]
    requests = make_requests()
    res = simulate_cluster(requests, make_replicas(), make_router(router),
                           max_concurrency=max_concurrency, progress=False, processes=processes)
    return {
        "duration": res.total.duration,
        "num_windows": [r.num_windows for r in res.replicas],
        "steps": [_digest(r.steps.rows) for r in res.replicas],
        "requests": [[where, r.arrival_time, r.first_scheduled_time,
                      r.token_times[0] if r.token_times else None,
                      r.token_times[-1] if r.token_times else None, r.finish_time,
                      len(r.token_times), r.num_preemptions, _digest(list(r.token_times))]
                     for r, where in zip(requests, res.replica_of, strict=True)],
    }


@pytest.mark.parametrize("name", list(CASES))
def test_results_are_those_of_the_heap_engine(name):
    ref = json.loads(REFERENCE.read_text())[name]
    got = run_case(name)
    assert got["num_windows"] == ref["num_windows"]
    assert got["steps"] == ref["steps"]
    assert got["duration"] == ref["duration"]
    for g, r in zip(got["requests"], ref["requests"], strict=True):
        assert g == r, f"request {got['requests'].index(g)}: {g} != {r}"
    assert len(got["requests"]) == len(ref["requests"])


@pytest.mark.parametrize("name", ["one-replica-overlap-front-end", "cluster-mixed",
                                  "multi-turn-one-replica-max-concurrency"])
def test_a_process_that_only_reads_changes_nothing(name):
    """A user's process (simulator/processes.py) that wakes every 5 ms and reads the
    simulation's state leaves every result as it was."""
    seen = []

    def monitor(env, sim):
        while True:
            seen.append(sum(s.num_waiting + s.num_running for r in sim.replicas
                            for s in r.schedulers))
            yield env.timeout(0.005)

    assert run_case(name, [monitor]) == json.loads(REFERENCE.read_text())[name]
    assert len(seen) > 100 and max(seen) > 0


if __name__ == "__main__" and "--write" in sys.argv:
    REFERENCE.write_text(json.dumps({name: run_case(name) for name in CASES}) + "\n")
