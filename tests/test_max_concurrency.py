"""workload.max_concurrency: benchmark_serving's semaphore (policies/client.py) in the client
itself, in the simulator and in the real engine (tiny model on the CPU)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import yaml

from common.client import Client
from common.parallel import ParallelConfig
from policies import ModelSpec, Request, SchedulerConfig, make_scheduler
from simulator import OverheadSpec, simulate
from simulator.hardware import HardwareSpec

CONF = Path(__file__).resolve().parents[1] / "conf"


def load(kind: str, name: str) -> dict:
    return yaml.safe_load((CONF / kind / f"{name}.yaml").read_text())


MODEL = ModelSpec.from_dict(load("model", "llama3_8b"))
H100 = HardwareSpec.from_dict(load("hardware", "h100_sxm"))
V05 = OverheadSpec.from_dict(load("overhead", "vllm_v0_5"))


def max_in_flight(requests: list[Request]) -> int:
    """The most requests sent and unfinished at once ([send, last token) intervals: a request
    sent at the instant another finishes takes its slot)."""
    events = sorted([(r.finish_time, -1) for r in requests] + [(r.arrival_time, 1) for r in requests])
    n = most = 0
    for _, step in events:
        n += step
        most = max(most, n)
    return most


# --- the client ----------------------------------------------------------------------------------

def reqs(*arrivals: float) -> list[Request]:
    return [Request(i, a, 4, 4) for i, a in enumerate(arrivals)]


def test_without_a_limit_every_due_request_is_sent_at_its_arrival():
    client = Client(reqs(0.5, 0.0, 2.0))
    assert [r.request_id for r in client.send_due(1.0)] == [1, 0]
    assert client.next_send_time() == 2.0
    sent = client.send_due(2.0)
    assert [(r.request_id, r.arrival_time) for r in sent] == [(2, 2.0)]
    assert client.num_unsent == 0 and client.next_send_time() is None


def test_a_request_due_while_the_slots_are_held_is_sent_when_one_frees():
    client = Client(reqs(0.0, 0.0, 0.0, 5.0), max_concurrency=2)
    first = client.send_due(0.0)
    assert [r.request_id for r in first] == [0, 1] and client.num_in_flight == 2
    assert client.next_send_time() is None  # both slots held: the next send waits for a finish
    assert client.send_due(3.0) == []
    client.finished(first[:1], [3.0])
    (third,) = client.send_due(3.0)
    assert third.request_id == 2 and third.arrival_time == 3.0  # sent at the finish, not at 0
    assert client.next_send_time() is None
    client.finished(first[1:], [4.0])  # a slot frees before the last request is due: it goes at its time
    assert client.next_send_time() == 5.0 and client.send_due(4.5) == []
    (last,) = client.send_due(5.0)
    assert last.arrival_time == 5.0


def test_held_requests_go_in_arrival_order_and_take_the_earliest_slot():
    client = Client(reqs(0.0, 1.0, 2.0), max_concurrency=1)
    sent = client.send_due(2.0)
    client.finished(sent, [2.5])
    (r,) = client.send_due(9.0)  # noticed late: it was sent when the slot freed
    assert (r.request_id, r.arrival_time) == (1, 2.5)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_a_bad_limit_is_refused(bad):
    with pytest.raises(ValueError, match="workload.max_concurrency must be an integer >= 1"):
        Client(reqs(0.0), max_concurrency=bad)


def test_more_finishes_than_sends_is_a_bug_named():
    client = Client(reqs(0.0), max_concurrency=1)
    (sent,) = client.send_due(0.0)
    with pytest.raises(RuntimeError, match="2 requests finished but only 1"):
        client.finished([sent, sent], [1.0, 1.0])


# --- the simulator -------------------------------------------------------------------------------

def workload(n: int = 120, rate: float = np.inf, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i in range(n):
        out.append(Request(i, t, rng.randint(20, 600), rng.randint(10, 300)))
        if rate != np.inf:
            t += rng.expovariate(rate)
    return out


def sim(requests: list[Request], limit: int | None, policy: str = "multi_step", **kw):
    params = {"num_steps": 8} if policy == "multi_step" else {}
    cfg = SchedulerConfig()
    return simulate(requests, lambda n: make_scheduler(policy, params, cfg, n, MODEL.max_model_len),
                    MODEL, H100, V05, max_concurrency=limit, progress=False, **kw)


@pytest.mark.parametrize("rate", [np.inf, 30.0])
@pytest.mark.parametrize("limit", [1, 4, 16])
def test_sim_never_has_more_than_the_limit_in_flight(rate, limit):
    requests = workload(rate=rate)
    due = {r.request_id: r.arrival_time for r in requests}
    sim(requests, limit)
    assert max_in_flight(requests) == limit
    finishes = {r.finish_time for r in requests}
    for r in requests:
        assert r.arrival_time >= due[r.request_id]
        if r.arrival_time > due[r.request_id]:  # held back: sent as another's last token arrived
            assert r.arrival_time in finishes
        assert r.token_times[0] > r.arrival_time  # TTFT from the send


def test_sim_throughput_falls_as_the_limit_shrinks_and_a_loose_limit_is_no_limit():
    def served(limit):
        requests = workload()
        res = sim(requests, limit)
        return len(requests) / res.duration, [r.token_times for r in requests]

    free, free_times = served(None)
    rates = [served(n)[0] for n in (1, 4, 16)]
    assert rates[0] < rates[1] < rates[2] < free
    loose, loose_times = served(120)  # >= num_prompts: nothing is ever held back
    assert loose == free and loose_times == free_times


def test_sim_limit_with_async_output_pipeline_and_stream_per_step():
    """Finishes are learnt at their delivery (after update(), deferred output processing, or
    per step): every schedule still respects the limit."""
    v06 = OverheadSpec.from_dict(load("overhead", "vllm_v0_6"))
    params = {"num_steps": 8}
    for kw in ({"stream_per_step": True}, {}):
        requests = workload(60)
        simulate(requests, lambda n: make_scheduler("multi_step", params, SchedulerConfig(), n,
                                                    MODEL.max_model_len),
                 MODEL, H100, v06, max_concurrency=5, progress=False, **kw)
        assert max_in_flight(requests) == 5
    requests = workload(60)
    h200_pp2 = HardwareSpec.from_dict(load("hardware", "h200"),
                                      ParallelConfig(pipeline_parallel_size=2))
    simulate(requests, lambda n: make_scheduler("single_step", {}, SchedulerConfig(), n,
                                                MODEL.max_model_len),
             MODEL, h200_pp2, V05, max_concurrency=3, progress=False)
    assert max_in_flight(requests) == 3


# --- the real engine (tiny model, CPU) -------------------------------------------------------------

@pytest.mark.parametrize(("policy", "params", "overlap"), [("multi_step", {"num_steps": 4}, False),
                                                            ("single_step", {}, True)])
def test_real_engine_never_has_more_than_the_limit_in_flight(policy, params, overlap):
    from real_backend import run_real

    tiny = ModelSpec.from_dict(load("model", "tiny"))

    def requests():
        rng = random.Random(3)
        return [Request(i, 0.002 * i, 0, rng.randint(3, 8),
                        prompt_token_ids=[rng.randrange(tiny.vocab_size)
                                          for _ in range(rng.randint(2, 12))]) for i in range(8)]

    def serve(reqs, limit):
        cfg = SchedulerConfig(block_size=4, overlap=overlap)
        return run_real(reqs, lambda n: make_scheduler(policy, params, cfg, n, tiny.max_model_len),
                        tiny, {"device": "cpu", "num_blocks": 64, "save_token_ids": True},
                        max_concurrency=limit, progress=False)

    free = serve(requests(), None)
    held = requests()
    due = {r.request_id: r.arrival_time for r in held}
    out = serve(held, 2)
    assert out.token_ids == free.token_ids  # greedy: the limit changes timing, not tokens
    assert max_in_flight(held) == 2
    finishes = {r.finish_time for r in held}
    late = [r for r in held if r.arrival_time > due[r.request_id]]
    assert late and all(r.arrival_time in finishes for r in late)
    assert all(r.token_times[0] > r.arrival_time for r in held)


def test_measured_runs_with_other_limits_are_not_averaged_as_repeats(tmp_path):
    import json

    from experiments.measured import measured_from_dir

    for name, limit in (("a", 8), ("b", 16)):
        (tmp_path / f"{name}.json").write_text(json.dumps({
            "policy": "single_step", "request_rate": 10.0, "num_prompts": 5, "completed": 5,
            "request_throughput": 2.0, "max_concurrency": limit}))
    with pytest.raises(ValueError, match=r"different max_concurrency \(16.0 and 8.0\)"):
        measured_from_dir(tmp_path)
