"""PyTorch reference implementations of the engine's hot ops (the CPU path and the kernels' oracle).

Every op here has a Triton twin in ``real_backend.triton_ops`` with the same signature; tests
hold the two equal. Layouts (vLLM's flash-attn layout):

- ``k_cache`` / ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``
- ``slot_mapping[t]``: flat slot ``block * block_size + offset`` of token t, ``-1`` = padding
- ``block_tables``: ``[num_seqs, max_blocks_per_seq]`` int32
- ``seq_lens[i]``: tokens of sequence i whose KV is in the cache once this step's are written
"""

from __future__ import annotations

import torch

PAD_SLOT_ID = -1


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual update and the next RMSNorm in one op: s = x + delta (in x's dtype, as the
    residual stream is stored); returns (rms_norm(s) * weight, s). ``delta`` None: s = x."""
    s = x if delta is None else x + delta
    sf = s.float()
    normed = (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed.float() * weight.float()).to(x.dtype), s


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     rope: torch.Tensor) -> None:
    """Rotate-half RoPE (the Hugging Face Llama layout) applied in place to q [T, heads, D] and
    k [T, kv_heads, D]; ``rope`` [max_pos, D] holds each position's cos, then sin. Positions
    past the table (steps a window runs after a request's end, whose outputs are discarded)
    reuse its last row."""
    rows = rope[positions.clamp(max=rope.shape[0] - 1)][:, None, :]
    half = q.shape[-1] // 2
    cos, sin = rows[..., :half], rows[..., half:]
    for x in (q, k):
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        x.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: silu(gate) * up from the fused [T, 2 * intermediate] projection."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each token's K and V ([T, kv_heads, head_dim]) into its cache slot; skip slot -1."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, kv_heads, head_dim)[slots] = key[valid].to(k_cache.dtype)
    v_cache.view(-1, kv_heads, head_dim)[slots] = value[valid].to(v_cache.dtype)


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor,
                   length: int) -> torch.Tensor:
    """Read positions 0..length-1 of every row's sequence: [num_seqs, length, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blocks = block_tables[:, pos // block_size].long()  # [S, L]
    slots = blocks * block_size + pos % block_size
    return cache.view(-1, cache.shape[2], cache.shape[3])[slots]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
            scale: float) -> torch.Tensor:
    """Masked GQA attention in fp32. q [S, M, H, D]; k, v [S, L, KVH, D]; mask [S, M, L]."""
    group = q.shape[2] // k.shape[2]
    k = k.float().repeat_interleave(group, dim=2)
    v = v.float().repeat_interleave(group, dim=2)
    scores = torch.einsum("smhd,slhd->shml", q.float(), k) * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # A row with no key at all (padding, seq_len 0) gives NaN from softmax; it must read as 0.
    probs = torch.nan_to_num(probs, nan=0.0)
    return torch.einsum("shml,slhd->smhd", probs, v)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One query token per sequence ([B, heads, head_dim]) over its first seq_lens[i] cached
    tokens; rows with seq_lens 0 (CUDA-graph padding) give zeros."""
    max_len = int(seq_lens.max()) if seq_lens.numel() else 0
    if max_len == 0:
        return torch.zeros_like(q)
    k = gather_context(k_cache, block_tables, max_len)
    v = gather_context(v_cache, block_tables, max_len)
    mask = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None]
    return _attend(q[:, None], k, v, mask[:, None, :], scale)[:, 0].to(q.dtype)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float,
                            max_query_len: int) -> torch.Tensor:
    """Causal attention of each sequence's new tokens (q: [T, heads, head_dim], sequences
    concatenated per ``query_start_loc``) over its cached prefix plus the new tokens, all read
    from the paged cache; the new tokens sit at positions seq_len - query_len .. seq_len - 1."""
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, ctx_len in enumerate(lens):
        a, b = starts[i], starts[i + 1]
        if b == a:
            continue
        k = gather_context(k_cache, block_tables[i:i + 1], ctx_len)
        v = gather_context(v_cache, block_tables[i:i + 1], ctx_len)
        pos = torch.arange(ctx_len - (b - a), ctx_len, device=q.device)
        mask = torch.arange(ctx_len, device=q.device)[None, :] <= pos[:, None]
        out[a:b] = _attend(q[None, a:b], k, v, mask[None], scale)[0].to(q.dtype)
    return out


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Plain causal GQA attention of one whole sequence, no cache: q [L, heads, D], k/v [L, kvh, D]."""
    n = q.shape[0]
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return _attend(q[None], k[None], v[None], mask[None], scale)[0].to(q.dtype)


def advance_step(num_seqs: int, num_queries: int, block_size: int, input_tokens: torch.Tensor,
                 sampled_token_ids: torch.Tensor, input_positions: torch.Tensor,
                 seq_lens: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor) -> None:
    """Turn the last step's samples into the next decode step's inputs, in place.

    Rows i < num_queries: token = sampled[i], position = seq_lens[i] (old), seq_lens += 1, slot
    of the new position from the block table. Rows num_queries <= i < num_seqs are CUDA-graph
    padding: token 0, position 0, slot -1.
    """
    q = num_queries
    pos = seq_lens[:q].to(input_positions.dtype)
    input_tokens[:q] = sampled_token_ids.reshape(-1)[:q].to(input_tokens.dtype)
    input_positions[:q] = pos
    seq_lens[:q] += 1
    rows = torch.arange(q, device=pos.device)
    block = block_tables[rows, pos // block_size].to(slot_mapping.dtype)
    slot_mapping[:q] = block * block_size + pos % block_size
    input_tokens[q:num_seqs] = 0
    input_positions[q:num_seqs] = 0
    slot_mapping[q:num_seqs] = PAD_SLOT_ID
