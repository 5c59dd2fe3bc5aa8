"""The Llama model: RoPE scaling, paged forward against the no-cache oracle, weights I/O."""

from __future__ import annotations

import json
import math
from functools import partial

import pytest
import torch
from rb_util import load_spec
from safetensors.torch import load_file, save_file

from real_backend.attention import AttentionMetadata, DecodeMetadata, PrefillMetadata
from real_backend.kernels import select_kernels
from real_backend.kv_cache import allocate_kv_cache, block_bytes
from real_backend.model import (
    PieceBuffers,
    compute_logits,
    decoder_piece,
    forward,
    forward_dense,
    forward_piecewise,
    rope_inv_freq,
)
from real_backend.weights import load_hf_model, random_model, save_hf_model


def _hf_llama3_inv_freq(base: float, dim: int, s: dict) -> list[float]:
    """Hugging Face's _compute_llama3_parameters, written as its branchy loop."""
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    out = []
    for i in range(0, dim, 2):
        freq = 1.0 / base ** (i / dim)
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(freq)
        elif wavelen > low_wavelen:
            out.append(freq / s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"])
            out.append((1 - smooth) * freq / s["factor"] + smooth * freq)
    return out


@pytest.mark.parametrize("name", ["tiny", "llama3_2_1b"])
def test_llama3_rope_scaling_matches_hf(name: str) -> None:
    spec = load_spec(name)
    expect = _hf_llama3_inv_freq(spec.rope_theta, spec.head_dim, spec.rope_scaling)
    got = rope_inv_freq(spec)
    assert got.tolist() == pytest.approx(expect, rel=1e-12)
    plain = rope_inv_freq(load_spec(name, rope_scaling=None))
    assert (plain >= got).all() and (plain > got).any()  # scaling only ever slows rotation


def test_bad_rope_scaling_is_one_line_error() -> None:
    with pytest.raises(ValueError, match="model.rope_scaling.rope_type 'yarn'"):
        rope_inv_freq(load_spec("tiny", rope_scaling={"rope_type": "yarn", "factor": 2.0}))
    with pytest.raises(ValueError, match="lacks low_freq_factor, high_freq_factor"):
        rope_inv_freq(load_spec("tiny", rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}))


@pytest.mark.parametrize("path", ["eager", "piecewise"])
def test_chunked_paged_forward_matches_dense(path: str) -> None:
    """Prefill in three chunks (each reading the cached prefix), then two decodes, batched with a
    second sequence: every sampled position's logits equal the no-cache forward's. ``piecewise``
    runs each step as the pieces a piecewise CUDA graph captures, padded to 32 rows whose
    padding holds garbage: padding must neither reach the real rows nor write the cache."""
    spec = load_spec("tiny")
    model = random_model(spec, "cpu", torch.float32, seed=3)
    kernels = select_kernels("torch")
    bs = 4
    cache = allocate_kv_cache(spec, 32, bs, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    seq_a = torch.randint(0, spec.vocab_size, (23,), generator=g)
    seq_b = torch.randint(0, spec.vocab_size, (9,), generator=g)
    table_a = torch.tensor([5, 17, 2, 9, 30, 11, 0], dtype=torch.int32)
    table_b = torch.tensor([21, 4, 8], dtype=torch.int32)
    dense_a, dense_b = forward_dense(model, seq_a), forward_dense(model, seq_b)

    def piece(bufs: PieceBuffers, i: int) -> None:  # every step padded to 32 rows
        decoder_piece(model, bufs, i, 32, kernels)

    def slots(table, pos):
        return table[pos // bs].long() * bs + pos % bs

    # step 1: prefill a[0:8] and all of b; step 2: a[8:20] over its cached prefix; then a
    # decodes positions 20, 21, 22.
    plan = [[(0, 8), (None, 9)], [(8, 20)], [(20, 21)], [(21, 22)], [(22, 23)]]
    for step in plan:
        pre = [(seq_a, table_a, a, b) for a, b in step if a is not None and b - a > 1]
        pre += [(seq_b, table_b, 0, n) for a, n in step if a is None]
        dec = [(seq_a, table_a, a, b) for a, b in step if a is not None and b - a == 1]
        rows = pre + dec
        ids = torch.cat([s[a:b] for s, _, a, b in rows])
        pos = torch.cat([torch.arange(a, b) for _, _, a, b in rows])
        slot = torch.cat([slots(t, torch.arange(a, b)) for _, t, a, b in rows])
        lens = [b - a for _, _, a, b in pre]
        starts = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).int()
        width = 7
        tables = [torch.nn.functional.pad(t, (0, width - len(t))) for _, t, _, _ in rows]
        prefill = PrefillMetadata(starts, torch.tensor([b for _, _, _, b in pre]).int(),
                                  torch.stack(tables[:len(pre)]), max(lens)) if pre else None
        decode = DecodeMetadata(torch.tensor([b for _, _, _, b in dec]).int(),
                                torch.stack(tables[len(pre):])) if dec else None
        meta = AttentionMetadata(slot, sum(lens), prefill, decode)
        if path == "eager":
            hidden = forward(model, ids, pos, meta, cache, kernels)
        else:
            n = len(ids)
            bufs = PieceBuffers.allocate(spec, 40, torch.float32, "cpu")
            for b in (bufs.x, bufs.qkv, bufs.attn, bufs.hidden):
                b.normal_(generator=g)
            bufs.input_ids.random_(0, spec.vocab_size, generator=g)
            bufs.positions.random_(0, 64, generator=g)
            bufs.input_ids[:n], bufs.positions[:n] = ids, pos
            hidden = forward_piecewise(model, bufs, n, meta, cache, kernels,
                                       partial(piece, bufs))
        logits = compute_logits(model, hidden)
        at = 0
        for s, _, a, b in rows:
            oracle = dense_a if s is seq_a else dense_b
            torch.testing.assert_close(logits[at:at + b - a], oracle[a:b], atol=1e-4, rtol=1e-4)
            at += b - a


def test_random_bf16_model_stays_finite_when_deep() -> None:
    spec = load_spec("tiny", num_layers=32, hidden_size=256, num_heads=8, num_kv_heads=2,
                     head_dim=32, intermediate_size=768)
    model = random_model(spec, "cpu", torch.bfloat16, seed=1)
    logits = forward_dense(model, torch.arange(32) % spec.vocab_size)
    assert torch.isfinite(logits).all()
    assert 0.3 < logits.std().item() < 3.0


@pytest.mark.parametrize("tied", [False, True])
def test_hf_checkpoint_round_trip(tmp_path, tied: bool) -> None:
    spec = load_spec("tiny", tie_word_embeddings=tied)
    model = random_model(spec, "cpu", torch.float32, seed=7)
    save_hf_model(model, tmp_path, num_shards=2)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    assert ("lm_head.weight" in index["weight_map"]) is not tied
    loaded = load_hf_model(spec, tmp_path, "cpu", torch.float32)
    ids = torch.arange(30) * 7 % spec.vocab_size
    assert torch.equal(forward_dense(model, ids), forward_dense(loaded, ids))
    if tied:
        assert loaded.lm_head is loaded.embed


def test_hf_checkpoint_errors(tmp_path) -> None:
    spec = load_spec("tiny")
    save_hf_model(random_model(spec, "cpu", torch.float32), tmp_path, num_shards=2)
    with pytest.raises(ValueError, match="config.json has hidden_size 128 but model tiny2"):
        load_hf_model(load_spec("tiny", name="tiny2", hidden_size=256), tmp_path, "cpu",
                      torch.float32)
    shard = tmp_path / "model-00001-of-00002.safetensors"
    tensors = load_file(str(shard))
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    save_file(tensors, str(shard))
    with pytest.raises(ValueError, match=f"lacks 1 tensors, e.g. {dropped}"):
        load_hf_model(spec, tmp_path, "cpu", torch.float32)
    with pytest.raises(ValueError, match="has no config.json"):
        load_hf_model(spec, tmp_path / "nowhere", "cpu", torch.float32)


def test_block_bytes() -> None:
    spec = load_spec("llama3_8b")
    # 2 (K, V) x 32 layers x 16 tokens x 8 heads x 128 dims x 2 bytes = 2 MiB per block
    assert block_bytes(spec, 16, torch.bfloat16) == 2 * 1024 * 1024
    assert block_bytes(spec, 16, torch.bfloat16) == 16 * spec.kv_bytes_per_token
