"""The points an operator microbenchmark run times (``Grid``): benchmarks/operators.py makes
the full and the smoke grids and thins them to its budget; op_kernels.py and op_graph.py time
each table's points. Apart from operators.py so that the tables can name it without importing
the command that imports them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Grid:
    gemm_m: list[int]
    lm_head_m: list[int]
    decode_batches: list[int]
    decode_contexts: list[int]
    longest_batches: list[int]  # a batch of short sequences and one long one (its splits)
    longest_contexts: list[int]  # that long sequence's tokens
    prefill: list[tuple[int, int, int]]  # (sequences, query tokens each, cached prefix each)
    small_tokens: list[int]
    sampled: list[int]
    graph_layers: list[int]
    graph_context: int  # tokens of the batch-1 decode step's sequence
    piece_tokens: int  # the piecewise step's tokens (one captured size)
