"""How close one decode step gets to its memory floor on this GPU (llama3_8b shape, random bf16).

Scenario: 256 sequences decode one token each over ~500-token contexts. A decode step must read
every weight once (the linear layers) and every sequence's K/V (attention), so its floor is
about the linear layers' time plus the time to move the KV bytes. Prints the three times:

    decode step   the whole step (CUDA graph replay: embeddings to logits)
    linears       the same step's matrix multiplies alone (graph replay)
    kv read       the step's KV bytes over the device-to-device copy bandwidth (bytes read
                  plus bytes written per second, measured on a 2 GiB copy)

and the ratio decode / (linears + kv read). Run: python benchmarks/decode_floor.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.model_spec import ModelSpec  # noqa: E402
from real_backend.attention import AttentionMetadata, DecodeMetadata  # noqa: E402
from real_backend.kernels import select_kernels  # noqa: E402
from real_backend.kv_cache import allocate_kv_cache  # noqa: E402
from real_backend.model import compute_logits, forward  # noqa: E402
from real_backend.weights import random_model  # noqa: E402

MODEL = "llama3_8b"
BATCH = 256
CONTEXT = 500
BLOCK_SIZE = 16
COPY_BYTES = 2 * 1024**3  # the measured copy; its time is scaled to the step's KV bytes


def time_graph(fn, iters: int = 20) -> float:
    """Seconds per call of ``fn`` replayed from a CUDA graph (launch overhead excluded)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--context", type=int, default=CONTEXT)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_floor needs a CUDA GPU")
    root = Path(__file__).resolve().parents[1]
    spec = ModelSpec.from_dict(yaml.safe_load((root / "conf/model" / f"{MODEL}.yaml").read_text()))
    dev = torch.device("cuda")
    torch.manual_seed(0)
    b, ctx = args.batch, args.context
    with torch.inference_mode():
        model = random_model(spec, dev, torch.bfloat16, seed=0)
        blocks_per_seq = -(-(ctx + 1) // BLOCK_SIZE)
        cache = allocate_kv_cache(spec, b * blocks_per_seq, BLOCK_SIZE, torch.bfloat16, dev)
        for t in cache.k + cache.v:
            t.normal_()
        # Each sequence owns a shuffled run of blocks, as a block manager would hand them out.
        tables = torch.randperm(b * blocks_per_seq, device=dev).view(b, blocks_per_seq).int()
        seq_lens = torch.full((b,), ctx + 1, dtype=torch.int32, device=dev)
        positions = torch.full((b,), ctx, dtype=torch.int64, device=dev)
        slots = tables[:, ctx // BLOCK_SIZE].long() * BLOCK_SIZE + ctx % BLOCK_SIZE
        ids = torch.randint(0, spec.vocab_size, (b,), device=dev)
        meta = AttentionMetadata(slots, 0, None, DecodeMetadata(seq_lens, tables))
        kernels = select_kernels("triton")

        def decode_step() -> torch.Tensor:
            return compute_logits(model, forward(model, ids, positions, meta, cache, kernels))

        x = torch.randn(b, spec.hidden_size, device=dev, dtype=torch.bfloat16)
        a = torch.randn(b, spec.q_size, device=dev, dtype=torch.bfloat16)
        m = torch.randn(b, spec.intermediate_size, device=dev, dtype=torch.bfloat16)

        def linears() -> None:
            for w in model.layers:
                F.linear(x, w.qkv)
                F.linear(a, w.o)
                F.linear(x, w.gate_up)
                F.linear(m, w.down)
            F.linear(x, model.lm_head)

        t_step = time_graph(decode_step)
        t_lin = time_graph(linears)
        src = torch.empty(COPY_BYTES // 2, dtype=torch.bfloat16, device=dev)
        dst = torch.empty_like(src)
        t_copy_small = time_graph(lambda: dst.copy_(src))
    kv_bytes = b * (ctx + 1) * spec.kv_bytes_per_token
    copy_bw = 2 * COPY_BYTES / t_copy_small  # bytes read plus bytes written per second
    t_kv = kv_bytes / copy_bw  # reading the step's KV cache once at the copy bandwidth
    floor = t_lin + t_kv
    weight_gb = spec.weight_bytes / 1e9
    print(f"{MODEL}: batch {b}, context {ctx}, {weight_gb:.1f} GB weights, "
          f"{kv_bytes / 1e9:.1f} GB KV read per step")
    print(f"decode step  {t_step * 1e3:8.2f} ms")
    print(f"linears      {t_lin * 1e3:8.2f} ms  ({weight_gb / t_lin:.0f} GB/s of weights)")
    print(f"kv read      {t_kv * 1e3:8.2f} ms  (KV bytes at the copy bandwidth, "
          f"{copy_bw / 1e9:.0f} GB/s read+written)")
    print(f"floor        {floor * 1e3:8.2f} ms  (linears + kv read)")
    print(f"rest         {(t_step - floor) * 1e3:8.2f} ms  (norms, RoPE, cache writes, sampling, "
          "launch gaps; negative: attention reads faster than a copy moves bytes)")
    print(f"ratio decode / floor = {t_step / floor:.2f}")

if __name__ == "__main__":
    main()
