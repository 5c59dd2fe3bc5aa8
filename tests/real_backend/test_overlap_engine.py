"""Overlap scheduling on the real engine: every policy's greedy ids equal single_step's without
overlap (preemptions and EOS stops included), and its windows are the simulator's."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import yaml
from rb_util import DEVICE, greedy_dense, load_spec

from policies import Request, SchedulerConfig, make_scheduler
from real_backend import run_real
from real_backend.config import BackendConfig
from real_backend.engine import build_runner
from real_backend.weights import random_model
from simulator import OverheadSpec, simulate
from simulator.hardware import HardwareSpec

SPEC = load_spec("tiny")
BLOCK_SIZE = 4
NUM_BLOCKS = 24  # 96 token slots for 16 requests of up to 64 tokens: every policy preempts

POLICIES = [
    ("single_step", {}, None),
    ("multi_step", {"num_steps": 4}, None),
    ("multi_step", {"num_steps": 8}, None),
    ("chunked_prefill", {}, 16),  # 16-token budget: prompts of up to 40 tokens get chunked
    ("cp1", {"num_steps": 4}, 16),
    ("cp2", {"num_steps": 4}, 16),
    ("cp_promote", {"num_steps": 4}, 64),
    ("adaptive", {"num_steps": 8, "overhead_steps": 3.0}, None),
]
IDS = [f"{p}{v.get('num_steps', '')}" for p, v, _ in POLICIES]
WINDOW_COLUMNS = ("window", "k", "num_seqs", "num_prefill_seqs", "num_tokens", "kv_tokens",
                  "num_preempted", "num_wasted_steps")


def make_requests(n: int = 16, seed: int = 1, eos: dict[int, int] | None = None) -> list[Request]:
    r = random.Random(seed)
    return [Request(i, 0.0, 0, r.randint(4, 24),
                    prompt_token_ids=[r.randrange(SPEC.vocab_size) for _ in range(r.randint(1, 40))],
                    eos_token_id=(eos or {}).get(i))
            for i in range(n)]


def serve(requests, policy, params, budget, *, overlap: bool, spec=SPEC, **backend):
    cfg = SchedulerConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=budget, overlap=overlap)
    backend = {"device": "cpu", "num_blocks": NUM_BLOCKS, "save_token_ids": True, **backend}
    return run_real(requests, lambda n: make_scheduler(policy, params, cfg, n, spec.max_model_len),
                    spec, backend, progress=False)


@pytest.fixture(scope="module")
def served():
    """``served(policy, params, budget, overlap)``: that run of make_requests() as (requests,
    result), served once for the module (the ids and the windows tests read the same runs)."""
    runs = {}

    def run(policy, params, budget, overlap: bool):
        key = (policy, repr(params), budget, overlap)
        if key not in runs:
            requests = make_requests()
            runs[key] = requests, serve(requests, policy, params, budget, overlap=overlap)
        return runs[key]

    return run


@pytest.fixture(scope="module")
def reference(served) -> dict[int, list[int]]:
    """single_step without overlap: the ids every overlapped run must give."""
    return served("single_step", {}, None, False)[1].token_ids


@pytest.fixture(scope="module")
def eos_ids(reference) -> dict[int, int]:
    """A forced EOS per request: the token in the middle of its reference output, so it stops
    there (or earlier, where that token first appears) instead of at max_tokens."""
    return {i: ids[len(ids) // 2] for i, ids in reference.items() if i % 4}


def stopped(ids: list[int], eos: int | None) -> list[int]:
    return ids if eos is None or eos not in ids else ids[:ids.index(eos) + 1]


@pytest.mark.parametrize(("policy", "params", "budget"), POLICIES, ids=IDS)
def test_overlap_greedy_ids_equal_single_step(served, reference, eos_ids, policy, params,
                                              budget) -> None:
    requests, res = served(policy, params, budget, True)
    assert res.stats["num_preemptions"] > 0
    assert res.token_ids == reference
    assert all(r.token_times == sorted(r.token_times) for r in requests)
    # EOS stops: found one window late, the ids still stop at the first EOS
    requests = make_requests(eos=eos_ids)
    res = serve(requests, policy, params, budget, overlap=True)
    assert res.token_ids == {i: stopped(ids, eos_ids.get(i)) for i, ids in reference.items()}
    assert res.stats["num_late_stop_steps"] > 0
    assert any(len(ids) < r.max_tokens for r, ids in zip(requests, res.token_ids.values(),
                                                          strict=True))


@pytest.mark.skipif(DEVICE == "cuda", reason="Triton's interpreter runs only where no GPU is; "
                    "on a GPU the CUDA-graph tests run the Triton kernels")
def test_overlap_with_triton_kernels() -> None:
    """The Triton path (interpreted on CPU): advance_step after a token-map gather. Interpreted
    kernels are slow: a short run, on one layer (every layer runs the same kernels)."""
    one_layer = load_spec("tiny", num_layers=1)
    requests = [Request(r.request_id, 0.0, 0, 7, prompt_token_ids=r.prompt_token_ids)
                for r in make_requests()[:3]]
    res = serve(requests, "multi_step", {"num_steps": 3}, None, overlap=True, kernels="triton",
                num_blocks=16, dtype="float32", cuda_graphs=False, spec=one_layer)
    assert res.stats["kernels"] == "triton" and any(row["k"] == 3 for row in res.steps)
    model = random_model(one_layer, "cpu", torch.float32, seed=0)  # the run's weights
    assert res.token_ids == {r.request_id: greedy_dense(model, r.prompt_token_ids, 7)
                             for r in requests}


def test_overlap_needs_async_output() -> None:
    with pytest.raises(ValueError, match="scheduler.overlap needs backend.async_output=true"):
        serve(make_requests(2), "single_step", {}, None, overlap=True, async_output=False)


def test_a_window_formed_with_overlap_needs_the_overlap_launch() -> None:
    """Without the token map a placeholder token cannot be built on the host: a clear error."""
    sched = make_scheduler("single_step", {}, SchedulerConfig(block_size=BLOCK_SIZE, overlap=True),
                           NUM_BLOCKS, SPEC.max_model_len)
    runner = build_runner(SPEC, BackendConfig(device="cpu", num_blocks=NUM_BLOCKS), sched)
    sched.add_request(Request(0, 0.0, 0, 4, prompt_token_ids=[1, 2, 3]))
    runner.launch_window(sched.schedule(0.0), overlap=True)
    with pytest.raises(RuntimeError, match="position 3 is not known yet"):
        runner.launch_window(sched.schedule(0.0))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
@pytest.mark.parametrize(("policy", "params", "budget"),
                         [POLICIES[0], POLICIES[1], POLICIES[3], POLICIES[5]],
                         ids=["single_step", "multi_step4", "chunked_prefill", "cp24"])
def test_sim_and_real_make_the_same_windows(served, policy, params, budget, overlap) -> None:
    """Offline, decisions depend on the scheduler's state alone: both backends must form the
    same windows, one for one (preemptions included)."""
    real = served(policy, params, budget, overlap)[1]
    conf = Path(__file__).resolve().parents[2] / "conf"
    hw = HardwareSpec.from_dict(yaml.safe_load((conf / "hardware" / "h100_sxm.yaml").read_text()))
    cfg = SchedulerConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=budget, overlap=overlap)
    lengths = [Request(r.request_id, 0.0, r.prompt_len, r.max_tokens) for r in make_requests()]
    sim = simulate(lengths, lambda n: make_scheduler(policy, params, cfg, n, SPEC.max_model_len),
                   SPEC, hw, OverheadSpec(), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                   progress=False)
    assert real.stats["num_preemptions"] > 0
    assert ([tuple(row[c] for c in WINDOW_COLUMNS) for row in sim.steps]
            == [tuple(row[c] for c in WINDOW_COLUMNS) for row in real.steps])


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize(("policy", "params", "budget"),
                         [POLICIES[0], POLICIES[1], POLICIES[3], POLICIES[5]],
                         ids=["single_step", "multi_step4", "chunked_prefill", "cp24"])
def test_gpu_overlap_with_graphs_equals_plain(policy, params, budget) -> None:
    """On the GPU, fp32, with decode, prefill and piecewise graphs: the token map's gather
    before each replay keeps the ids of the run without overlap."""
    plain = serve(make_requests(), "single_step", {}, None, overlap=False, device="cuda",
                  dtype="float32")
    res = serve(make_requests(), policy, params, budget, overlap=True, device="cuda",
                dtype="float32")
    assert res.stats["cuda_graph_sizes"] and res.token_ids == plain.token_ids
    assert all(r["gpu_s"] > 0 for r in res.steps)


def test_overlap_late_schedule_with_arrivals_keeps_greedy_ids(reference) -> None:
    """Requests arriving while windows run: the late schedule (the engine sleeping until just
    before the window in flight ends, then forming the next) changes no request's ids."""
    requests = make_requests()
    for i, req in enumerate(requests):
        req.arrival_time = 0.02 * i
    got = serve(requests, "single_step", {}, None,
                overlap=True).token_ids
    assert got == reference


def test_late_schedule_wait_times_the_window_in_flight_step_by_step(monkeypatch) -> None:
    """While the engine waits to form the next window, it keeps pythonizing the window in
    flight, so each of its steps is timed as it ends (not all at the wait's end)."""
    from real_backend.engine import POLL_S, _wait_until

    t = [0.0]
    polls: list[float] = []

    class FakeRunner:
        def poll_window(self, w) -> None:
            polls.append(t[0])

    def clock() -> float:
        t[0] += POLL_S / 10  # each look at the clock: a tenth of a poll interval later
        return t[0]

    sleeps: list[float] = []
    monkeypatch.setattr("real_backend.engine.time.sleep", sleeps.append)
    _wait_until(50 * POLL_S, clock, FakeRunner(), object())
    assert t[0] >= 50 * POLL_S
    # one poll per interval, not one per pass of the busy loop
    assert 40 <= len(polls) <= 60
    assert all(b - a >= POLL_S * 0.99 for a, b in zip(polls, polls[1:]))
    # it waits busy, as a CUDA synchronize does: a sleeping core runs the next launch slower
    assert len(sleeps) > len(polls) and set(sleeps) == {0}
    n = len(polls)
    _wait_until(None, clock, FakeRunner(), object())  # no estimate: no wait
    _wait_until(t[0] - 1.0, clock, FakeRunner(), object())  # already past: no wait
    assert len(polls) == n
