"""GPU step time from operator tables (benchmarks/operators.py's CSVs), for any model shape.

A step is priced as the engine runs it (real_backend/model.py), each kernel's time read off
the tables measured in isolation on the GPU, never fitted to the model it prices:

    t_kernels = embedding(T) + L * [2 add_rms_norm(T) + qkv(T) + rope(T) + kv write(T)
                                    + attention + o_proj(T) + gate_up(T) + silu_mul(T) + down(T)
                                    (+ attn_copy(T) in piecewise steps)]
              + add_rms_norm(T) + lm_head(N_s) + logits_fp32(N_s) + greedy(N_s)
              (+ advance_step(N) on steps 2..k of a window)

(a plain MLP, ``model.mlp: plain``: fc1(T) + ReLU(T) + fc2(T), fc1 half gate_up's rows), with
T the step's tokens padded as cost_model.py pads them (a whole-step CUDA graph's or the
piecewise graphs' size), attention the paged prefill kernel over the prefill chunks' causal
pairs plus the decode kernel over the decoding sequences (its batch and mean context, between
the table's uniform and ragged contexts by the batch's longest one), N_s the sampled rows.
Each op's time is looked up as simulator/op_tables.py reads its table (interpolation, the
fallbacks for a shape the table lacks, decode attention's longest sequence).

Launching comes from the graph table (truncated copies of every model, 1..L layers), as
linear functions of the layer count fitted across its models once the kernels' own time is
taken off: a CUDA-graph step costs t_kernels + g(L) (replay and the gaps between kernels; steps
2..k of a window, whose replay waits in the stream behind the step before, g_queued(L)); a
piecewise step max(t_kernels + g(L), f_launch h_pw(L)) (the CPU replays L + 1 pieces with
eager attention between them); an eager step max(t_kernels + g(L), f_launch h_eager(L)), with
h the host's issue time of that step. Two served-vs-isolated coefficients of the hardware
profile scale every kernel of the tables (``op_kernel_factor``) and, on top, their
compute-bound share (``op_compute_factor``: served steps run at the power-limited clock of a
loaded GPU, the tables' points in short bursts at the full clock); experiments.leave_one_out
fits them across models on served steps.
TP > 1 splits every GEMM's N or K and the heads by ``tp`` and adds cost_model.py's all-reduce
terms; the power-limited clock (``slow``) stretches the compute-bound share of each GEMM and
the prefill attention.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import yaml

from common.model_spec import ModelSpec
from common.parallel import kv_heads_per_rank
from simulator.hardware import HardwareSpec
from simulator.op_tables import (
    CONF_DIR,
    OpTables,
    decode_attention_us,
    gemm_us,
    load_tables,
    prefill_attention_us,
    sampler_us,
    small_us,
)
from simulator.step_shape import StepShape, graph_tokens, piecewise_tokens

_US = 1e-6
# the graph table's steps (benchmarks/op_graph.py): batch-1 decode at this context, and a
# one-prompt piecewise step of this many tokens
GRAPH_DECODE_CONTEXT, GRAPH_PIECE_TOKENS = 128, 32


@dataclass(frozen=True, slots=True)
class Launch:
    """The graph table's launch terms (us) as a + b L: GPU-side replay and gaps of a step
    (``gap``; of a decode graph queued behind the step before, as steps 2..k of a window run:
    ``queued_gap``, None in tables without those rows) and the host's issue time of a
    piecewise, eager decode and eager prefill step."""

    gap: tuple[float, float]
    piecewise_host: tuple[float, float]
    eager_decode_host: tuple[float, float]
    eager_prefill_host: tuple[float, float]
    queued_gap: tuple[float, float] | None = None


@lru_cache(maxsize=8)
def launch_terms(path: str) -> Launch:
    """The launch terms of the tables in ``path`` (fitted once per directory)."""
    return fit_launch(load_tables(path))


# ---------------------------------------------------------------------------- a step
@dataclass(frozen=True, slots=True)
class KernelTimes:
    """One step's kernel time on one GPU (us) and its compute-bound share (us)."""

    total: float
    compute: float


def kernel_times(t: OpTables, model: ModelSpec, shape: StepShape, tokens: int, tp: int,
                 piecewise: bool, slow: float = 1.0) -> KernelTimes:
    """The kernels of one step over ``tokens`` (padded) rows: see the module doc."""
    L, h, d = model.num_layers, model.hidden_size, model.head_dim
    nh, kvh = model.num_heads // tp, kv_heads_per_rank(model, tp)
    inter = model.intermediate_size // tp
    up = (model.mlp_matrices - 1) * inter  # gate_up's rows, or a plain MLP's fc1's
    q_size, kv_size = nh * d, kvh * d
    # the same few sizes step after step (at full clock: a slowed clock varies by the step)
    memo = ("layer_gemms", tokens, h, q_size, kv_size, up, inter) if slow == 1.0 else None
    gemms = t.memo.get(memo) if memo else None
    if gemms is None:
        per_layer = 0.0
        compute = 0.0
        for op, n, k in (("layer", q_size + 2 * kv_size, h), ("layer", h, q_size),
                         ("layer", up, h), ("layer", h, inter)):
            g = gemm_us(t, op, tokens, n, k)
            c = min(2.0 * tokens * n * k / (g * 1e-6 * 989e12), 1.0) * g  # compute-bound share
            per_layer += g + c * (slow - 1.0)
            compute += c * slow
        gemms = (per_layer, compute)
        if memo:
            t.memo[memo] = gemms
    per_layer, compute = gemms
    heads = (nh, kvh, d)
    attn = prefill_attention_us(t, heads, shape.num_prefill_tokens, shape.attn_pairs) * slow
    compute += attn
    decode_seqs = shape.num_tokens - shape.num_prefill_tokens
    if decode_seqs > 0:
        prefill_kv = shape.prefill_kv_tokens or shape.num_prefill_tokens
        # the rows the kernel sees: a whole-step graph's padded batch (every row one token,
        # one-token prefill chunks included), else the decoding rows themselves
        rows = tokens if shape.num_tokens == shape.num_seqs and not piecewise else decode_seqs
        attn += decode_attention_us(t, heads, decode_seqs, shape.kv_tokens - prefill_kv,
                                    shape.max_kv_tokens, rows)
    per_layer += attn
    per_layer += 2 * small_us(t, "add_rms_norm", tokens, (h, 0, 0, 0, 0, 0))
    per_layer += small_us(t, "rotary_embedding", tokens, (0, 0, *heads, 0))
    per_layer += small_us(t, "reshape_and_cache", shape.num_tokens, (0, 0, *heads, 0))
    # a plain MLP's ReLU: priced as silu_and_mul over the same outputs (the tables have no
    # ReLU; both are one elementwise kernel writing tokens x inter)
    per_layer += small_us(t, "silu_and_mul", tokens, (0, inter, 0, 0, 0, 0))
    if piecewise:
        per_layer += small_us(t, "attn_copy", tokens, (0, 0, *heads, 0))
    total = L * per_layer
    compute *= L
    total += small_us(t, "embedding", tokens, (h, 0, 0, 0, 0, model.vocab_size))
    total += small_us(t, "add_rms_norm", tokens, (h, 0, 0, 0, 0, 0))
    n_s = shape.num_sampled
    if n_s:
        V = model.vocab_size // tp
        total += gemm_us(t, "lm_head", n_s, V, h)
        total += sampler_us(t, "logits_fp32", n_s, model.vocab_size)
        total += sampler_us(t, "greedy", n_s, model.vocab_size)
    if not shape.is_first:
        total += sampler_us(t, "advance_step", shape.num_seqs, 0)
    return KernelTimes(total, min(compute, total))


def _line(tables: OpTables, mode: str, column: str, minus_kernels: bool) -> tuple[float, float]:
    rows = tables.graph[tables.graph["mode"] == mode]
    if rows.empty:
        raise ValueError(f"hardware.op_tables: {tables.path}/graph.csv has no {mode} rows")
    L = rows["num_layers"].to_numpy(float)
    y = rows[column].to_numpy(float)
    if minus_kernels:
        y = y - np.array([graph_kernels_us(tables, str(r.model), int(r.num_layers), mode)
                          for r in rows.itertuples()])
    if len(np.unique(L)) < 2:
        return float(np.mean(y)), 0.0
    b, a = np.polyfit(L, y, 1)
    return float(a), float(max(b, 0.0))


@lru_cache(maxsize=64)
def graph_model(name: str, layers: int) -> ModelSpec:
    """conf/model/<name>.yaml truncated to ``layers`` layers, as the graph table ran it."""
    f = CONF_DIR / "model" / f"{name}.yaml"
    try:
        spec = ModelSpec.from_dict(yaml.safe_load(f.read_text()))
    except (OSError, ValueError, TypeError, yaml.YAMLError) as err:
        raise ValueError(f"hardware.op_tables: graph.csv names model {name!r}, which "
                         f"{f} does not give: {err}") from None
    return dataclasses.replace(spec, num_layers=layers)


def graph_kernels_us(tables: OpTables, name: str, layers: int, mode: str) -> float:
    """The kernels of a graph-table step (forward and LM head of the last row, no sampler)."""
    model = graph_model(name, layers)
    if mode.startswith("decode"):
        c = GRAPH_DECODE_CONTEXT
        shape = StepShape(1, 1, 0, 1, 0.0, c, True, c)
        tokens = 1
    else:
        q = GRAPH_PIECE_TOKENS
        shape = StepShape(q, 1, q, 1, q * (q + 1) / 2, q, True, 0, 1, q)
        tokens = q
    k = kernel_times(tables, model, shape, tokens, 1, mode == "piecewise_graph").total
    return k - sampler_us(tables, "greedy", 1, model.vocab_size)


def fit_launch(tables: OpTables) -> Launch:
    """The launch terms, each a least-squares line in the layer count over every model of the
    graph table: the decode graph's time beyond its kernels (gaps and replay), from an idle GPU
    and queued behind a step where the table has those rows, and the host's issue time of
    piecewise and eager steps."""
    queued = (tables.graph["mode"] == "decode_graph_queued").any()
    return Launch(gap=_line(tables, "decode_graph", "time_us", True),
                  piecewise_host=_line(tables, "piecewise_graph", "host_us", False),
                  eager_decode_host=_line(tables, "decode_eager", "host_us", False),
                  eager_prefill_host=_line(tables, "piecewise_eager", "host_us", False),
                  queued_gap=(_line(tables, "decode_graph_queued", "time_us", True)
                              if queued else None))


def _at(line: tuple[float, float], layers: int) -> float:
    return max(line[0] + line[1] * layers, 0.0)


def op_step_cost(shape: StepShape, model: ModelSpec, hw: HardwareSpec,
                 slow: float = 1.0) -> tuple[float, float]:
    """(step seconds, compute-bound seconds) of one step on one GPU of a ``tp``-way group, from
    the tables of ``hw.op_tables`` (see the module doc)."""
    if shape.num_seqs == 0:
        return 0.0, 0.0
    tables = load_tables(hw.op_tables)
    launch = launch_terms(hw.op_tables)
    L, tp = model.num_layers, hw.tp
    padded = graph_tokens(shape, hw)
    pieces = None if padded is not None else piecewise_tokens(shape, hw)
    tokens = padded or pieces or shape.num_tokens
    k = kernel_times(tables, model, shape, tokens, tp, pieces is not None,
                     slow * hw.op_compute_factor)
    queued = not shape.is_first and padded is not None and launch.queued_gap is not None
    t = k.total * hw.op_kernel_factor + _at(launch.queued_gap if queued else launch.gap, L)
    if padded is None:
        if pieces is not None:
            host = _at(launch.piecewise_host, L)
        elif shape.num_prefill_tokens:
            host = _at(launch.eager_prefill_host, L)
        else:
            host = _at(launch.eager_decode_host, L)
        t = max(t, host)
    t *= _US
    if tp > 1:  # cost_model.py's all-reduces and logits gather
        h, V, d = model.hidden_size, model.vocab_size, model.dtype_bytes
        link = hw.link_bytes_per_s * hw.allreduce_efficiency
        lat = hw.allreduce_latency_us * _US
        t += (2 * L + 1) * (lat + 2.0 * (tp - 1) / tp * tokens * h * d / link)
        if shape.num_sampled:
            t += lat + (tp - 1) / tp * shape.num_sampled * V * d / link
    return t, min(k.compute * hw.op_kernel_factor * _US, t)
