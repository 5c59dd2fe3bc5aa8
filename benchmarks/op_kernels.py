"""The operator tables of benchmarks/operators.py that time single kernels: GEMMs, paged prefill
and decode attention, the small per-layer kernels and the sampler, each over every shape the
chosen models have (the engine's own ops, timed as op_timing.py says)."""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from op_timing import Bench

from common.model_spec import ModelSpec
from real_backend.kernels import Kernels
from real_backend.model import rope_table, split_heads
from real_backend.sampling import SamplingParams, sample

if TYPE_CHECKING:
    from op_grid import Grid

BLOCK_SIZE = 16  # the engine's (scheduler.block_size)
# an H200's rates for the estimates (the efficiencies a little below what these shapes reach)
EST_FLOPS, EST_BYTES_S = 989e12 * 0.6, 4.8e12 * 0.7
KV_CACHE_BYTES = 8 * 2**30  # at most this much K (and as much V) per head shape


# ---------------------------------------------------------------------------- model shapes
def _group(items: list[tuple[tuple, str]]) -> dict[tuple, str]:
    """key -> the ';'-joined users of that key, in first-seen order."""
    out: dict[tuple, list[str]] = {}
    for key, user in items:
        out.setdefault(key, []).append(user)
    return {k: ";".join(v) for k, v in out.items()}


def gemm_shapes(specs: list[ModelSpec]) -> dict[tuple, str]:
    """(op, N, K) -> users (model.op): a layer's four projections and the LM head, x @ W^T with
    W [N, K], as real_backend/model.py runs them."""
    items = []
    for s in specs:
        h = s.hidden_size
        for op, n, k in (("qkv", s.q_size + 2 * s.kv_size, h), ("o_proj", h, s.q_size),
                         ("gate_up", 2 * s.intermediate_size, h),
                         ("down", h, s.intermediate_size), ("lm_head", s.vocab_size, h)):
            items.append((("lm_head" if op == "lm_head" else "layer", n, k), f"{s.name}.{op}"))
    return _group(items)


def head_shapes(specs: list[ModelSpec]) -> dict[tuple, tuple[ModelSpec, str]]:
    """(heads, KV heads, head_dim) -> (the first model of that shape, the users)."""
    first = {}
    for s in specs:
        first.setdefault((s.num_heads, s.num_kv_heads, s.head_dim), s)
    users = _group([((s.num_heads, s.num_kv_heads, s.head_dim), s.name) for s in specs])
    return {key: (first[key], users[key]) for key in users}


def small_shapes(specs: list[ModelSpec]) -> dict[tuple, str]:
    """(op, hidden, intermediate, heads, kv heads, head_dim, vocab) -> users; 0: not a size
    the op depends on."""
    items = []
    for s in specs:
        h, inter = s.hidden_size, s.intermediate_size
        heads = (s.num_heads, s.num_kv_heads, s.head_dim)
        items += [(("add_rms_norm", h, 0, 0, 0, 0, 0), s.name),
                  (("rotary_embedding", 0, 0, *heads, 0), s.name),
                  (("silu_and_mul", 0, inter, 0, 0, 0, 0), s.name),
                  (("reshape_and_cache", 0, 0, *heads, 0), s.name),
                  (("attn_copy", 0, 0, *heads, 0), s.name),
                  (("embedding", h, 0, 0, 0, 0, s.vocab_size), s.name)]
    return _group(items)



def roofline_us(flops: float, nbytes: float) -> float:
    """A call's time on an H200 at the estimate's rates (sizes the calls per replay)."""
    return max(flops / EST_FLOPS, nbytes / EST_BYTES_S) * 1e6 + 2.0


def release(bench: Bench) -> None:
    gc.collect()
    if bench.cuda:
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- gemm
def gemm_table(bench: Bench, specs: list[ModelSpec], grid: Grid) -> tuple[list, list]:
    rows, spans = [], []
    dt, elt = bench.dtype, torch.empty((), dtype=bench.dtype).element_size()
    for (kind, n, k), used in gemm_shapes(specs).items():
        ms = grid.lm_head_m if kind == "lm_head" else grid.gemm_m
        copies = bench.copies(n * k * elt)
        w = torch.empty(copies, n, k, dtype=dt, device=bench.device).normal_(0.0, k ** -0.5)
        x_all = torch.randn(max(ms), k, dtype=dt, device=bench.device)
        for m in ms:
            x = x_all[:m]
            turn = itertools.cycle(range(copies))

            def fn(x=x, w=w, turn=turn) -> torch.Tensor:
                return F.linear(x, w[next(turn)])

            flops, nbytes = 2 * m * n * k, elt * (n * k + m * k + m * n)
            t = bench.time(fn, bench.calls(roofline_us(flops, nbytes), copies))
            rows.append({"op": kind, "used_by": used, "M": m, "N": n, "K": k, "copies": copies,
                         "calls": t.calls, "time_us": t.time_us, "launch_us": t.launch_us,
                         "tflops": flops / t.time_us / 1e6, "gbps": nbytes / t.time_us / 1e3})
            spans.append(t.span)
        del w, x_all
        release(bench)
    return rows, spans


# ---------------------------------------------------------------------------- attention
def _cache(bench: Bench, kvh: int, d: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V block tensors [blocks, 16, kvh, d] holding ``tokens``, filled with noise (every
    block read holds finite, real-looking data)."""
    blocks = -(-tokens // BLOCK_SIZE) + 1
    shape = (blocks, BLOCK_SIZE, kvh, d)
    return (torch.empty(shape, dtype=bench.dtype, device=bench.device).normal_(0.0, 0.5),
            torch.empty(shape, dtype=bench.dtype, device=bench.device).normal_(0.0, 0.5))


def _tables(lens: list[int], copies: int, num_blocks: int, rng: np.random.Generator,
            device: torch.device) -> list[torch.Tensor]:
    """``copies`` block tables [len(lens), width] int32 over disjoint, scattered blocks."""
    need = [-(-n // BLOCK_SIZE) for n in lens]
    perm = rng.permutation(num_blocks)
    width = max(need)
    out, at = [], 0
    for _ in range(copies):
        table = np.zeros((len(lens), width), dtype=np.int32)
        for i, b in enumerate(need):
            table[i, :b] = perm[at:at + b]
            at += b
        out.append(torch.from_numpy(table).to(device))
    return out


def _qkv(bench: Bench, spec: ModelSpec, tokens: int) -> torch.Tensor:
    """q [tokens, heads, head_dim] as the engine has it: a strided view of the fused qkv."""
    qkv = torch.randn(tokens, spec.q_size + 2 * spec.kv_size, dtype=bench.dtype,
                      device=bench.device)
    return split_heads(spec, qkv)[0]


def _rotating(op: Callable, head: tuple, tables: list[torch.Tensor],
              tail: tuple) -> Callable[[], object]:
    """``op(*head, table, *tail)``, each call with the next of the block tables."""
    turn = itertools.cycle(tables)
    return lambda: op(*head, next(turn), *tail)


LONGEST_SHORT = 16  # tokens of the short sequences beside the long one in "longest" rows


def decode_table(bench: Bench, specs: list[ModelSpec], grid: Grid,
                 kernels: Kernels) -> tuple[list, list]:
    rows, spans = [], []
    rng = np.random.default_rng(0)
    elt = torch.empty((), dtype=bench.dtype).element_size()
    for (h, kvh, d), (spec, used) in head_shapes(specs).items():
        per_token = kvh * d * elt  # bytes of K (as many of V) per token
        cap = KV_CACHE_BYTES // per_token if bench.cuda else 4096
        points = []
        for b, c in itertools.product(grid.decode_batches, grid.decode_contexts):
            points.append((b, c, "uniform", [c] * b))
            if b >= 4:  # served batches are ragged: lengths uniform over 1..2c-1 (mean c)
                points.append((b, c, "ragged", rng.integers(1, 2 * c, b).tolist()))
        for b, c in itertools.product(grid.longest_batches, grid.longest_contexts):
            # one long sequence among short ones: the time of the program that reads it, which
            # a served batch of very unequal contexts waits for ("context": its length)
            points.append((b, c, "longest", [c] + [LONGEST_SHORT] * (b - 1)))
        points = [p for p in points if sum(p[3]) + BLOCK_SIZE * len(p[3]) <= cap]
        if not points:
            continue
        most = max(sum(p[3]) + BLOCK_SIZE * len(p[3]) for p in points)
        tokens = min(cap, max(4 * most, 8 * bench.l2_bytes() // per_token))
        k_cache, v_cache = _cache(bench, kvh, d, tokens)
        blocks = k_cache.shape[0]
        scale = d ** -0.5
        for b, c, dist, lens in points:
            need = sum(-(-n // BLOCK_SIZE) for n in lens)
            copies = min(bench.copies(2 * per_token * sum(lens)), blocks // need)
            tables = _tables(lens, copies, blocks, rng, bench.device)
            seq_lens = torch.tensor(lens, dtype=torch.int32, device=bench.device)
            q = _qkv(bench, spec, b)
            fn = _rotating(kernels.decode_attention, (q, k_cache, v_cache), tables,
                           (seq_lens, scale))
            est = roofline_us(4 * sum(lens) * h * d, 2 * per_token * sum(lens))
            t = bench.time(fn, bench.calls(est, copies))
            rows.append({"num_heads": h, "num_kv_heads": kvh, "head_dim": d, "used_by": used,
                         "batch": b, "context": c, "ctx_dist": dist, "kv_tokens": sum(lens),
                         "max_kv_tokens": max(lens), "num_splits": _splits(bench, b, kvh),
                         "copies": copies, "calls": t.calls, "time_us": t.time_us,
                         "launch_us": t.launch_us})
            spans.append(t.span)
        del k_cache, v_cache
        release(bench)
    return rows, spans


def _splits(bench: Bench, batch: int, kvh: int) -> int:
    if not bench.cuda:
        return 1
    from real_backend.triton_ops import decode_splits

    return decode_splits(batch, kvh, bench.device)


def prefill_table(bench: Bench, specs: list[ModelSpec], grid: Grid,
                  kernels: Kernels) -> tuple[list, list]:
    rows, spans = [], []
    rng = np.random.default_rng(1)
    elt = torch.empty((), dtype=bench.dtype).element_size()
    for (h, kvh, d), (spec, used) in head_shapes(specs).items():
        per_token = kvh * d * elt
        most = max(n * (q + c + BLOCK_SIZE) for n, q, c in grid.prefill)
        k_cache, v_cache = _cache(bench, kvh, d, max(4 * most, 8 * bench.l2_bytes() // per_token)
                                  if bench.cuda else 2 * most)
        blocks = k_cache.shape[0]
        scale = d ** -0.5
        for n, q_len, cached in grid.prefill:
            lens = [q_len + cached] * n
            need = n * -(-(q_len + cached) // BLOCK_SIZE)
            copies = min(bench.copies(2 * per_token * sum(lens) + 2 * n * q_len * h * d * elt),
                         blocks // need)
            tables = _tables(lens, copies, blocks, rng, bench.device)
            starts = torch.arange(0, n + 1, dtype=torch.int32, device=bench.device) * q_len
            seq_lens = torch.tensor(lens, dtype=torch.int32, device=bench.device)
            q = _qkv(bench, spec, n * q_len)
            fn = _rotating(kernels.prefill_attention, (q, k_cache, v_cache), tables,
                           (starts, seq_lens, scale, q_len))
            pairs = n * (q_len * cached + q_len * (q_len + 1) // 2)
            est = roofline_us(4 * pairs * h * d / 0.5, 2 * per_token * sum(lens))
            t = bench.time(fn, bench.calls(est, copies))
            rows.append({"num_heads": h, "num_kv_heads": kvh, "head_dim": d, "used_by": used,
                         "num_seqs": n, "query_len": q_len, "cached_len": cached,
                         "num_tokens": n * q_len, "kv_tokens": sum(lens), "attn_pairs": pairs,
                         "copies": copies, "calls": t.calls, "time_us": t.time_us,
                         "launch_us": t.launch_us})
            spans.append(t.span)
        del k_cache, v_cache
        release(bench)
    return rows, spans


# ---------------------------------------------------------------------------- small kernels
def small_table(bench: Bench, specs: list[ModelSpec], grid: Grid,
                kernels: Kernels) -> tuple[list, list]:
    rows, spans = [], []
    by_heads = {(s.num_heads, s.num_kv_heads, s.head_dim): s for s in specs}
    for key, used in small_shapes(specs).items():
        op, hidden, inter, h, kvh, d, vocab = key
        make = _small_op(bench, kernels, key, by_heads.get((h, kvh, d)), max(grid.small_tokens))
        for n in grid.small_tokens:
            fn, nbytes = make(n)
            t = bench.time(fn, bench.calls(roofline_us(0, nbytes), 1))
            rows.append({"op": op, "used_by": used, "tokens": n, "hidden_size": hidden,
                         "intermediate_size": inter, "num_heads": h, "num_kv_heads": kvh,
                         "head_dim": d, "vocab_size": vocab, "bytes": nbytes, "calls": t.calls,
                         "time_us": t.time_us, "launch_us": t.launch_us})
            spans.append(t.span)
        del make
        release(bench)
    return rows, spans


def _small_op(bench: Bench, kernels: Kernels, key: tuple, spec: ModelSpec | None,
              t_max: int) -> Callable[[int], tuple[Callable[[], object], int]]:
    """For one small_shapes key: tokens -> (a call over the first ``tokens`` rows of inputs
    made once, the bytes it moves)."""
    op, hidden, inter, h, kvh, d, vocab = key
    dev, dt = bench.device, bench.dtype
    elt = torch.empty((), dtype=dt).element_size()
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dev, dt)

    if op == "add_rms_norm":  # the residual add fused into the next norm, as every layer has
        x, delta, weight = randn(t_max, hidden), randn(t_max, hidden), randn(hidden)
        return lambda n: (_bind(kernels.add_rms_norm, x[:n], delta[:n], weight, 1e-5),
                          4 * n * hidden * elt)
    if op == "silu_and_mul":
        gate_up = randn(t_max, 2 * inter)
        return lambda n: (_bind(kernels.silu_and_mul, gate_up[:n]), 3 * n * inter * elt)
    if op == "embedding":
        table = randn(vocab, hidden)
        ids = torch.randint(0, vocab, (t_max,), generator=gen).to(dev)
        return lambda n: (_bind(F.embedding, ids[:n], table), 2 * n * hidden * elt)
    if op == "attn_copy":  # piecewise steps: bufs.attn[:n].copy_(out.reshape(n, q_size))
        out, buf = randn(t_max, h, d), randn(t_max, h * d)
        return lambda n: (_bind(lambda b, o: b.copy_(o.reshape(b.shape)), buf[:n], out[:n]),
                          2 * n * h * d * elt)
    qkv = randn(t_max, (h + 2 * kvh) * d)
    if op == "rotary_embedding":
        rope = rope_table(spec, dev)
        pos = torch.randint(0, spec.max_model_len, (t_max,), generator=gen).to(dev)

        def rotary(n: int) -> tuple[Callable[[], object], int]:
            q, k, _ = split_heads(spec, qkv[:n])
            return (_bind(kernels.rotary_embedding, pos[:n], q, k, rope),
                    2 * n * (h + kvh) * d * elt + n * d * 4)

        return rotary
    k_cache, v_cache = _cache(bench, kvh, d, t_max + BLOCK_SIZE)
    slots = torch.randperm(k_cache.shape[0] * BLOCK_SIZE, generator=gen)[:t_max].to(dev)

    def cache_write(n: int) -> tuple[Callable[[], object], int]:
        _, k, v = split_heads(spec, qkv[:n])
        return (_bind(kernels.reshape_and_cache, k, v, k_cache, v_cache, slots[:n]),
                4 * n * kvh * d * elt)

    return cache_write


def _bind(fn: Callable, *args: Any) -> Callable[[], object]:
    return lambda: fn(*args)


# ---------------------------------------------------------------------------- sampler
def sampler_table(bench: Bench, specs: list[ModelSpec], grid: Grid,
                  kernels: Kernels) -> tuple[list, list]:
    """The sampler as the engine runs it after the LM head: compute_logits' cast to fp32,
    then real_backend.sampling.sample (greedy, benchmark_serving's setting, and the random
    paths); advance_step between the steps of a window."""
    rows, spans = [], []
    dev, dt = bench.device, bench.dtype
    m_max = max(grid.sampled)
    paths = {"greedy": SamplingParams(), "random": SamplingParams(temperature=1.0),
             "random_top_k_top_p": SamplingParams(temperature=1.0, top_k=50, top_p=0.9)}
    for vocab in sorted({s.vocab_size for s in specs}):
        raw = torch.randn(m_max, vocab, dtype=dt, device=dev)
        logits = raw.float()
        for m in grid.sampled:
            fns = {"logits_fp32": _bind(lambda x: x.float(), raw[:m])}
            # generator None: the default one, which a CUDA graph can capture
            fns.update({name: _bind(sample, logits[:m], p, None) for name, p in paths.items()})
            for op, fn in fns.items():
                t = bench.time(fn, bench.calls(roofline_us(0, 6 * m * vocab * 4), 1))
                rows.append({"op": op, "num_sampled": m, "vocab_size": vocab, "calls": t.calls,
                             "time_us": t.time_us, "launch_us": t.launch_us})
                spans.append(t.span)
        del raw, logits
    # advance_step adds one position per call: the block table must outlast every call
    width = (BLOCK_SIZE + 2 + 256 * (bench.reps + 1) + 10) // BLOCK_SIZE + 2
    for n in grid.sampled:
        def buf(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=dev)

        tokens, positions, slots = buf(n), buf(n), buf(n)
        seq_lens = buf(n, dtype=torch.int32).fill_(BLOCK_SIZE)
        tables = torch.randint(0, 1 << 20, (n, width), dtype=torch.int32).to(dev)
        sampled = torch.randint(0, 1000, (n,)).to(dev)
        fn = _bind(kernels.advance_step, n, n, BLOCK_SIZE, tokens, sampled, positions,
                   seq_lens, slots, tables)
        t = bench.time(fn, bench.calls(3.0, 1))
        rows.append({"op": "advance_step", "num_sampled": n, "vocab_size": 0, "calls": t.calls,
                     "time_us": t.time_us, "launch_us": t.launch_us})
        spans.append(t.span)
    release(bench)
    return rows, spans
