"""The graph table of benchmarks/operators.py: what launching a whole step costs, as CUDA-graph
replays and as eager launches, against the layer count (truncated copies of each model)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from op_kernels import BLOCK_SIZE, release
from op_timing import Bench

from common.model_spec import ModelSpec

if TYPE_CHECKING:
    from op_grid import Grid

GRAPH_WEIGHT_BYTES = 60 * 2**30  # truncated models in the graph table stay below this


def graph_layers(spec: ModelSpec, grid: Grid) -> list[int]:
    """The grid's layer counts within the model, and the whole model where its weights fit."""
    counts = [n for n in grid.graph_layers if n <= spec.num_layers]
    if (spec.num_layers not in counts
            and graph_model_spec(spec, spec.num_layers).weight_bytes <= GRAPH_WEIGHT_BYTES):
        counts.append(spec.num_layers)
    return [n for n in counts if graph_model_spec(spec, n).weight_bytes <= GRAPH_WEIGHT_BYTES]


def graph_model_spec(spec: ModelSpec, layers: int) -> ModelSpec:
    return dataclasses.replace(spec, num_layers=layers)


def graph_table(bench: Bench, specs: list[ModelSpec], grid: Grid) -> tuple[list, list]:
    """Per model and layer count: the engine's batch-1 decode step (its CUDA graph replayed,
    and the same step launched eagerly) and a piecewise step (its L + 1 graphs replayed with
    eager attention between them, and the same step eagerly), from an idle GPU; and the decode
    graph replayed back to back (``decode_graph_queued``: its time when issued while the step
    before runs, as steps 2..k of a multi-step window are). ``device_ops``:
    the kernels (and memsets) one step issues, counted with the profiler (cuda)."""
    from real_backend.weights import random_model

    rows, spans = [], []
    for spec in specs:
        layers = graph_layers(spec, grid)
        if not layers:
            continue
        full = random_model(graph_model_spec(spec, max(layers)), bench.device, bench.dtype)
        ops: dict[str, dict[int, float]] = {}
        for n in layers:
            model = dataclasses.replace(full, spec=graph_model_spec(spec, n),
                                        layers=full.layers[:n])
            steps = _graph_steps(bench, model, grid)
            if "decode_graph" in steps:  # steps 2..k: the replay queued behind a step
                steps["decode_graph_queued"] = steps["decode_graph"]
            for mode, fn in steps.items():
                if mode == "decode_graph_queued":  # the same replay call: its host time too
                    dev_us, span = bench.queued_time(fn)
                    host_us = next(r["host_us"] for r in reversed(rows)
                                   if r["mode"] == "decode_graph" and r["num_layers"] == n)
                else:
                    dev_us, host_us, span = bench.span_time(fn)
                if bench.cuda and mode.endswith("eager") and len(ops.get(mode, {})) < 2:
                    ops.setdefault(mode, {})[n] = _count_device_ops(fn)
                rows.append({"model": spec.name, "num_layers": n, "mode": mode,
                             "tokens": 1 if mode.startswith("decode") else grid.piece_tokens,
                             "context": grid.graph_context if mode.startswith("decode")
                             else grid.piece_tokens,
                             "time_us": dev_us, "host_us": host_us})
                spans.append(span)
            del steps, model
            release(bench)
        for row in rows:  # kernels per step: linear in the layer count (two counts profiled)
            if row["model"] == spec.name:
                eager = row["mode"].removesuffix("_queued").replace("graph", "eager")
                row["device_ops"] = _ops_at(ops.get(eager, {}),
                                            row["num_layers"])
        del full
        release(bench)
    return rows, spans


def _graph_steps(bench: Bench, model: Any, grid: Grid) -> dict[str, Callable[[], object]]:
    from real_backend.attention import AttentionMetadata, PrefillMetadata
    from real_backend.config import BackendConfig
    from real_backend.model import compute_logits, forward, forward_piecewise
    from real_backend.runner import ModelRunner

    cfg = BackendConfig(device=str(bench.device), cuda_graphs=bench.cuda,
                        prefill_graph_max_tokens=0,
                        piecewise_graph_max_tokens=grid.piece_tokens if bench.cuda else 0)
    runner = ModelRunner(model, cfg, BLOCK_SIZE, 1, 16)
    ctx, t = grid.graph_context, grid.piece_tokens
    blocks = -(-max(ctx, t) // BLOCK_SIZE)
    runner.allocate_kv_cache(4 * blocks + 1)
    runner.capture_graphs()  # cuda: the batch-1 decode graph, piecewise graphs at t tokens
    dev = bench.device
    table = torch.randperm(4 * blocks + 1)[:blocks].to(torch.int32)
    b = runner.buffers
    b.num_rows = b.padded_rows = 1
    b.seq_lens[0] = ctx
    b.block_tables[0, :blocks] = table.to(dev)
    b.input_ids[0] = 1
    b.positions[0] = ctx - 1
    b.slot_mapping[0] = int(table[(ctx - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (ctx - 1) % BLOCK_SIZE
    pos = torch.arange(t)
    ids = torch.randint(0, model.spec.vocab_size, (t,)).to(dev)
    slots = (table[pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE).to(dev)
    meta = AttentionMetadata(slots, t, PrefillMetadata(
        torch.tensor([0, t], dtype=torch.int32, device=dev),
        torch.tensor([t], dtype=torch.int32, device=dev), table[None].to(dev), t), None)
    pos = pos.to(dev)
    kv, kernels = runner.kv_cache, runner.kernels
    steps: dict[str, Callable[[], object]] = {
        "decode_eager": lambda: runner._decode_eager(1),
        "piecewise_eager": lambda: compute_logits(
            model, forward(model, ids, pos, meta, kv, kernels)[-1:]),
    }
    if bench.cuda:
        pb = runner.piece_buffers
        pb.input_ids[:t].copy_(ids)
        pb.positions[:t].copy_(pos)
        steps["decode_graph"] = lambda: runner._decode(1)
        steps["piecewise_graph"] = lambda: compute_logits(model, forward_piecewise(
            model, pb, t, meta, kv, kernels, lambda i: runner.piecewise.replay(t, i))[-1:])
    return steps


def _count_device_ops(fn: Callable[[], object]) -> float:
    """Kernels and memsets one call issues (torch.profiler); NaN where it cannot count."""
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return float(sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA))
    except Exception as err:  # a profiler that cannot start must not cost the table
        print(f"  (kernel count unavailable: {type(err).__name__}: {err})", flush=True)
        return math.nan


def _ops_at(counts: dict[int, float], layers: int) -> float:
    if len(counts) < 2:
        return counts.get(layers, math.nan)
    (a, ca), (b, cb) = sorted(counts.items())[:2]
    return ca + (cb - ca) / (b - a) * (layers - a)
