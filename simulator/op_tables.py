"""The operator tables (benchmarks/operators.py's CSVs) read, and one op's time looked up in them.

Each table is read once per directory (``load_tables``), checked (a missing or malformed table
is a one-line error naming the file). Every lookup interpolates log-log along the table's grid
(linear in the size past its largest point, flat below its smallest); a shape the table lacks
takes its nearest shape's time scaled by the roofline (GEMMs: FLOPs or bytes) or by the bytes
moved (other kernels). Decode attention is read at the batch and mean context, between the
uniform and ragged contexts by the batch's longest sequence; a batch of unequal contexts never
below the program that reads its longest sequence (the "longest" rows). simulator/op_cost.py
prices a step from these, and fits the graph table's launch terms.
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

from common.paths import conf_dir
from common.step_sizes import decode_splits, split_tokens

CONF_DIR = conf_dir()  # one home: experiments/paths.py


class Curve:
    """Time (us) against one size, log-log interpolated between measured points; flat below the
    smallest point, proportional to the size past the largest."""

    __slots__ = ("lx", "ly", "x_min", "x_max", "y_max", "y_min")

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        order = np.argsort(x)
        x, y = np.asarray(x, float)[order], np.asarray(y, float)[order]
        if len(x) == 0 or (x <= 0).any() or not (y > 0).all():
            raise ValueError("a curve needs points with positive sizes and times")
        ux = np.unique(x)
        uy = np.array([np.median(y[x == v]) for v in ux])  # repeated sizes: their median
        self.lx, self.ly = np.log(ux).tolist(), np.log(uy).tolist()
        self.x_min, self.x_max = float(ux[0]), float(ux[-1])
        self.y_max, self.y_min = float(uy[-1]), float(uy[0])

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
    # the decode kernel's program that reads one sequence: time over the tokens it reads (the
    # sequence's length over the key splits), from the "longest" rows; and the SM count the
    # splits were chosen for (attention_decode.meta.json). Empty / None: tables without them.
    decode_longest: dict[tuple[int, int, int], Curve] = dataclasses.field(default_factory=dict)
    num_sms: int | None = None
    # the lookups of gemm_us, small_us and sampler_us already made: a run prices the same
    # few hundred padded sizes millions of times
    memo: dict[tuple, float] = dataclasses.field(default_factory=dict, repr=False, compare=False)


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
        if "num_splits" in lg:
            lg = lg[lg["num_splits"] >= 1]  # a row without its splits cannot be placed
            if len(lg):
                longest[key] = Curve(np.array([split_tokens(n, s) for n, s in
                                               zip(lg["max_kv_tokens"], lg["num_splits"],
                                                   strict=True)]), lg["time_us"].to_numpy())
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
    return OpTables(root, gemm, prefill, uniform, ragged, small, sampler, graph,
                    decode_longest=longest, num_sms=_num_sms(root / "attention_decode.meta.json"))


# ---------------------------------------------------------------------------- kernels
def _roofline_us(m: int, n: int, k: int) -> float:
    """A GEMM's roofline at an H200's rates: only ratios of it are used (the fallback)."""
    return max(2.0 * m * n * k / 989e12, 2.0 * (n * k + m * k + m * n) / 4.8e12)


def gemm_us(t: OpTables, op: str, m: int, n: int, k: int) -> float:
    """``x[m, k] @ W[n, k]^T``: the table's curve at (N, K), else the nearest (N, K) of the
    table scaled by the roofline's ratio."""
    if m <= 0:
        return 0.0
    return _memoised(t, ("gemm", op, m, n, k), _gemm_us, t, op, m, n, k)


def _gemm_us(t: OpTables, op: str, m: int, n: int, k: int) -> float:
    curve = t.gemm.get((op, n, k))
    if curve is not None:
        return curve(m)
    key = nearest_gemm(t, op, n, k)
    return t.gemm[key](m) * _roofline_us(m, n, k) / _roofline_us(m, key[1], key[2])


def _memoised(t: OpTables, key: tuple, price, *args) -> float:
    """``price(*args)``, looked up in the tables' memo first (``OpTables.memo``)."""
    us = t.memo.get(key)
    if us is None:
        us = t.memo[key] = price(*args)
    return us


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
    a batch of unequal contexts waits for it."""
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
    if longest is not None and t.num_sms and max_kv_tokens > mean:
        x = split_tokens(max_kv_tokens, decode_splits(rows or batch, heads[1], t.num_sms))
        if x > longest.x_min:  # below its points the curve is the kernel's floor, not the program
            time = max(time, longest(x) * heads[2] / key[2])
    return time


def small_us(t: OpTables, op: str, tokens: int, sizes: tuple[int, ...]) -> float:
    """One small per-layer kernel (``sizes``: hidden, intermediate, heads, KV heads, head_dim,
    vocab, 0 where the op does not depend on it); a size the table lacks: the nearest of that
    op scaled by the bytes per token (the product of its nonzero sizes but the vocab)."""
    if tokens <= 0:
        return 0.0
    return _memoised(t, ("small", op, tokens, sizes), _small_us, t, op, tokens, sizes)


def _small_us(t: OpTables, op: str, tokens: int, sizes: tuple[int, ...]) -> float:
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
    return _memoised(t, ("sampler", op, rows, vocab), _sampler_us, t, op, rows, vocab)


def _sampler_us(t: OpTables, op: str, rows: int, vocab: int) -> float:
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
