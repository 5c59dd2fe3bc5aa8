"""Triton kernels for the hot ops: fused residual-add RMSNorm, RoPE, SiLU-and-mul, KV slot write,
paged decode (split-K for small batches) and prefill attention, advance_step.

Each public function has the signature of its PyTorch reference in ``real_backend.ops``.
Set ``TRITON_INTERPRET=1`` before importing this module to run the kernels on CPU tensors.
Runtime-varying integers are ``do_not_specialize`` so a new batch size or length never
triggers a recompile in the middle of a timed run.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from common import step_sizes


def _pow2(n: int, floor: int = 1) -> int:
    return max(triton.next_power_of_2(n), floor)


# --------------------------------------------------------------------------- elementwise
@triton.jit(do_not_specialize=["eps"])
def _add_rms_norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_d,
                         stride_o, stride_s, eps, N: tl.constexpr, BLOCK: tl.constexpr,
                         HAS_DELTA: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
    if HAS_DELTA:
        # Round the sum to the residual stream's dtype before normalising, as the reference does.
        x = (x.to(tl.float32) + tl.load(delta_ptr + row * stride_d + cols, mask=m,
                                        other=0.0).to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=m)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    normed = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=m)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    out = torch.empty_like(x)
    total = x if delta is None else torch.empty_like(x)
    if x.shape[0]:
        _add_rms_norm_kernel[(x.shape[0],)](
            x, x if delta is None else delta, weight, out, total, x.stride(0),
            x.stride(0) if delta is None else delta.stride(0), out.stride(0), total.stride(0),
            eps, N=n, BLOCK=_pow2(n), HAS_DELTA=delta is not None,
            num_warps=min(max(_pow2(n) // 512, 1), 16))
    return out, total


@triton.jit
def _rotary_kernel(x_ptr, pos_ptr, rope_ptr, stride_t, stride_h, last_pos,
                   HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
                   HALF_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.minimum(tl.load(pos_ptr + t), last_pos).to(tl.int64)
    d = tl.arange(0, HALF_PAD)
    h = tl.arange(0, HEADS_PAD)
    cos = tl.load(rope_ptr + pos * 2 * HALF + d, mask=d < HALF, other=0.0)[None, :]
    sin = tl.load(rope_ptr + pos * 2 * HALF + HALF + d, mask=d < HALF, other=0.0)[None, :]
    m = (h[:, None] < HEADS) & (d[None, :] < HALF)
    ptr = x_ptr + t * stride_t + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(ptr, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=m, other=0.0).to(tl.float32)
    tl.store(ptr, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=m)
    tl.store(ptr + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=m)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     rope: torch.Tensor) -> None:
    num_tokens, half = q.shape[0], q.shape[-1] // 2
    if num_tokens == 0:
        return
    for x in (q, k):
        _rotary_kernel[(num_tokens,)](
            x, positions, rope, x.stride(0), x.stride(1), rope.shape[0] - 1, HEADS=x.shape[1],
            HEADS_PAD=_pow2(x.shape[1]), HALF=half, HALF_PAD=_pow2(half))


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < N
    gate = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=m, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=m)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    num_tokens, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_tokens, n), dtype=gate_up.dtype, device=gate_up.device)
    block = min(_pow2(n), 1024)
    if num_tokens:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(n, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), N=n, BLOCK=block)
    return out


# --------------------------------------------------------------------------- cache write
@triton.jit(do_not_specialize=["num_tokens"])
def _reshape_and_cache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_tokens,
                              stride_kt, stride_vt, ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        cols = tl.arange(0, ROW_PAD)
        m = cols < ROW
        k = tl.load(key_ptr + t * stride_kt + cols, mask=m)
        v = tl.load(value_ptr + t * stride_vt + cols, mask=m)
        dst = slot.to(tl.int64) * ROW + cols
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=m)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=m)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    row = k_cache.shape[2] * k_cache.shape[3]
    key = key.reshape(num_tokens, row)
    value = value.reshape(num_tokens, row)
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, num_tokens, key.stride(0), value.stride(0),
        ROW=row, ROW_PAD=_pow2(row))


# --------------------------------------------------------------------------- attention
@triton.jit(do_not_specialize=["scale", "stride_table"])
def _paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, query_start_ptr, seq_lens_ptr, scale,
        part_acc_ptr, part_ml_ptr, num_heads,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_table,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, DECODE: tl.constexpr, NUM_SPLITS: tl.constexpr,
        IEEE: tl.constexpr):
    """Program (seq, query block or key split, kv head): BLOCK_Q new tokens x the GROUP query
    heads sharing one KV head form the rows, so each K/V tile read through the block table
    serves them all. Decode with NUM_SPLITS > 1 (flash-decoding) gives each program one slice
    of the context and leaves unnormalised partials for ``_merge_splits_kernel``."""
    seq = tl.program_id(0)
    split = tl.program_id(1)
    kv_head = tl.program_id(2)
    ctx_len = tl.load(seq_lens_ptr + seq)
    if DECODE:
        q_start = seq
        q_len = 1
        q_block = 0
    else:
        q_start = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_start
        q_block = split
    if q_block * BLOCK_Q < q_len:
        rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
        tok = q_block * BLOCK_Q + rows // GROUP_PAD
        head = kv_head * GROUP + rows % GROUP_PAD
        row_ok = (tok < q_len) & (rows % GROUP_PAD < GROUP)
        pos = ctx_len - q_len + tok  # the new tokens are the sequence's last q_len positions
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        d_ok = offs_d < HEAD_DIM
        q_ptrs = (q_ptr + (q_start + tok).to(tl.int64)[:, None] * stride_qt
                  + head[:, None] * stride_qh + offs_d[None, :])
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
        # Causal: this query block sees keys up to its last token's position.
        end = tl.minimum(ctx_len, ctx_len - q_len + (q_block + 1) * BLOCK_Q)
        start = 0
        if NUM_SPLITS > 1:
            chunk = tl.cdiv(tl.cdiv(end, NUM_SPLITS), BLOCK_N) * BLOCK_N
            start = split * chunk
            end = tl.minimum(end, start + chunk)
        table = table_ptr + seq.to(tl.int64) * stride_table
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            key_ok = n < end
            block = tl.load(table + n // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
            off = n % BLOCK_SIZE
            kv_mask = key_ok[:, None] & d_ok[None, :]
            k = tl.load(k_cache_ptr + block[:, None] * stride_kb + off[:, None] * stride_ks
                        + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + block[:, None] * stride_vb + off[:, None] * stride_vs
                        + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale
            visible = row_ok[:, None] & key_ok[None, :] & (n[None, :] <= pos[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # Rows that have seen no key yet keep m = -inf; shift them by 0 to stay finite.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        if NUM_SPLITS > 1:
            part = (seq * num_heads + head).to(tl.int64) * NUM_SPLITS + split
            tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
            tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc,
                     mask=row_ok[:, None])
        else:
            acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            o_ptrs = (out_ptr + (q_start + tok).to(tl.int64)[:, None] * stride_ot
                      + head[:, None] * stride_oh + offs_d[None, :])
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits_kernel(out_ptr, part_acc_ptr, part_ml_ptr, num_heads, stride_ot, stride_oh,
                         NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                         HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """Combine one (seq, head)'s split partials: rescale each by exp(m_s - max m), then divide
    the summed accumulators by the summed denominators."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    part = (seq * num_heads + head).to(tl.int64) * NUM_SPLITS + sp
    ok = sp < NUM_SPLITS
    m = tl.load(part_ml_ptr + part * 2, mask=ok, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    denom = tl.sum(w * l_s, 0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + d[None, :], mask=ok[:, None],
                  other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + d,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _launch_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_start_loc: torch.Tensor | None,
                      seq_lens: torch.Tensor, scale: float, max_query_len: int,
                      block_q: int, group_pad: int, block_n: int, num_splits: int,
                      num_warps: int, num_stages: int) -> torch.Tensor:
    out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    d_pad = _pow2(head_dim, 16)
    if num_splits > 1:
        part_acc = torch.empty(num_seqs * heads * num_splits * d_pad, dtype=torch.float32,
                               device=q.device)
        part_ml = torch.empty(num_seqs * heads * num_splits * 2, dtype=torch.float32,
                              device=q.device)
        grid = (num_seqs, num_splits, kv_heads)
    else:
        part_acc = part_ml = out  # unused
        grid = (num_seqs, triton.cdiv(max_query_len, block_q), kv_heads)
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables,
        seq_lens if query_start_loc is None else query_start_loc, seq_lens, scale,
        part_acc, part_ml, heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=heads // kv_heads, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=block_n,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad, BLOCK_SIZE=k_cache.shape[1],
        DECODE=query_start_loc is None, NUM_SPLITS=num_splits, IEEE=q.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages)
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, heads)](
            out, part_acc, part_ml, heads, out.stride(0), out.stride(1), NUM_SPLITS=num_splits,
            SPLITS_PAD=_pow2(num_splits), HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad)
    return out


@functools.lru_cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_splits(num_seqs: int, kv_heads: int, device: torch.device) -> int:
    """common.step_sizes.decode_splits on this device (1 off the GPU)."""
    if device.type != "cuda":
        return 1
    return step_sizes.decode_splits(num_seqs, kv_heads, _num_sms(device.index or 0))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           *, num_splits: int | None = None,
                           block_n: int = step_sizes.DECODE_KEY_BLOCK,
                           num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    # tl.dot needs at least 16 rows: a lone query token pads its head group up to 16.
    group_pad = _pow2(q.shape[1] // k_cache.shape[2], 16)
    if num_splits is None:
        num_splits = decode_splits(q.shape[0], k_cache.shape[2], q.device)
    return _launch_attention(q, k_cache, v_cache, block_tables, None, seq_lens, scale,
                             max_query_len=1, block_q=1, group_pad=group_pad, block_n=block_n,
                             num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, max_query_len: int,
                            *, rows: int = 64, block_n: int = 32, num_warps: int = 4,
                            num_stages: int = 3) -> torch.Tensor:
    """``rows``: query rows (tokens x heads of one KV group) per program, a power of 2 >= 16."""
    group_pad = _pow2(q.shape[1] // k_cache.shape[2])
    block_q = max(rows // group_pad, 1)
    return _launch_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                             max_query_len, block_q=block_q, group_pad=group_pad, block_n=block_n,
                             num_splits=1, num_warps=num_warps, num_stages=num_stages)


# --------------------------------------------------------------------------- advance_step
@triton.jit(do_not_specialize=["num_seqs", "num_queries"])
def _advance_step_kernel(tokens_ptr, sampled_ptr, positions_ptr, seq_lens_ptr, slot_ptr,
                         table_ptr, num_seqs, num_queries, stride_table, stride_sampled,
                         BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    real = i < num_queries
    pad = (i >= num_queries) & (i < num_seqs)
    seq_len = tl.load(seq_lens_ptr + i, mask=real, other=0)
    sampled = tl.load(sampled_ptr + i * stride_sampled, mask=real, other=0)
    pos = seq_len.to(tl.int64)
    block = tl.load(table_ptr + i.to(tl.int64) * stride_table + pos // BLOCK_SIZE, mask=real,
                    other=0).to(tl.int64)
    slot = block * BLOCK_SIZE + pos % BLOCK_SIZE
    tl.store(tokens_ptr + i, tl.where(real, sampled, 0).to(tokens_ptr.dtype.element_ty),
             mask=real | pad)
    tl.store(positions_ptr + i, tl.where(real, pos, 0).to(positions_ptr.dtype.element_ty),
             mask=real | pad)
    tl.store(slot_ptr + i, tl.where(real, slot, -1).to(slot_ptr.dtype.element_ty),
             mask=real | pad)
    tl.store(seq_lens_ptr + i, seq_len + 1, mask=real)


def advance_step(num_seqs: int, num_queries: int, block_size: int, input_tokens: torch.Tensor,
                 sampled_token_ids: torch.Tensor, input_positions: torch.Tensor,
                 seq_lens: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor) -> None:
    if num_seqs == 0:
        return
    block = 256
    _advance_step_kernel[(triton.cdiv(num_seqs, block),)](
        input_tokens, sampled_token_ids, input_positions, seq_lens, slot_mapping, block_tables,
        num_seqs, num_queries, block_tables.stride(0),
        sampled_token_ids.stride(0) if sampled_token_ids.numel() else 1,
        BLOCK_SIZE=block_size, BLOCK=block)
