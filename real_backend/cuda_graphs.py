"""CUDA graphs of decode steps (one per padded batch size) and of small prefill-only steps (one per
padded token and sequence count), replayed over static input buffers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

MAX_GRAPH_BATCH = 256
# Prefill-only steps of at most 8 sequences and 512 tokens replay a graph too: eagerly they
# are bound by the CPU launching ~350 kernels (~11 ms for llama3_8b), twice their GPU time.
PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 192, 256, 384, 512)
PREFILL_GRAPH_SEQS = (1, 2, 4, 8)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to the first size covering max_num_seqs (at most 256)."""
    sizes = [1, 2, 4, 8] + list(range(16, MAX_GRAPH_BATCH + 1, 8))
    cap = next((s for s in sizes if s >= max_num_seqs), MAX_GRAPH_BATCH)
    return [s for s in sizes if s <= cap]


def prefill_graph_key(num_tokens: int, num_seqs: int, max_tokens: int) -> tuple[int, int] | None:
    """The (padded tokens, padded sequences) graph a prefill-only step of this size replays, or
    None when it runs eagerly (no captured token size <= ``max_tokens`` holds it, or more than
    8 sequences)."""
    t = next((b for b in PREFILL_GRAPH_TOKENS if num_tokens <= b <= max_tokens), None)
    p = next((b for b in PREFILL_GRAPH_SEQS if b >= num_seqs), None)
    return None if t is None or p is None else (t, p)


@dataclass(slots=True)
class DecodeGraphs:
    graphs: dict[int, torch.cuda.CUDAGraph] = field(default_factory=dict)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # each graph's output buffer
    pool: object = None

    def padded_size(self, n: int) -> int | None:
        """The smallest captured batch size >= n, or None (run eagerly)."""
        return min((b for b in self.graphs if b >= n), default=None)

    def replay(self, batch_size: int) -> torch.Tensor:
        self.graphs[batch_size].replay()
        return self.logits[batch_size]


@dataclass(slots=True)
class PrefillGraphs:
    graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = field(default_factory=dict)
    logits: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def replay(self, key: tuple[int, int]) -> torch.Tensor:
        self.graphs[key].replay()
        return self.logits[key]


def _capture(run: Callable[[], torch.Tensor], pool: object) -> tuple[torch.cuda.CUDAGraph,
                                                                    torch.Tensor]:
    run()  # warm-up outside the capture: Triton compiles, cuBLAS picks kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


def capture_decode_graphs(decode_step: Callable[[int], torch.Tensor],
                          sizes: list[int]) -> DecodeGraphs:
    """Capture ``decode_step(b)`` (reading static buffers' first b rows, returning logits) for
    each size, largest first so the smaller graphs reuse the first one's memory pool."""
    out = DecodeGraphs(pool=torch.cuda.graph_pool_handle())
    for b in sorted(sizes, reverse=True):
        out.graphs[b], out.logits[b] = _capture(partial(decode_step, b), out.pool)
    torch.cuda.synchronize()
    return out


def capture_prefill_graphs(prefill_step: Callable[[int, int], torch.Tensor], max_tokens: int,
                           pool: object) -> PrefillGraphs:
    """Capture ``prefill_step(tokens, seqs)`` for every padded size up to ``max_tokens``, in the
    decode graphs' memory pool (graphs replay one at a time, so they can share it)."""
    out = PrefillGraphs()
    for t in sorted((t for t in PREFILL_GRAPH_TOKENS if t <= max_tokens), reverse=True):
        for p in PREFILL_GRAPH_SEQS:
            out.graphs[t, p], out.logits[t, p] = _capture(partial(prefill_step, t, p), pool)
    torch.cuda.synchronize()
    return out
