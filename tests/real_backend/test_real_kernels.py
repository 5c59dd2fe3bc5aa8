"""Every Triton kernel equals its PyTorch reference on random paged layouts (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
from rb_util import DEVICE

from real_backend import ops
from real_backend import triton_ops as tri

# The case number picks the structured variants (GQA ratio, head size and block size repeat
# every 6 cases, decode's key splits every 4, a 5-way split at case % 9 == 1, no residual
# every 4th norm), its seed the sizes: 24 cases meet every combination of those at least twice,
# each time with other random sizes, padding rows and cached prefixes.
CASES = range(24)
GQA = (1, 4, 8)


def _layout(g: torch.Generator, num_seqs: int, lens: list[int], block_size: int):
    """A cache with blocks handed out in random order, so block tables are non-contiguous."""
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(need + [1]) + 1
    tables = torch.zeros(num_seqs, width, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(perm[at:at + n], dtype=torch.int32)
        at += n
    return num_blocks, tables


def _shape(case: int):
    g = torch.Generator().manual_seed(1000 + case)
    ratio = GQA[case % 3]
    kv_heads = int(torch.randint(1, 3, (), generator=g))
    head_dim = (16, 32)[case % 2]
    block_size = (4, 8, 16)[(case // 2) % 3]
    return g, ratio, kv_heads, head_dim, block_size


def _cache(g, num_blocks, block_size, kv_heads, head_dim, dtype=torch.float32):
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return (torch.randn(shape, generator=g).to(DEVICE, dtype),
            torch.randn(shape, generator=g).to(DEVICE, dtype))


@pytest.mark.parametrize("case", CASES)
def test_add_rms_norm(case: int) -> None:
    g = torch.Generator().manual_seed(4000 + case)
    rows = int(torch.randint(1, 9, (), generator=g))
    hidden = int(torch.randint(1, 300, (), generator=g))
    x = torch.randn(rows, hidden, generator=g).to(DEVICE)
    delta = None if case % 4 == 0 else torch.randn(rows, hidden, generator=g).to(DEVICE)
    weight = torch.randn(hidden, generator=g).to(DEVICE)
    ref_out, ref_sum = ops.add_rms_norm(x, delta, weight, 1e-5)
    out, total = tri.add_rms_norm(x, delta, weight, 1e-5)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(total, ref_sum, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_rotary_embedding(case: int) -> None:
    """In place on q and k viewed inside one fused qkv row, as the model calls it."""
    g, ratio, kv_heads, head_dim, _ = _shape(case)
    tokens, heads, max_pos = int(torch.randint(1, 12, (), generator=g)), kv_heads * ratio, 64
    rope = torch.randn(max_pos, head_dim, generator=g).to(DEVICE)
    # positions past the table (wasted multi-step slots) read its last row
    positions = torch.randint(0, max_pos + 8, (tokens,), generator=g).to(DEVICE)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(DEVICE)
    results = []
    for impl in (ops.rotary_embedding, tri.rotary_embedding):
        buf = qkv.clone()
        q, k, v = buf.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        impl(positions, q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), rope)
        results.append(buf)
    torch.testing.assert_close(results[1], results[0], atol=1e-5, rtol=1e-5)
    v_cols = slice((heads + kv_heads) * head_dim, None)
    assert torch.equal(results[1][:, v_cols], qkv[:, v_cols])


@pytest.mark.parametrize("case", CASES)
def test_silu_and_mul(case: int) -> None:
    g = torch.Generator().manual_seed(5000 + case)
    rows = int(torch.randint(1, 9, (), generator=g))
    inter = int(torch.randint(1, 1500, (), generator=g))
    gate_up = (3 * torch.randn(rows, 2 * inter, generator=g)).to(DEVICE)
    torch.testing.assert_close(tri.silu_and_mul(gate_up), ops.silu_and_mul(gate_up),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_reshape_and_cache(case: int) -> None:
    g, _, kv_heads, head_dim, block_size = _shape(case)
    num_blocks = int(torch.randint(2, 8, (), generator=g))
    num_tokens = int(torch.randint(1, num_blocks * block_size + 1, (), generator=g))
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.25] = -1  # padding rows write nothing
    key = torch.randn(num_tokens, kv_heads, head_dim, generator=g).to(DEVICE)
    value = torch.randn(num_tokens, kv_heads, head_dim, generator=g).to(DEVICE)
    k_ref, v_ref = _cache(g, num_blocks, block_size, kv_heads, head_dim)
    k_tri, v_tri = k_ref.clone(), v_ref.clone()
    slots = slots.to(DEVICE)
    ops.reshape_and_cache(key, value, k_ref, v_ref, slots)
    tri.reshape_and_cache(key, value, k_tri, v_tri, slots)
    assert torch.equal(k_ref, k_tri) and torch.equal(v_ref, v_tri)
    valid = slots >= 0
    assert torch.equal(k_ref.view(-1, kv_heads, head_dim)[slots[valid]], key[valid])


@pytest.mark.parametrize("case", CASES)
def test_paged_decode_attention(case: int) -> None:
    g, ratio, kv_heads, head_dim, block_size = _shape(case)
    num_seqs = int(torch.randint(1, 5, (), generator=g))
    lens = torch.randint(1, 5 * block_size, (num_seqs,), generator=g)
    lens[torch.rand(num_seqs, generator=g) < 0.2] = 0  # CUDA-graph padding rows
    num_blocks, tables = _layout(g, num_seqs, lens.tolist(), block_size)
    k_cache, v_cache = _cache(g, num_blocks, block_size, kv_heads, head_dim)
    q = torch.randn(num_seqs, kv_heads * ratio, head_dim, generator=g).to(DEVICE)
    args = (q, k_cache, v_cache, tables.to(DEVICE), lens.int().to(DEVICE), head_dim ** -0.5)
    ref = ops.paged_decode_attention(*args)
    # Every fourth case in one piece; the rest split the keys (flash-decoding) 2 to 5 ways.
    out = tri.paged_decode_attention(*args, block_n=16, num_splits=1 + case % 4 + (case % 9 == 1))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    assert torch.all(out[lens.to(DEVICE) == 0] == 0)


@pytest.mark.parametrize("case", CASES)
def test_paged_prefill_attention(case: int) -> None:
    g, ratio, kv_heads, head_dim, block_size = _shape(case)
    num_seqs = int(torch.randint(1, 4, (), generator=g))
    q_lens = torch.randint(1, 20, (num_seqs,), generator=g)
    cached = torch.randint(0, 3 * block_size, (num_seqs,), generator=g)
    cached[torch.rand(num_seqs, generator=g) < 0.3] = 0  # a first chunk has no prefix
    lens = q_lens + cached
    num_blocks, tables = _layout(g, num_seqs, lens.tolist(), block_size)
    k_cache, v_cache = _cache(g, num_blocks, block_size, kv_heads, head_dim)
    starts = torch.zeros(num_seqs + 1, dtype=torch.int32)
    starts[1:] = q_lens.cumsum(0)
    q = torch.randn(int(starts[-1]), kv_heads * ratio, head_dim, generator=g).to(DEVICE)
    args = (q, k_cache, v_cache, tables.to(DEVICE), starts.to(DEVICE), lens.int().to(DEVICE),
            head_dim ** -0.5, int(q_lens.max()))
    ref = ops.paged_prefill_attention(*args)
    out = tri.paged_prefill_attention(*args, rows=(16, 32)[case % 2], block_n=16)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_advance_step(case: int) -> None:
    g = torch.Generator().manual_seed(3000 + case)
    block_size = (4, 8, 16)[case % 3]
    num_seqs = int(torch.randint(1, 12, (), generator=g))
    num_queries = int(torch.randint(0, num_seqs + 1, (), generator=g))
    lens = torch.randint(0, 6 * block_size, (num_seqs,), generator=g)
    num_blocks, tables = _layout(g, num_seqs, (lens + 1).tolist(), block_size)
    state = {
        "input_tokens": torch.randint(0, 100, (num_seqs,), generator=g),
        "input_positions": torch.randint(0, 100, (num_seqs,), generator=g),
        "seq_lens": lens.int(),
        "slot_mapping": torch.randint(0, 100, (num_seqs,), generator=g),
    }
    sampled = torch.randint(0, 1000, (num_queries,), generator=g).to(DEVICE)
    ref = {k: v.to(DEVICE) for k, v in state.items()}
    out = {k: v.to(DEVICE) for k, v in state.items()}
    tables = tables.to(DEVICE)
    for impl, st in ((ops.advance_step, ref), (tri.advance_step, out)):
        impl(num_seqs, num_queries, block_size, st["input_tokens"], sampled,
             st["input_positions"], st["seq_lens"], st["slot_mapping"], tables)
    for k in state:
        assert torch.equal(ref[k], out[k]), k


def test_advance_step_semantics() -> None:
    """The flash-attn semantics, written out by hand: two real rows, one padding row."""
    block_size = 4
    tables = torch.tensor([[7, 3, 0], [5, 9, 2], [1, 1, 1]], dtype=torch.int32)
    tokens = torch.tensor([11, 12, 13])
    positions = torch.tensor([2, 3, 9])
    seq_lens = torch.tensor([3, 4, 9], dtype=torch.int32)  # row 1 crosses into its 2nd block
    slots = torch.tensor([30, 23, 4])
    sampled = torch.tensor([[40], [41]])
    for impl in (ops.advance_step, tri.advance_step):
        t, p, s, m = (x.clone().to(DEVICE) for x in (tokens, positions, seq_lens, slots))
        impl(3, 2, block_size, t, sampled.to(DEVICE), p, s, m, tables.to(DEVICE))
        assert t.tolist() == [40, 41, 0]
        assert p.tolist() == [3, 4, 0]
        assert s.tolist() == [4, 5, 9]  # padding rows keep their seq_lens
        assert m.tolist() == [7 * 4 + 3, 9 * 4 + 0, -1]


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 tensor-core paths need a GPU")
@pytest.mark.parametrize("ratio", GQA)
def test_attention_bf16_default_tiles(ratio: int) -> None:
    g = torch.Generator().manual_seed(ratio)
    block_size, kv_heads, head_dim = 16, 2, 128
    lens = torch.tensor([1, 17, 300, 0, 1000])
    num_blocks, tables = _layout(g, 5, lens.tolist(), block_size)
    k_cache, v_cache = _cache(g, num_blocks, block_size, kv_heads, head_dim, torch.bfloat16)
    q = torch.randn(5, kv_heads * ratio, head_dim, generator=g).to(DEVICE, torch.bfloat16)
    args = (q, k_cache, v_cache, tables.to(DEVICE), lens.int().to(DEVICE), head_dim ** -0.5)
    torch.testing.assert_close(tri.paged_decode_attention(*args),
                               ops.paged_decode_attention(*args), atol=2e-2, rtol=2e-2)
    q_lens = torch.tensor([1, 17, 200, 0, 513])
    starts = torch.zeros(6, dtype=torch.int32)
    starts[1:] = q_lens.cumsum(0)
    q = torch.randn(int(starts[-1]), kv_heads * ratio, head_dim, generator=g).to(
        DEVICE, torch.bfloat16)
    args = (q, k_cache, v_cache, tables.to(DEVICE), starts.to(DEVICE), lens.int().to(DEVICE),
            head_dim ** -0.5, 513)
    torch.testing.assert_close(tri.paged_prefill_attention(*args),
                               ops.paged_prefill_attention(*args), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 rounding paths run on the GPU")
def test_elementwise_bf16_llama3_8b_shapes() -> None:
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    x, delta = (torch.randn(300, 4096, generator=g).to(DEVICE, bf) for _ in range(2))
    w = torch.rand(4096, generator=g).to(DEVICE, bf)
    for got, want in zip(tri.add_rms_norm(x, delta, w, 1e-5), ops.add_rms_norm(x, delta, w, 1e-5),
                         strict=True):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    gate_up = torch.randn(300, 2 * 14336, generator=g).to(DEVICE, bf)
    torch.testing.assert_close(tri.silu_and_mul(gate_up), ops.silu_and_mul(gate_up),
                               atol=2e-2, rtol=2e-2)
    rope = torch.randn(8192, 128, generator=g).to(DEVICE)
    qkv = torch.randn(300, 48 * 128, generator=g).to(DEVICE, bf)
    pos = torch.randint(0, 8192, (300,), generator=g).to(DEVICE)
    out = []
    for impl in (ops.rotary_embedding, tri.rotary_embedding):
        buf = qkv.clone()
        q, k, _ = buf.split([4096, 1024, 1024], -1)
        impl(pos, q.view(300, 32, 128), k.view(300, 8, 128), rope)
        out.append(buf)
    torch.testing.assert_close(out[1], out[0], atol=2e-2, rtol=2e-2)


def test_decode_splits_use_the_shared_rule_on_the_gpu_only(monkeypatch) -> None:
    """The engine splits keys by common.step_sizes (which the simulator prices) on CUDA, with
    the device's multiprocessor count; off the GPU it never splits."""
    from common.step_sizes import decode_splits as shared

    monkeypatch.setattr(tri, "_num_sms", lambda index: 8)
    for seqs in (1, 3, 8, 16, 33, 64, 256):
        assert tri.decode_splits(seqs, 8, torch.device("cuda", 0)) == shared(seqs, 8, 8)
        assert tri.decode_splits(seqs, 8, torch.device("cpu")) == 1
