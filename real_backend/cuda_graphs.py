"""CUDA graphs of decode steps (one per padded batch size), of small prefill-only steps (one per
padded token and sequence count), and piecewise graphs of other steps (the L + 1 pieces between
attentions, one set per padded token count), replayed over static input buffers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from common.step_sizes import PREFILL_GRAPH_SEQS, PREFILL_GRAPH_TOKENS, piecewise_graph_sizes


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


@dataclass(slots=True)
class PiecewiseGraphs:
    graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = field(default_factory=dict)
    sizes: list[int] = field(default_factory=list)  # captured token counts, ascending

    def replay(self, tokens: int, piece: int) -> None:
        self.graphs[tokens, piece].replay()


def capture_graph(run: Callable[[], torch.Tensor | None], pool: object
             ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor | None]:
    run()  # warm-up outside the capture: Triton compiles, cuBLAS picks kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


def capture_decode_graphs(decode_step: Callable[[int], torch.Tensor],
                          sizes: list[int]) -> DecodeGraphs:
    """Capture ``decode_step(b)`` (reading static buffers' first b rows, returning logits: a
    view of one buffer shared by every size) for each size, largest first so the smaller
    graphs reuse the first one's memory pool."""
    out = DecodeGraphs(pool=torch.cuda.graph_pool_handle())
    for b in sorted(sizes, reverse=True):
        out.graphs[b], out.logits[b] = capture_graph(partial(decode_step, b), out.pool)
    torch.cuda.synchronize()
    return out


def capture_prefill_graphs(prefill_step: Callable[[int, int], torch.Tensor], max_tokens: int,
                           pool: object) -> PrefillGraphs:
    """Capture ``prefill_step(tokens, seqs)`` for every padded size up to ``max_tokens``, in the
    decode graphs' memory pool (graphs replay one at a time, so they can share it)."""
    out = PrefillGraphs()
    for t in sorted((t for t in PREFILL_GRAPH_TOKENS if t <= max_tokens), reverse=True):
        for p in PREFILL_GRAPH_SEQS:
            out.graphs[t, p], out.logits[t, p] = capture_graph(partial(prefill_step, t, p), pool)
    torch.cuda.synchronize()
    return out


def capture_piecewise_graphs(piece: Callable[[int, int], None], num_pieces: int, max_tokens: int,
                             pool: object) -> PiecewiseGraphs:
    """Capture ``piece(tokens, i)`` for i < num_pieces at every padded token count up to
    ``max_tokens``, in the shared pool. A piece reads and writes only static buffers; what it
    allocates is freed when it ends, so every piece of every size can reuse the same memory.

    A thousand-odd captures: each size is warmed up once as a whole (Triton compiles, cuBLAS
    picks kernels) and its pieces captured back to back on one stream, without the
    synchronize-and-empty-cache ``torch.cuda.graph`` does around every capture."""
    out = PiecewiseGraphs(sizes=piecewise_graph_sizes(max_tokens))
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    for t in reversed(out.sizes):
        with torch.cuda.stream(stream):
            for i in range(num_pieces):
                piece(t, i)
        stream.synchronize()
        for i in range(num_pieces):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                graph.capture_begin(pool)
                try:
                    piece(t, i)
                finally:
                    graph.capture_end()
            out.graphs[t, i] = graph
    torch.cuda.synchronize()
    return out
