"""End to end: every policy's greedy tokens equal the no-cache oracle's, preemptions included."""

from __future__ import annotations

import os
import random

import pytest
import torch
from rb_util import DEVICE, greedy_dense, load_spec

from policies import ModelSpec, Request, SchedulerConfig, make_scheduler
from real_backend import run_real
from real_backend.engine import host_cpu
from real_backend.weights import random_model

SPEC = load_spec("tiny")
ONE_LAYER = load_spec("tiny", num_layers=1)  # the Triton interpreter's runs: half the kernels
BLOCK_SIZE = 4
NUM_BLOCKS = 24  # 96 token slots for 16 requests of up to 64 tokens: every policy preempts

# multi_step 4 and 8: windows that cross one block boundary and two (k = 2 crosses no more
# than k = 4 does)
POLICIES = [
    ("single_step", {}, None),
    ("multi_step", {"num_steps": 4}, None),
    ("multi_step", {"num_steps": 8}, None),
    ("chunked_prefill", {}, 16),  # 16-token budget: prompts of up to 40 tokens get chunked
    ("cp1", {"num_steps": 4}, 16),
    ("cp2", {"num_steps": 4}, 16),
    ("cp_promote", {"num_steps": 4}, 64),
    ("adaptive", {"num_steps": 8}, None),
]


def make_requests(n: int = 16, seed: int = 1, arrival_gap: float = 0.0) -> list[Request]:
    r = random.Random(seed)
    return [Request(i, i * arrival_gap, 0, r.randint(4, 24),
                    prompt_token_ids=[r.randrange(SPEC.vocab_size) for _ in range(r.randint(1, 40))])
            for i in range(n)]


def _oracle(device: str, requests: list[Request] | None = None,
            spec: ModelSpec = SPEC) -> dict[int, list[int]]:
    # The same seed draws different weights on each device's generator.
    model = random_model(spec, device, torch.float32, seed=0)
    return {r.request_id: greedy_dense(model, r.prompt_token_ids, r.max_tokens)
            for r in requests or make_requests()}


@pytest.fixture(scope="module")
def oracle() -> dict[int, list[int]]:
    return _oracle("cpu")


@pytest.fixture(scope="module")
def device_oracle(oracle) -> dict[int, list[int]]:
    return oracle if DEVICE == "cpu" else _oracle(DEVICE)


def serve(requests, policy, params, budget, spec: ModelSpec = SPEC, **backend):
    cfg = SchedulerConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=budget)
    backend = {"device": "cpu", "num_blocks": NUM_BLOCKS, "save_token_ids": True, **backend}
    return run_real(requests, lambda n: make_scheduler(policy, params, cfg, n, spec.max_model_len),
                    spec, backend, progress=False)


@pytest.mark.parametrize(("policy", "params", "budget"), POLICIES,
                         ids=[f"{p}{v.get('num_steps', '')}" for p, v, _ in POLICIES])
def test_greedy_tokens_equal_oracle(oracle, policy, params, budget) -> None:
    requests = make_requests()
    res = serve(requests, policy, params, budget)
    assert res.stats["num_preemptions"] > 0
    assert res.token_ids == oracle
    assert all(len(r.token_times) == r.max_tokens for r in requests)
    assert all(r.token_times == sorted(r.token_times) for r in requests)
    assert max(r.finish_time for r in requests) <= res.duration
    ks = {row["k"] for row in res.steps}
    assert max(ks) == params.get("num_steps", 1) or policy == "adaptive"
    if policy in ("cp2", "cp_promote"):  # prefills inside k-step windows really happened
        assert any(row["k"] == 4 and row["num_prefill_seqs"] for row in res.steps)


@pytest.mark.slow
@pytest.mark.parametrize(("policy", "params", "budget"),
                         [("cp2", {"num_steps": 4}, 16), ("multi_step", {"num_steps": 4}, None)])
def test_triton_kernels_in_engine(policy, params, budget) -> None:
    """The Triton path (interpreted on CPU) through prefill chunks, gathers, advance_step and a
    preemption: four requests of up to 8 output tokens in 16 blocks, on one layer (the
    interpreter is slow; every layer runs the same kernels on its own cache tensors, and which
    layer's cache is picked on the torch side, checked by the two-layer runs above)."""
    requests = [Request(r.request_id, 0.0, 0, min(r.max_tokens, 8),
                        prompt_token_ids=r.prompt_token_ids) for r in make_requests()[:4]]
    res = serve(requests, policy, params, budget, spec=ONE_LAYER, kernels="triton",
                num_blocks=16, device=DEVICE, dtype="float32", cuda_graphs=False)
    assert res.stats["kernels"] == "triton" and res.stats["num_preemptions"] > 0
    assert any(row["k"] == 4 for row in res.steps)
    assert res.stats["host_cpu"] == host_cpu()  # the host the CPU costs were measured on
    assert res.token_ids == _oracle(DEVICE, requests, ONE_LAYER)


def test_blocking_output_and_online_arrivals(oracle) -> None:
    requests = make_requests(arrival_gap=0.01)
    res = serve(requests, "multi_step", {"num_steps": 4}, None, async_output=False)
    assert res.token_ids == oracle
    for r in requests:
        assert r.first_scheduled_time >= r.arrival_time
        assert r.token_times[0] > r.arrival_time
    assert res.duration >= requests[-1].arrival_time


def test_a_run_leaves_the_process_s_own_freezing_alone() -> None:
    """A run freezes what exists at its start and unfreezes it at its end only where nothing
    was frozen before it: a process that froze objects of its own (an embedding program, this
    test's worker) keeps them frozen, and one that froze nothing is left with nothing."""
    import gc

    # (without the worker's own freezing after each full collection: tests/conftest.py)
    own = [c for c in gc.callbacks if getattr(c, "__name__", "") == "_freeze_after_a_full_collection"]
    for c in own:
        gc.callbacks.remove(c)
    try:
        gc.freeze()
        before = gc.get_freeze_count()
        serve(make_requests(4), "single_step", {}, None)
        assert gc.get_freeze_count() > before // 2 > 0  # (some frozen objects freed since)
        gc.unfreeze()
        serve(make_requests(4), "single_step", {}, None)
        assert gc.get_freeze_count() == 0
    finally:
        gc.callbacks.extend(own)
        gc.freeze()


def test_length_only_requests_get_seeded_prompts() -> None:
    """Length-only requests get prompt ids drawn from backend.seed: one per prompt token, in the
    vocabulary, the same for the same seed and different for another; a request that came with
    its ids keeps them; and the engine serves the prompts it filled in (greedy ids equal the
    no-cache oracle's on them)."""
    given = [3, 1, 4, 1, 5, 9, 2]

    def run(seed: int) -> tuple[list[Request], dict[int, list[int]]]:
        requests = [Request(i, 0.0, 5 + i, 6) for i in range(4)]
        requests.append(Request(4, 0.0, len(given), 6, prompt_token_ids=list(given)))
        return requests, serve(requests, "single_step", {}, None, seed=seed).token_ids

    requests, ids = run(0)
    again, ids_again = run(0)
    other, _ = run(1)
    prompts = [r.prompt_token_ids for r in requests]
    assert [len(p) for p in prompts] == [5, 6, 7, 8, len(given)]
    assert all(0 <= t < SPEC.vocab_size for p in prompts for t in p)
    assert prompts[4] == given and other[4].prompt_token_ids == given
    assert prompts == [r.prompt_token_ids for r in again] and ids == ids_again
    assert all(a != b.prompt_token_ids for a, b in zip(prompts[:4], other[:4], strict=True))
    model = random_model(SPEC, "cpu", torch.float32, seed=0)
    assert ids == {r.request_id: greedy_dense(model, r.prompt_token_ids, r.max_tokens)
                   for r in requests}


def test_steps_rows_and_stats() -> None:
    res = serve(make_requests(6), "cp2", {"num_steps": 4}, 16)
    row = res.steps[0]
    for key in ("window", "k", "num_seqs", "num_tokens", "schedule_s", "prepare_s",
                "pythonize_s", "update_s", "gpu_s", "gpu_step_s"):
        assert key in row
    assert all(len(r["gpu_step_s"].split(";")) == r["k"] for r in res.steps)
    assert res.stats["num_blocks"] == NUM_BLOCKS and res.stats["block_size"] == BLOCK_SIZE
    assert res.stats["device"] == "cpu" and res.stats["dtype"] == "float32"
    assert res.stats["cuda_graph_sizes"] == []


def test_kept_runner_serves_the_next_run_alike(device_oracle) -> None:
    """backend.keep_runner: a second run of the same shape reuses the first's runner and gives
    the same ids (sampling reseeded, temperature sampling included); a run of another shape, or
    one without the setting, builds its own. Served on the test device (its graphs on a GPU),
    so greedy ids match that device's oracle."""
    from real_backend import engine

    def run(policy="cp2", params=None, **backend):  # six requests: the runner's shape is the same
        return serve(make_requests(6), policy, params or {"num_steps": 4}, 16, keep_runner=True,
                     sampling={"temperature": 0.8, "top_k": 20}, device=DEVICE, **backend)

    first, second = run(), run()
    assert not first.stats["runner_kept"] and second.stats["runner_kept"]
    assert first.token_ids == second.token_ids
    assert len(engine._KEPT) == 1
    assert run(params={"num_steps": 8}).stats["runner_kept"]  # any k <= 16: one shape
    assert not run(params={"num_steps": 20}).stats["runner_kept"]  # longer lookahead: rebuilt
    assert not serve(make_requests(2), "single_step", {}, None,
                     device=DEVICE).stats["runner_kept"]
    assert not engine._KEPT  # a run without the setting drops what was kept
    greedy = serve(make_requests(6), "cp2", {"num_steps": 4}, 16, keep_runner=True,
                   device=DEVICE, dtype="float32")
    assert serve(make_requests(6), "cp2", {"num_steps": 4}, 16, keep_runner=True, device=DEVICE,
                 dtype="float32").token_ids == greedy.token_ids == {
        i: device_oracle[i] for i in range(6)}
    engine._KEPT.clear()


@pytest.mark.parametrize(("setting", "message"), [
    ({"colour": 1}, "backend has no setting 'colour'"),
    ({"cpu_kv_cache_gib": 0}, "backend.cpu_kv_cache_gib must be > 0"),
    ({"gpu_memory_utilization": 1.5}, "backend.gpu_memory_utilization must be in"),
    ({"sampling": {"top_p": 0.0}}, "backend.sampling.top_p must be in"),
    ({"sampling": {"temp": 1.0}}, "backend.sampling has no setting 'temp'"),
    ({"dtype": "int8"}, "backend.dtype must be auto or one of"),
    ({"kernels": "cuda"}, "backend.kernels must be auto, torch or triton"),
    ({"prefill_graph_max_tokens": 1024}, r"backend.prefill_graph_max_tokens must be in \[0, 512\]"),
    ({"piecewise_graph_max_tokens": 4096},
     r"backend.piecewise_graph_max_tokens must be in \[0, 2048\]"),
])
def test_bad_settings_are_one_line_errors(setting, message) -> None:
    with pytest.raises(ValueError, match=message):
        serve(make_requests(2), "single_step", {}, None, **setting)


def test_request_that_never_fits_is_refused() -> None:
    with pytest.raises(ValueError, match="KV blocks but the cache has"):
        serve([Request(0, 0.0, 0, 200, prompt_token_ids=[1] * 10)], "single_step", {}, None)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs and memory profiling need a GPU")
@pytest.mark.parametrize(("policy", "params", "budget", "graphs"),
                         [("cp2", {"num_steps": 4}, 16, True), ("cp2", {"num_steps": 4}, 16, False),
                          ("multi_step", {"num_steps": 4}, None, True),
                          ("chunked_prefill", {}, 16, True)])
def test_gpu_fp32_graphs_equal_oracle(device_oracle, policy, params, budget, graphs: bool) -> None:
    """Decode graphs (every policy), prefill graphs (prefill-only windows) and piecewise graphs
    (mixed prefill + decode steps, padded to a captured token count) keep the ids."""
    res = serve(make_requests(), policy, params, budget, device="cuda", dtype="float32",
                cuda_graphs=graphs)
    assert res.token_ids == device_oracle
    assert bool(res.stats["cuda_graph_sizes"]) == graphs
    assert bool(res.stats["prefill_graphs"]) == graphs
    if policy == "multi_step":  # its prefill-only windows replay graphs
        assert (res.stats["prefill_graph_replays"] > 0) == graphs
    if policy in ("cp2", "chunked_prefill"):  # mixed steps replay piecewise graphs
        assert (res.stats["piecewise_graph_replays"] > 0) == graphs
    assert all(r["gpu_s"] > 0 for r in res.steps)


@pytest.mark.skipif(DEVICE != "cuda", reason="memory profiling needs a GPU")
def test_gpu_profiled_cache_and_bf16_multi_step() -> None:
    requests = make_requests()
    # A small share: the tiny model's 1 KB blocks would otherwise number in the tens of millions.
    res = serve(requests, "multi_step", {"num_steps": 8}, None, device="cuda", num_blocks=None,
                gpu_memory_utilization=0.05)
    assert res.stats["num_blocks"] > 1000 and res.stats["dtype"] == "bfloat16"
    assert all(len(r.output_token_ids) == r.max_tokens for r in requests)


def test_host_cpu_names_the_cpu_and_the_cores_the_process_may_use(monkeypatch) -> None:
    """A run names its host CPU: the model and the cores it may run on (an affinity mask or a
    cgroup's cpuset, not the machine's count), as its CPU costs follow them."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5}, raising=False)
    name = host_cpu()
    assert name.endswith(" (3 cores)") and len(name) > len(" (3 cores)")
