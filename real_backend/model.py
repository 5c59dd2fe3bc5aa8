"""The Llama decoder as plain tensors and functions: RMSNorm, RoPE, GQA attention, SwiGLU MLP."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from common.model_spec import ModelSpec
from real_backend.attention import AttentionMetadata, paged_attention
from real_backend.kernels import TORCH_KERNELS, Kernels
from real_backend.kv_cache import KVCache
from real_backend.ops import dense_causal_attention

if TYPE_CHECKING:
    from real_backend.tp_group import TPGroup


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]: q_proj, k_proj, v_proj stacked
    o: torch.Tensor  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]: gate_proj, up_proj stacked
    down: torch.Tensor  # [hidden, intermediate]


@dataclass(slots=True)
class Llama:
    """The weights of one rank: all of them, or with ``tp`` its tensor-parallel share, whose
    ``spec`` counts this rank's heads and MLP columns (real_backend/parallel.py)."""

    spec: ModelSpec
    embed: torch.Tensor  # [vocab, hidden]; with tp, this rank's vocabulary rows
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied
    rope: torch.Tensor  # [max_model_len, head_dim] fp32: cos of each frequency, then sin
    tp: TPGroup | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Inverse frequencies (fp64), with Llama-3's long-context rescaling when configured."""
    dim = spec.head_dim
    inv_freq = 1.0 / spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    scaling = spec.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind != "llama3":
        raise ValueError(f"model.rope_scaling.rope_type {kind!r} is not supported (llama3 only)")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in scaling]
    if missing:
        raise ValueError(f"model.rope_scaling (llama3) lacks {', '.join(missing)}")
    factor, low, high, old_len = (float(scaling[k]) for k in keys)
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (beyond the original context) are slowed by ``factor``, short ones kept,
    # and the band between them blends the two linearly in old_len / wavelen.
    smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def rope_table(spec: ModelSpec, device: torch.device | str) -> torch.Tensor:
    """[max_model_len, head_dim] fp32: each position's cos per frequency, then its sin."""
    pos = torch.arange(spec.max_model_len, dtype=torch.float64)
    angles = torch.outer(pos, rope_inv_freq(spec))
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float().to(device)


Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def layer_input(model: Llama, i: int, x: torch.Tensor, delta: torch.Tensor | None,
                positions: torch.Tensor, kernels: Kernels, qkv_out: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer i up to its attention: (q, k, v, x) with q/k rotated in place, x the residual stream
    with the previous layer's MLP output ``delta`` added (fused into the RMSNorm). ``qkv_out``:
    where the fused qkv projection is written (piecewise graphs' static buffer)."""
    spec, w = model.spec, model.layers[i]
    h, x = kernels.add_rms_norm(x, delta, w.input_norm, spec.rms_norm_eps)
    qkv = F.linear(h, w.qkv) if qkv_out is None else torch.matmul(h, w.qkv.t(), out=qkv_out)
    q, k, v = split_heads(spec, qkv)
    kernels.rotary_embedding(positions, q, k, model.rope)
    return q, k, v, x


def split_heads(spec: ModelSpec, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Views q [T, heads, D], k and v [T, kv_heads, D] of a fused qkv projection [T, ...]."""
    n, d = qkv.shape[0], spec.head_dim
    q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
    return q.view(n, -1, d), k.view(n, -1, d), v.view(n, -1, d)


def layer_output(model: Llama, i: int, x: torch.Tensor, attn: torch.Tensor,
                 kernels: Kernels) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer i after its attention (``attn`` [T, q_size]): (x, delta), the residual stream with
    the attention output added and the MLP's output, which the next norm adds."""
    w = model.layers[i]
    o = _row_parallel(model, F.linear(attn, w.o))
    h, x = kernels.add_rms_norm(x, o, w.post_norm, model.spec.rms_norm_eps)
    return x, _row_parallel(model, F.linear(kernels.silu_and_mul(F.linear(h, w.gate_up)), w.down))


def _row_parallel(model: Llama, partial: torch.Tensor) -> torch.Tensor:
    """A row-parallel projection's output: each rank's partial sum, summed over the ranks."""
    return partial if model.tp is None else model.tp.all_reduce(partial)


def embed(model: Llama, input_ids: torch.Tensor) -> torch.Tensor:
    """[T, hidden] embeddings; with tp each rank fills the rows of the ids in its vocabulary
    shard (zeros elsewhere) and an all-reduce puts them together."""
    if model.tp is None:
        return F.embedding(input_ids, model.embed)
    local = input_ids - model.tp.vocab_rows(model.spec)[0]
    outside = (local < 0) | (local >= model.embed.shape[0])
    x = F.embedding(local.masked_fill(outside, 0), model.embed)
    return model.tp.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0.0))


def final_norm(model: Llama, x: torch.Tensor, delta: torch.Tensor,
               kernels: Kernels) -> torch.Tensor:
    return kernels.add_rms_norm(x, delta, model.norm, model.spec.rms_norm_eps)[0]


def _decoder(model: Llama, input_ids: torch.Tensor, positions: torch.Tensor,
             attend: Attend, kernels: Kernels) -> torch.Tensor:
    """All layers over a flat token batch; ``attend(layer, q, k, v)`` supplies attention.

    Each residual add is fused into the RMSNorm that follows it, and q/k are rotated in place
    inside the fused qkv projection, so a layer is ten kernels on the Triton path.
    """
    n, q_size = input_ids.shape[0], model.spec.q_size
    x = embed(model, input_ids)
    delta = None  # the last layer's MLP output, added into x by the next norm
    for i in range(len(model.layers)):
        q, k, v, x = layer_input(model, i, x, delta, positions, kernels)
        x, delta = layer_output(model, i, x, attend(i, q, k, v).reshape(n, q_size), kernels)
    return final_norm(model, x, delta, kernels)


@dataclass(slots=True)
class PieceBuffers:
    """The static tensors of a piecewise step (rows: padded tokens). Piece 0 embeds
    ``input_ids``; piece i (1..L-1) runs layer i-1 after its attention (reading ``attn``) and
    layer i up to its attention; piece L ends layer L-1 and writes ``hidden``. Between pieces,
    attention reads q/k/v from ``qkv`` and writes ``attn``, eagerly (its shapes vary)."""

    input_ids: torch.Tensor  # [rows] int64
    positions: torch.Tensor  # [rows] int64
    x: torch.Tensor  # [rows, hidden]: the residual stream after the last piece
    qkv: torch.Tensor  # [rows, q_size + 2 kv_size]
    attn: torch.Tensor  # [rows, q_size]
    hidden: torch.Tensor  # [rows, hidden]: the final norm's output

    @classmethod
    def allocate(cls, spec: ModelSpec, rows: int, dtype: torch.dtype,
                 device: torch.device) -> PieceBuffers:
        # zeros: padding rows only ever hold finite values
        def buf(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dt, device=device)

        return cls(buf(rows, dt=torch.int64), buf(rows, dt=torch.int64),
                   buf(rows, spec.hidden_size), buf(rows, spec.q_size + 2 * spec.kv_size),
                   buf(rows, spec.q_size), buf(rows, spec.hidden_size))


def decoder_piece(model: Llama, bufs: PieceBuffers, i: int, tokens: int, kernels: Kernels) -> None:
    """Piece i of the L + 1 of a step over the buffers' first ``tokens`` rows (see PieceBuffers):
    what a piecewise CUDA graph captures."""
    num_layers = len(model.layers)
    if i == 0:
        x, delta = embed(model, bufs.input_ids[:tokens]), None
    else:
        x, delta = layer_output(model, i - 1, bufs.x[:tokens], bufs.attn[:tokens], kernels)
    if i == num_layers:
        bufs.hidden[:tokens].copy_(final_norm(model, x, delta, kernels))
        return
    x = layer_input(model, i, x, delta, bufs.positions[:tokens], kernels, bufs.qkv[:tokens])[3]
    bufs.x[:tokens].copy_(x)


def forward_piecewise(model: Llama, bufs: PieceBuffers, n: int, meta: AttentionMetadata,
                      kv_cache: KVCache, kernels: Kernels,
                      run_piece: Callable[[int], None]) -> torch.Tensor:
    """Hidden states [n, hidden] of the flat batch whose ids and positions fill the buffers'
    first n rows: ``run_piece(i)`` runs piece i (a graph replay at a padded size, or
    ``decoder_piece`` itself); attention runs in between over the n real rows only, so padding
    rows write no KV and their outputs are never read."""
    spec = model.spec
    scale = spec.head_dim ** -0.5
    for i in range(len(model.layers) + 1):
        run_piece(i)
        if i < len(model.layers):
            q, k, v = split_heads(spec, bufs.qkv[:n])
            out = paged_attention(q, k, v, kv_cache.k[i], kv_cache.v[i], meta, kernels, scale)
            bufs.attn[:n].copy_(out.reshape(n, spec.q_size))
    return bufs.hidden[:n]


def forward(model: Llama, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata, kv_cache: KVCache, kernels: Kernels) -> torch.Tensor:
    """Hidden states [T, hidden] of a flat batch (prefill rows, then decode rows), writing
    each token's K/V into the paged cache at ``meta.slot_mapping``."""
    scale = model.spec.head_dim ** -0.5

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return paged_attention(q, k, v, kv_cache.k[i], kv_cache.v[i], meta, kernels, scale)

    return _decoder(model, input_ids, positions, attend, kernels)


def compute_logits(model: Llama, hidden: torch.Tensor,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 logits [N, vocab]; with tp each rank's vocabulary columns, gathered on every rank.
    ``out`` [N, vocab] fp32 receives them: CUDA graphs of every padded size write one shared
    buffer rather than each keeping an output of its own in the graph pool."""
    logits = F.linear(hidden, model.lm_head)
    if model.tp is not None:
        logits = model.tp.gather_vocab(logits, model.spec.vocab_size)
    if out is None:
        return logits.float()
    return out.copy_(logits)


def forward_dense(model: Llama, token_ids: torch.Tensor) -> torch.Tensor:
    """Logits [L, vocab] of one whole sequence recomputed from scratch, with no KV cache: the
    oracle every cached path must agree with."""
    scale = model.spec.head_dim ** -0.5
    positions = torch.arange(token_ids.shape[0], device=token_ids.device)

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dense_causal_attention(q, k, v, scale)

    return compute_logits(model, _decoder(model, token_ids, positions, attend, TORCH_KERNELS))
