"""A run on vLLM's engine: the workload's requests sent as the benchmark client sends them
(common/client.py) to vLLM's engine core in this process under VllmPolicyScheduler, each step's
new tokens timed as the step returns, and steps.csv's rows (one window record per step) from the
scheduler's per-step log."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.checks import check_bool, check_int, check_number, check_settings
from common.client import PROGRESS_BAR_FORMAT, Client
from common.model_spec import ModelSpec
from common.window_record import WINDOW_COLUMNS, window_record
from policies.request import Request, RequestState
from vllm_backend import require_vllm
from vllm_backend.model_dir import write_model_dir

# conf/backend/vllm.yaml's settings
SETTINGS = ("device", "kv_cache_gib", "weights", "enforce_eager", "seed", "save_token_ids")
# vLLM's attention kernels on the CPU take these head sizes only (its CPU_ATTN backend)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# steps.csv's timings of a vLLM step: the engine's whole step (schedule, forward, sample, update)
STEP_TIMINGS = ("step_s",)


@dataclass(slots=True)
class VllmResult:
    """A run on vLLM: its duration (to the last token), the scheduler's counters (with the KV
    cache's blocks), steps.csv's rows (one window record per engine step)."""

    duration: float
    stats: dict[str, Any]
    steps: list[dict[str, Any]]
    num_blocks: int


def check_vllm_settings(settings: Mapping[str, Any], model: ModelSpec | None = None) -> None:
    """conf/backend/vllm.yaml's settings, and a model vLLM's CPU attention cannot run: each a
    one-line error naming the setting."""
    check_settings("backend", {"name": "vllm", **settings}, ("name", *SETTINGS))
    device = settings.get("device", "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"backend.device must be cpu or cuda, got {device!r}")
    check_number("backend.kv_cache_gib", settings.get("kv_cache_gib", 1.0), positive=True)
    check_bool("backend.enforce_eager", settings.get("enforce_eager", True))
    check_bool("backend.save_token_ids", settings.get("save_token_ids", False))
    check_int("backend.seed", settings.get("seed", 0), 0)
    weights = settings.get("weights")
    if weights is not None and not (Path(str(weights)) / "config.json").is_file():
        raise ValueError(f"backend.weights {weights}: no config.json there (a local Hugging "
                         "Face checkpoint directory; null: dummy weights of the model's shape)")
    if model is not None and device == "cpu" and model.head_dim not in CPU_HEAD_SIZES:
        raise ValueError(f"model {model.name} has head_dim {model.head_dim}, which vLLM's CPU "
                         f"attention does not run (it runs {', '.join(map(str, CPU_HEAD_SIZES))}"
                         "); conf/model/tiny has 32-wide heads")


def build_engine(model: ModelSpec, settings: Mapping[str, Any], schedlab: Mapping[str, Any]
                 ) -> Any:
    """vLLM's engine (``vllm.LLM``) over the model (dummy weights of its shape, or
    ``backend.weights``), its engine core in this process, under VllmPolicyScheduler with
    ``schedlab`` (additional_config's section; its ``scheduler`` sets vLLM's limits too)."""
    require_vllm()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    limits = schedlab["scheduler"]
    weights = settings.get("weights")
    path = weights or write_model_dir(model, tempfile.mkdtemp(prefix="schedlab-vllm-"))
    # vLLM's token budget caps every step's; the policy's (window_budget) may ask up to the
    # model's length (sarathi), so vLLM's is the larger of the two
    budget = max(limits.get("max_num_batched_tokens") or 2048, model.max_model_len)
    return LLM(model=str(path), load_format="auto" if weights else "dummy",
               skip_tokenizer_init=True, enforce_eager=bool(settings.get("enforce_eager", True)),
               kv_cache_memory_bytes=int(float(settings.get("kv_cache_gib", 1.0)) * (1 << 30)),
               block_size=limits["block_size"], max_num_seqs=limits["max_num_seqs"],
               max_num_batched_tokens=budget, max_model_len=model.max_model_len,
               enable_chunked_prefill=True,
               enable_prefix_caching=bool(limits["enable_prefix_caching"]),
               scheduling_policy="priority", seed=int(settings.get("seed", 0)),
               scheduler_cls="vllm_backend.scheduler.VllmPolicyScheduler",
               additional_config={"schedlab": dict(schedlab)})


def scheduler_of(llm: Any) -> Any:
    """The VllmPolicyScheduler of an engine whose core runs in this process."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def run_vllm(requests: Sequence[Request], model: ModelSpec, settings: Mapping[str, Any],
             schedlab: Mapping[str, Any], *, max_concurrency: int | None = None,
             progress: bool = True) -> VllmResult:
    """Build the engine and serve ``requests`` on it (``serve``)."""
    llm = build_engine(model, settings, schedlab)
    try:
        return serve(llm, requests, max_concurrency=max_concurrency, progress=progress)
    finally:
        del llm


def serve(llm: Any, requests: Sequence[Request], *, max_concurrency: int | None = None,
          progress: bool = True) -> VllmResult:
    """Serve ``requests`` on ``llm`` (build_engine's): each sent at its arrival time (or when a
    concurrency slot frees, as common.client says), each step's new tokens delivered as the
    step returns, until all have finished. Times are seconds from the run's start, on the
    scheduler's clock (its policy's ``now``)."""
    from tqdm import tqdm
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    sched = scheduler_of(llm)
    sched.configure(dict(llm.llm_engine.vllm_config.additional_config["schedlab"]))
    clock = sched.now
    client = Client(requests, max_concurrency)
    by_id = {str(r.request_id): r for r in requests}
    rows: list[dict[str, Any]] = []
    bar = tqdm(total=len(requests), desc="vllm", disable=not progress,
               bar_format=PROGRESS_BAR_FORMAT)
    while client.num_unsent or engine.has_unfinished_requests():
        for req in client.send_due(clock()):
            params = SamplingParams(
                max_tokens=req.max_tokens, ignore_eos=req.eos_token_id is None,
                temperature=0.0, detokenize=False, output_kind=RequestOutputKind.DELTA,
                extra_args={"schedlab": {"request_id": req.request_id,
                                         "slo_class": req.slo_class,
                                         "ttft_slo_ms": req.ttft_slo_ms,
                                         "tpot_slo_ms": req.tpot_slo_ms}})
            engine.add_request(str(req.request_id), {"prompt_token_ids": req.prompt_token_ids},
                               params, priority=req.priority)
        if not engine.has_unfinished_requests():  # nothing to run until the next send
            t = client.next_send_time()
            if t is None:
                raise RuntimeError("vLLM has no request to run and the client none to send")
            time.sleep(max(0.0, t - clock()))
            continue
        start = clock()
        outputs = engine.step()
        end = clock()
        finished = _deliver(outputs, by_id, sched, end)
        if sched.step_log and sched.step_log[-1].step == len(rows):
            rows.append(_step_row(sched.step_log[-1], start, end))
        if finished:
            client.finished(finished, [r.finish_time for r in finished])
            bar.update(len(finished))
    bar.close()
    duration = max((r.finish_time for r in requests if r.finish_time is not None), default=0.0)
    n = sched.num_steps
    stats = {"num_invocations": n, "num_windows": n, "num_steps": n,
             "num_preemptions": sched.num_preemptions, "num_wasted_steps": 0,
             "device_name": f"vLLM {_vllm_version()} ({sched.vllm_config.device_config.device})"}
    num_blocks = int(sched.vllm_config.cache_config.num_gpu_blocks)
    return VllmResult(duration, {**stats, "num_blocks": num_blocks}, rows, num_blocks)


def _deliver(outputs: list[Any], by_id: dict[str, Request], sched: Any,
             now: float) -> list[Request]:
    """A step's new tokens onto their requests, delivered ``now``; the finished ones, with
    their scheduling record (first scheduled, longest wait, preemptions) from the scheduler."""
    finished = []
    for out in outputs:
        req = by_id[out.request_id]
        new = list(out.outputs[0].token_ids) if out.outputs else []
        req.output_token_ids.extend(new)
        req.token_times.extend([now] * len(new))
        req.num_output_tokens += len(new)
        if out.finished:
            mirror = sched.mirror(req.request_id)
            req.first_scheduled_time = mirror.first_scheduled_time
            req.max_wait = mirror.max_wait
            req.num_preemptions = mirror.num_preemptions
            req.num_cached_prompt_tokens = out.num_cached_tokens or 0
            req.state = RequestState.FINISHED
            req.finish_time = now
            finished.append(req)
    return finished


def _step_row(log: Any, start: float, end: float) -> dict[str, Any]:
    """steps.csv's row of one engine step: the window record (a window of one step), then its
    time."""
    record = window_record(log.step + 1, start, 1, len(log.tokens), log.num_prefill_seqs,
                           sum(log.tokens.values()), log.kv_tokens, len(log.preempted), 0)
    return {**dict(zip(WINDOW_COLUMNS, record, strict=True)), "step_s": end - start}


def _vllm_version() -> str:
    import vllm

    return vllm.__version__
