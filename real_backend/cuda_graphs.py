"""CUDA graphs of the decode step, one per padded batch size, replayed over static input buffers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

MAX_GRAPH_BATCH = 256


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to the first size covering max_num_seqs (at most 256)."""
    sizes = [1, 2, 4, 8] + list(range(16, MAX_GRAPH_BATCH + 1, 8))
    cap = next((s for s in sizes if s >= max_num_seqs), MAX_GRAPH_BATCH)
    return [s for s in sizes if s <= cap]


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


def capture_decode_graphs(decode_step: Callable[[int], torch.Tensor],
                          sizes: list[int]) -> DecodeGraphs:
    """Capture ``decode_step(b)`` (reading static buffers' first b rows, returning logits) for
    each size, largest first so the smaller graphs reuse the first one's memory pool."""
    out = DecodeGraphs(pool=torch.cuda.graph_pool_handle())
    for b in sorted(sizes, reverse=True):
        decode_step(b)  # warm-up outside the capture: Triton compiles, cuBLAS picks kernels
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=out.pool):
            out.logits[b] = decode_step(b)
        out.graphs[b] = graph
    torch.cuda.synchronize()
    return out
