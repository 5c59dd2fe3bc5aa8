"""Building a runner for a run: its weights, a KV cache sized by memory profiling (or
backend.num_blocks, checked against the device), CUDA graphs and the warm-up; on one rank or
each tensor-parallel rank's share."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter
from typing import TYPE_CHECKING

import torch

from common.model_spec import ModelSpec
from policies.scheduler import Scheduler
from real_backend.config import BackendConfig
from real_backend.kv_cache import GB, block_bytes, check_weights_fit, profile_num_blocks
from real_backend.runner import ModelRunner
from real_backend.speculative import build_speculator
from real_backend.weights import load_hf_model, random_model

if TYPE_CHECKING:
    from real_backend.tp_group import TPGroup


@dataclass(frozen=True, slots=True)
class RunnerShape:
    """The scheduler limits a runner's cache, buffers, profile and graphs are sized for."""

    block_size: int
    max_num_seqs: int
    max_lookahead: int
    max_num_batched_tokens: int


def build_runner(spec: ModelSpec, cfg: BackendConfig, probe: Scheduler,
                 clock: Callable[[], float] = perf_counter) -> ModelRunner:
    """Weights, then a KV cache sized by memory profiling (or backend.num_blocks), then CUDA
    graphs; ``probe`` is a scheduler whose limits (block size, seats, token budget, k) the
    cache, the profile and the graphs must serve."""
    return build_rank_runner(spec, cfg, runner_shape(probe), clock=clock)


def runner_shape(probe: Scheduler) -> RunnerShape:
    # Room for a window's lookahead slots in the block-table buffers: at least 16 steps, so
    # that runners of every k up to 16 have one shape (and can be kept between their runs).
    return RunnerShape(probe.config.block_size, probe.config.max_num_seqs,
                       max(probe.policy.max_steps, 16), probe.max_num_batched_tokens)


def build_rank_runner(spec: ModelSpec, cfg: BackendConfig, shape: RunnerShape,
                      tp: TPGroup | None = None,
                      clock: Callable[[], float] = perf_counter) -> ModelRunner:
    """``build_runner`` for the scheduler limits ``shape``; with ``tp``, this rank's share
    (every rank builds at once: the ranks agree on setup errors and on the KV blocks)."""
    spec.require_gated_mlp("the real engine")
    device, dtype = cfg.torch_device, cfg.torch_dtype
    if device.type == "cuda":
        torch.cuda.set_device(device)
    local = tp.local_spec(spec) if tp else spec
    model, error = None, None
    try:
        check_weights_fit(local, device, dtype, cfg.gpu_memory_utilization)
        if cfg.weights:
            model = load_hf_model(spec, cfg.weights, device, dtype, tp)
        else:
            model = random_model(spec, device, dtype, cfg.seed, tp)
    except ValueError as err:
        if tp is None:
            raise
        error = str(err)
    if tp is not None:
        tp.agree(error)
    runner = ModelRunner(model, cfg, shape.block_size, shape.max_num_seqs, shape.max_lookahead,
                         clock)
    draft_bytes = 0
    if cfg.spec is not None:
        if tp is not None:
            raise ValueError("backend.spec: speculative decoding runs on one rank "
                             "(parallel.tensor_parallel_size 1)")
        k1 = cfg.spec.num_tokens + 1  # a window's slots reach num_steps * (k + 1) ahead
        width = -(-(spec.max_model_len + shape.max_lookahead * k1) // shape.block_size)
        runner.spec = build_speculator(cfg.spec, model, runner.kernels, shape.block_size,
                                       shape.max_num_seqs, shape.max_num_batched_tokens, width,
                                       cfg.seed, cfg.use_cuda_graphs and device.type == "cuda")
        if runner.spec.draft is not None:
            draft_bytes = block_bytes(runner.spec.draft.spec, shape.block_size, dtype)
    num_blocks = cfg.num_blocks
    if device.type == "cuda":
        # Also the warm-up: every Triton kernel is compiled before the clock starts.
        fits, error = 0, None
        graphed = cfg.use_cuda_graphs  # the graphs' pool keeps their largest step's memory
        try:
            fits = profile_num_blocks(
                local, device, dtype, cfg.gpu_memory_utilization, shape.block_size,
                lambda: runner.profile_run(shape.max_num_batched_tokens, shape.max_num_seqs),
                draft_bytes,
                (lambda: runner.profile_graph_steps(shape.max_num_seqs)) if graphed else None)
        except ValueError as err:
            if tp is None:
                raise
            error = str(err)
        if tp is not None:  # every rank holds every block (for its heads): the least that fit
            tp.agree(error)
            fits = tp.min_int(fits)
        if num_blocks is not None and num_blocks > fits:
            need = num_blocks * block_bytes(local, shape.block_size, dtype) / GB
            raise ValueError(f"backend.num_blocks {num_blocks} needs {need:.1f} GB of KV cache but "
                             f"only {fits} blocks fit in gpu_memory_utilization "
                             f"{cfg.gpu_memory_utilization} on {device}")
        num_blocks = num_blocks or fits
    if num_blocks is None:  # cpu: a fixed budget, as vLLM's CPU backend does
        num_blocks = max(1, int(cfg.cpu_kv_cache_gib * 2**30
                                // (block_bytes(local, shape.block_size, dtype) + draft_bytes)))
    elif device.type == "cpu":  # refused before the allocation would take the host's memory
        need = num_blocks * block_bytes(local, shape.block_size, dtype)
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if need > 0.8 * host:
            raise ValueError(f"backend.num_blocks {num_blocks} needs {need / GB:.1f} GB of KV "
                             f"cache but the host has {host / GB:.1f} GB of memory")
    runner.allocate_kv_cache(num_blocks)
    runner.capture_graphs()
    if device.type == "cuda":
        runner.warm_up(shape.max_num_batched_tokens, shape.max_num_seqs)
    runner.generator.manual_seed(cfg.seed)  # sampling starts from the seed, warm-up or not
    return runner
