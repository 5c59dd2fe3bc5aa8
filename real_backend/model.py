"""The Llama decoder as plain tensors and functions: RMSNorm, RoPE, GQA attention, SwiGLU MLP."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from policies.model_spec import ModelSpec
from real_backend.attention import AttentionMetadata, paged_attention
from real_backend.kernels import TORCH_KERNELS, Kernels
from real_backend.kv_cache import KVCache
from real_backend.ops import dense_causal_attention


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
    spec: ModelSpec
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied
    rope: torch.Tensor  # [max_model_len, head_dim] fp32: cos of each frequency, then sin

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


def _decoder(model: Llama, input_ids: torch.Tensor, positions: torch.Tensor,
             attend: Attend, kernels: Kernels) -> torch.Tensor:
    """All layers over a flat token batch; ``attend(layer, q, k, v)`` supplies attention.

    Each residual add is fused into the RMSNorm that follows it, and q/k are rotated in place
    inside the fused qkv projection, so a layer is ten kernels on the Triton path.
    """
    spec = model.spec
    n, eps, d = input_ids.shape[0], spec.rms_norm_eps, spec.head_dim
    x = F.embedding(input_ids, model.embed)
    delta = None  # the last layer's MLP output, added into x by the next norm
    for i, w in enumerate(model.layers):
        h, x = kernels.add_rms_norm(x, delta, w.input_norm, eps)
        q, k, v = F.linear(h, w.qkv).split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
        q, k, v = q.view(n, -1, d), k.view(n, -1, d), v.view(n, -1, d)
        kernels.rotary_embedding(positions, q, k, model.rope)
        out = attend(i, q, k, v)
        h, x = kernels.add_rms_norm(x, F.linear(out.reshape(n, spec.q_size), w.o),
                                    w.post_norm, eps)
        delta = F.linear(kernels.silu_and_mul(F.linear(h, w.gate_up)), w.down)
    return kernels.add_rms_norm(x, delta, model.norm, eps)[0]


def forward(model: Llama, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata, kv_cache: KVCache, kernels: Kernels) -> torch.Tensor:
    """Hidden states [T, hidden] of a flat batch (prefill rows, then decode rows), writing
    each token's K/V into the paged cache at ``meta.slot_mapping``."""
    scale = model.spec.head_dim ** -0.5

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return paged_attention(q, k, v, kv_cache.k[i], kv_cache.v[i], meta, kernels, scale)

    return _decoder(model, input_ids, positions, attend, kernels)


def compute_logits(model: Llama, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden, model.lm_head).float()


def forward_dense(model: Llama, token_ids: torch.Tensor) -> torch.Tensor:
    """Logits [L, vocab] of one whole sequence recomputed from scratch, with no KV cache: the
    oracle every cached path must agree with."""
    scale = model.spec.head_dim ** -0.5
    positions = torch.arange(token_ids.shape[0], device=token_ids.device)

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dense_causal_attention(q, k, v, scale)

    return compute_logits(model, _decoder(model, token_ids, positions, attend, TORCH_KERNELS))
