"""GPU step time from operator tables (benchmarks/operators.py's CSVs), for any model shape.

A step is priced as the engine runs it (real_backend/model.py), each kernel's time read off
the tables measured in isolation on the GPU, never fitted to the model it prices:

    t_kernels = embedding(T) + L * [2 add_rms_norm(T) + qkv(T) + rope(T) + kv write(T)
                                    + attention + o_proj(T) + gate_up(T) + silu_mul(T) + down(T)
                                    (+ attn_copy(T) in piecewise steps)]
              + add_rms_norm(T) + lm_head(N_s) + logits_fp32(N_s) + greedy(N_s)
              (+ advance_step(N) on steps 2..k of a window)

with T the step's tokens padded as cost_model.py pads them (a whole-step CUDA graph's or the
piecewise graphs' size), attention the paged prefill kernel over the prefill chunks' causal
pairs plus the decode kernel over the decoding sequences (its batch and mean context, between
the table's uniform and ragged contexts by the batch's longest one), N_s the sampled rows.
Every table is read by log-log interpolation along its grid (linear in the size past its
largest point, flat below its smallest); a shape the table lacks takes its nearest shape's
time scaled by the roofline (GEMMs: FLOPs or bytes) or by the bytes moved (other kernels).

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
import json
import math
from bisect import bisect_right
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from experiments.paths import conf_dir
from policies.model_spec import ModelSpec
from policies.parallel import kv_heads_per_rank
from policies.step_sizes import decode_splits
from simulator.cost_model import StepShape, graph_tokens, piecewise_tokens
from simulator.hardware import HardwareSpec

_US = 1e-6
CONF_DIR = conf_dir()  # one home: experiments/paths.py
TABLES = ("gemm", "attention_prefill", "attention_decode", "per_layer_small", "sampler", "graph")
GRAPH_MODES = ("decode_graph", "piecewise_graph", "decode_eager", "piecewise_eager")
# the graph table's steps (benchmarks/op_graph.py): batch-1 decode at this context, and a
# one-prompt piecewise step of this many tokens
GRAPH_DECODE_CONTEXT, GRAPH_PIECE_TOKENS = 128, 32


class Curve:
    """Time (us) against one size, log-log interpolated between measured points; flat below the
    smallest point, proportional to the size past the largest."""

    __slots__ = ("lx", "ly", "x_max", "y_max", "y_min")

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        order = np.argsort(x)
        x, y = np.asarray(x, float)[order], np.asarray(y, float)[order]
        if len(x) == 0 or (x <= 0).any() or not (y > 0).all():
            raise ValueError("a curve needs points with positive sizes and times")
        ux = np.unique(x)
        uy = np.array([np.median(y[x == v]) for v in ux])  # repeated sizes: their median
        self.lx, self.ly = np.log(ux).tolist(), np.log(uy).tolist()
        self.x_max, self.y_max, self.y_min = float(ux[-1]), float(uy[-1]), float(uy[0])

    def __call__(self, v: float) -> float:
        if v <= 0:
            return 0.0
        if v >= self.x_max:
            return self.y_max * v / self.x_max
        lv = math.log(v)
        i = bisect_right(self.lx, lv)
        if i == 0:
            return self.y_min
        x0, x1, y0, y1 = self.lx[i - 1], self.lx[i], self.ly[i - 1], self.ly[i]
        return math.exp(y0 + (y1 - y0) * (lv - x0) / (x1 - x0))


class Grid2:
    """Time (us) over (batch, context), bilinear in logs over a full grid; linear past its
    largest batch or context, flat below its smallest."""

    __slots__ = ("lb", "lc", "lt", "b_max", "c_max")

    def __init__(self, rows: pd.DataFrame) -> None:
        piv = rows.pivot_table(index="batch", columns="context", values="time_us",
                               aggfunc="median").sort_index().sort_index(axis=1)
        cols = piv.columns.to_numpy(float)
        for j in range(1, len(cols)):  # a point past the benchmark's memory: linear in context
            gap = piv.iloc[:, j].isna()
            piv.loc[gap, piv.columns[j]] = piv.loc[gap, piv.columns[j - 1]] * cols[j] / cols[j - 1]
        piv = piv.dropna(axis=0, how="any")
        if piv.empty:
            raise ValueError("a decode grid needs full rows of batch x context")
        self.lb = np.log(piv.index.to_numpy(float)).tolist()
        self.lc = np.log(piv.columns.to_numpy(float)).tolist()
        self.lt = np.log(piv.to_numpy(float)).tolist()
        self.b_max, self.c_max = float(piv.index[-1]), float(piv.columns[-1])

    @staticmethod
    def _at(axis: list[float], v: float) -> tuple[int, float]:
        lv = math.log(v)
        if lv <= axis[0] or len(axis) == 1:
            return 0, 0.0
        if lv >= axis[-1]:
            return len(axis) - 2, 1.0
        i = bisect_right(axis, lv) - 1
        return i, (lv - axis[i]) / (axis[i + 1] - axis[i])

    def __call__(self, batch: float, context: float) -> float:
        scale = 1.0
        if batch > self.b_max:
            scale *= batch / self.b_max
            batch = self.b_max
        if context > self.c_max:
            scale *= context / self.c_max
            context = self.c_max
        i, u = self._at(self.lb, max(batch, 1e-9))
        j, w = self._at(self.lc, max(context, 1e-9))
        lt = self.lt
        i1 = min(i + 1, len(self.lb) - 1)
        j1 = min(j + 1, len(self.lc) - 1)
        y = ((1 - u) * (1 - w) * lt[i][j] + u * (1 - w) * lt[i1][j]
             + (1 - u) * w * lt[i][j1] + u * w * lt[i1][j1])
        return math.exp(y) * scale


class PrefillCurve:
    """Paged prefill attention of one head shape over (tokens T, causal pairs P): at a fixed T
    the table's points lie on a line in P (several shorter prompts have fewer pairs than one
    prompt of T tokens and take less), so t = t1(T) + b(T) (P - T (T + 1) / 2), with t1 the
    one-prompt curve and b(T) the slope of the table's points of T tokens (log-interpolated
    in T, flat past the measured Ts), never below the smallest prompt's time."""

    __slots__ = ("t1", "lt", "slope")

    def __init__(self, rows: pd.DataFrame) -> None:
        one = rows[(rows["num_seqs"] == 1) & (rows["cached_len"] == 0)]
        self.t1 = Curve(one["num_tokens"].to_numpy(), one["time_us"].to_numpy())
        fresh = rows[rows["cached_len"] == 0]
        lt, slope = [], []
        for T, g in fresh.groupby("num_tokens"):
            if g["attn_pairs"].nunique() >= 2:
                b = np.polyfit(g["attn_pairs"].to_numpy(float), g["time_us"].to_numpy(float), 1)[0]
                if b > 0:
                    lt.append(math.log(T))
                    slope.append(float(b))
        if not lt:  # no batched points: the one-prompt curve's own slope in pairs
            lt = [0.0]
            x = one["attn_pairs"].to_numpy(float)
            slope = [float(np.polyfit(x, one["time_us"].to_numpy(float), 1)[0])]
        self.lt, self.slope = lt, slope

    def __call__(self, tokens: float, pairs: float) -> float:
        if pairs <= 0 or tokens <= 0:
            return 0.0
        t1 = self.t1(tokens)
        b = float(np.interp(math.log(tokens), self.lt, self.slope))
        return max(t1 + b * (pairs - tokens * (tokens + 1) / 2), self.t1.y_min)


@dataclass(frozen=True, slots=True)
class Launch:
    """The graph table's launch terms (us) as a + b L: GPU-side gaps of a step (``gap``; of a
    decode graph queued behind the step before, as steps 2..k of a window run:
    ``queued_gap``, None in tables without those rows) and the host's issue time of a
    piecewise, eager decode and eager prefill step."""

    gap: tuple[float, float]
    piecewise_host: tuple[float, float]
    eager_decode_host: tuple[float, float]
    eager_prefill_host: tuple[float, float]
    queued_gap: tuple[float, float] | None = None


@dataclass(slots=True)
class OpTables:
    """The tables of one directory, read once."""

    path: Path
    gemm: dict[tuple[str, int, int], Curve]
    prefill: dict[tuple[int, int, int], PrefillCurve]
    decode_uniform: dict[tuple[int, int, int], Grid2]
    decode_ragged: dict[tuple[int, int, int], tuple[Grid2, Grid2]]  # grid, max/mean context
    small: dict[tuple, Curve]  # (op, *sizes) -> time over tokens
    sampler: dict[tuple[str, int], Curve]  # (op, vocab) -> time over rows
    graph: pd.DataFrame
    launch: Launch | None = None
    # the decode kernel's program that reads one sequence: time over the tokens it reads (the
    # sequence's length over the key splits), from the "longest" rows; and the SM count the
    # splits were chosen for (attention_decode.meta.json). Empty / None: tables without them.
    decode_longest: dict[tuple[int, int, int], Curve] = dataclasses.field(default_factory=dict)
    num_sms: int | None = None


def resolve(path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() else CONF_DIR / p


def _read(path: Path, table: str, need: list[str]) -> pd.DataFrame:
    f = path / f"{table}.csv"
    try:
        df = pd.read_csv(f)
    except (OSError, ValueError, pd.errors.ParserError) as err:
        raise ValueError(f"hardware.op_tables: cannot read {f}: {err}") from None
    missing = [c for c in need if c not in df.columns]
    if missing:
        raise ValueError(f"hardware.op_tables: {f} lacks column(s) {', '.join(missing)}")
    if df.empty or not (df["time_us"] > 0).all():
        raise ValueError(f"hardware.op_tables: {f} needs rows with time_us > 0")
    return df


def _num_sms(meta: Path) -> int | None:
    """The SM count a table was measured on (its meta file), or None."""
    try:
        n = json.loads(meta.read_text()).get("num_sms")
    except (OSError, ValueError, AttributeError):
        return None
    return int(n) if isinstance(n, int | float) and n > 0 else None


@lru_cache(maxsize=8)
def load_tables(path: str) -> OpTables:
    """The tables of directory ``path`` (relative to conf/ or absolute), checked; a missing or
    malformed table is a one-line error naming the file."""
    root = resolve(path)
    if not root.is_dir():
        raise ValueError(f"hardware.op_tables: {root} is not a directory")
    g = _read(root, "gemm", ["op", "M", "N", "K", "time_us"])
    gemm = {(op, int(n), int(k)): Curve(r["M"].to_numpy(), r["time_us"].to_numpy())
            for (op, n, k), r in g.groupby(["op", "N", "K"])}
    heads = ["num_heads", "num_kv_heads", "head_dim"]
    p = _read(root, "attention_prefill", heads + ["num_seqs", "cached_len", "num_tokens",
                                                  "attn_pairs", "time_us"])
    prefill = {tuple(int(v) for v in key): PrefillCurve(r) for key, r in p.groupby(heads)}
    d = _read(root, "attention_decode", heads + ["batch", "context", "ctx_dist", "kv_tokens",
                                                 "max_kv_tokens", "time_us"])
    uniform, ragged, longest = {}, {}, {}
    for key, r in d.groupby(heads):
        key = tuple(int(v) for v in key)
        uniform[key] = Grid2(r[r["ctx_dist"] == "uniform"])
        rg = r[r["ctx_dist"] == "ragged"]  # lengths uniform over 1..2c-1: mean c
        if len(rg):
            ragged[key] = (Grid2(rg), Grid2(rg.assign(
                time_us=rg["max_kv_tokens"] * rg["batch"] / rg["kv_tokens"])))
        lg = r[r["ctx_dist"] == "longest"]
        if len(lg) and "num_splits" in lg:
            longest[key] = Curve((lg["max_kv_tokens"] / lg["num_splits"]).to_numpy(),
                                 lg["time_us"].to_numpy())
    s = _read(root, "per_layer_small", ["op", "tokens", "hidden_size", "intermediate_size",
                                        "num_heads", "num_kv_heads", "head_dim", "vocab_size",
                                        "time_us"])
    size_cols = ["hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                 "vocab_size"]
    small = {(key[0], *(int(v) for v in key[1:])): Curve(r["tokens"].to_numpy(),
                                                         r["time_us"].to_numpy())
             for key, r in s.groupby(["op"] + size_cols)}
    sm = _read(root, "sampler", ["op", "num_sampled", "vocab_size", "time_us"])
    sampler = {(op, int(v)): Curve(r["num_sampled"].to_numpy(), r["time_us"].to_numpy())
               for (op, v), r in sm.groupby(["op", "vocab_size"])}
    graph = _read(root, "graph", ["model", "num_layers", "mode", "time_us", "host_us"])
    tables = OpTables(root, gemm, prefill, uniform, ragged, small, sampler, graph,
                      decode_longest=longest, num_sms=_num_sms(root / "attention_decode.meta.json"))
    tables.launch = fit_launch(tables)
    return tables


# ---------------------------------------------------------------------------- kernels
def _roofline_us(m: int, n: int, k: int) -> float:
    """A GEMM's roofline at an H200's rates: only ratios of it are used (the fallback)."""
    return max(2.0 * m * n * k / 989e12, 2.0 * (n * k + m * k + m * n) / 4.8e12)


def gemm_us(t: OpTables, op: str, m: int, n: int, k: int) -> float:
    """``x[m, k] @ W[n, k]^T``: the table's curve at (N, K), else the nearest (N, K) of the
    table scaled by the roofline's ratio."""
    if m <= 0:
        return 0.0
    curve = t.gemm.get((op, n, k))
    if curve is not None:
        return curve(m)
    key = nearest_gemm(t, op, n, k)
    return t.gemm[key](m) * _roofline_us(m, n, k) / _roofline_us(m, key[1], key[2])


def nearest_gemm(t: OpTables, op: str, n: int, k: int) -> tuple[str, int, int]:
    keys = [key for key in t.gemm if key[0] == op] or list(t.gemm)
    return min(keys, key=lambda key: (abs(math.log(key[1] / n)) + abs(math.log(key[2] / k)),
                                      key))


def _nearest_heads(keys, h: int, kvh: int, d: int) -> tuple[int, int, int]:
    return min(keys, key=lambda key: (abs(math.log(key[0] * key[2] / (h * d)))
                                      + abs(math.log(key[1] * key[2] / (kvh * d))), key))


def prefill_attention_us(t: OpTables, heads: tuple[int, int, int], tokens: int,
                         pairs: float) -> float:
    """Paged prefill attention of ``tokens`` prefill tokens over ``pairs`` causal (query, key)
    pairs; a head shape the table lacks: its nearest shape's time scaled by the FLOPs (query
    heads x head_dim)."""
    if pairs <= 0:
        return 0.0
    curve = t.prefill.get(heads)
    if curve is not None:
        return curve(tokens, pairs)
    near = _nearest_heads(t.prefill, *heads)
    return t.prefill[near](tokens, pairs) * heads[0] * heads[2] / (near[0] * near[2])


def decode_attention_us(t: OpTables, heads: tuple[int, int, int], batch: int, kv_tokens: float,
                        max_kv_tokens: float = 0.0, rows: int = 0) -> float:
    """Paged decode attention of ``batch`` sequences holding ``kv_tokens`` in all: the table at
    that batch and mean context, from its uniform contexts (longest = mean) toward its ragged
    ones as the longest sequence lies above the mean (unknown: uniform); a head shape the table
    lacks: its nearest shape's time scaled by the KV bytes (KV heads x head_dim). Never less
    than the program that reads the longest sequence (its length over the key splits of the
    ``rows`` the kernel sees, a graph's padded batch; 0: ``batch``), from the "longest" rows:
    a batch of very unequal contexts waits for it."""
    if batch <= 0 or kv_tokens <= 0:
        return 0.0
    key = heads if heads in t.decode_uniform else _nearest_heads(t.decode_uniform, *heads)
    scale = 1.0 if key == heads else heads[1] * heads[2] / (key[1] * key[2])
    mean = kv_tokens / batch
    time = t.decode_uniform[key](batch, mean)
    rag = t.decode_ragged.get(key)
    if rag is not None and max_kv_tokens > mean and batch >= 4:
        grid, ratio = rag
        r = ratio(batch, mean)
        if r > 1.0:
            w = min((max_kv_tokens / mean - 1.0) / (r - 1.0), 1.0)
            time += w * (grid(batch, mean) - time)
    time *= scale
    longest = t.decode_longest.get(key)
    if longest is not None and t.num_sms and max_kv_tokens > 0:
        splits = decode_splits(rows or batch, heads[1], t.num_sms)
        time = max(time, longest(max_kv_tokens / splits) * heads[2] / key[2])
    return time


def small_us(t: OpTables, op: str, tokens: int, sizes: tuple[int, ...]) -> float:
    """One small per-layer kernel (``sizes``: hidden, intermediate, heads, KV heads, head_dim,
    vocab, 0 where the op does not depend on it); a size the table lacks: the nearest of that
    op scaled by the bytes per token (the product of its nonzero sizes but the vocab)."""
    if tokens <= 0:
        return 0.0
    curve = t.small.get((op, *sizes))
    if curve is not None:
        return curve(tokens)

    def per_token(sz: tuple[int, ...]) -> float:
        h, inter, nh, kvh, d, _ = sz
        if op in ("rotary_embedding",):
            return (nh + kvh) * d
        if op == "reshape_and_cache":
            return kvh * d
        if op == "attn_copy":
            return nh * d
        return max(h, 0) + max(inter, 0)

    keys = [key for key in t.small if key[0] == op]
    if not keys:
        raise ValueError(f"hardware.op_tables: {t.path}/per_layer_small.csv has no {op} rows")
    near = min(keys, key=lambda key: (abs(math.log(per_token(key[1:]) / per_token(sizes))), key))
    return t.small[near](tokens) * per_token(sizes) / per_token(near[1:])


def sampler_us(t: OpTables, op: str, rows: int, vocab: int) -> float:
    """A sampler table op (logits_fp32, greedy, advance_step) over ``rows``; a vocabulary the
    table lacks: the nearest scaled by the vocabulary's ratio."""
    if rows <= 0:
        return 0.0
    if op == "advance_step":
        vocab = 0
    curve = t.sampler.get((op, vocab))
    if curve is not None:
        return curve(rows)
    keys = [key for key in t.sampler if key[0] == op]
    if not keys:
        raise ValueError(f"hardware.op_tables: {t.path}/sampler.csv has no {op} rows")
    near = min(keys, key=lambda key: (abs(math.log(max(key[1], 1) / max(vocab, 1))), key))
    return t.sampler[near](rows) * max(vocab, 1) / max(near[1], 1)


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
    q_size, kv_size = nh * d, kvh * d
    per_layer = 0.0
    compute = 0.0
    for op, n, k in (("layer", q_size + 2 * kv_size, h), ("layer", h, q_size),
                     ("layer", 2 * inter, h), ("layer", h, inter)):
        g = gemm_us(t, op, tokens, n, k)
        c = min(2.0 * tokens * n * k / (g * 1e-6 * 989e12), 1.0) * g  # compute-bound share
        per_layer += g + c * (slow - 1.0)
        compute += c * slow
    heads = (nh, kvh, d)
    attn = prefill_attention_us(t, heads, shape.num_prefill_tokens, shape.attn_pairs) * slow
    compute += attn
    decode_seqs = shape.num_tokens - shape.num_prefill_tokens
    if decode_seqs > 0:
        prefill_kv = shape.prefill_kv_tokens or shape.num_prefill_tokens
        rows = tokens if shape.num_prefill_tokens == 0 else decode_seqs  # a graph's padding
        attn += decode_attention_us(t, heads, decode_seqs, shape.kv_tokens - prefill_kv,
                                    shape.max_kv_tokens, rows)
    per_layer += attn
    per_layer += 2 * small_us(t, "add_rms_norm", tokens, (h, 0, 0, 0, 0, 0))
    per_layer += small_us(t, "rotary_embedding", tokens, (0, 0, *heads, 0))
    per_layer += small_us(t, "reshape_and_cache", shape.num_tokens, (0, 0, *heads, 0))
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
    graph table: the decode graph's time beyond its kernels (gaps and replay), and the host's
    issue time of piecewise and eager steps."""
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
    launch = tables.launch
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
