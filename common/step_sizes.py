"""The padded sizes a step runs at, shared by the real engine and the simulator's cost model.

Decode steps replay CUDA graphs captured at batch sizes 1, 2, 4, 8, 16, 24, ..., 256;
prefill-only steps of at most 8 prompts replay graphs captured at padded token and prompt
counts; every other step of at most ``piecewise_graph_max_tokens`` tokens (mixed prefill +
decode steps, larger prefills) replays piecewise graphs captured at a padded token count, with
attention run eagerly between the pieces; decode attention splits each sequence's keys over
several programs when the batch is too small to fill the GPU. The engine captures and launches
exactly these; the simulator prices exactly these. No torch here: the simulator imports it.
"""

from __future__ import annotations

import math
from bisect import bisect_left

DECODE_GRAPH_SIZES = (1, 2, 4, 8, *range(16, 257, 8))
PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 192, 256, 384, 512)
PREFILL_GRAPH_SEQS = (1, 2, 4, 8)
# finer steps where launches dominate, coarser where padding would cost compute
PIECEWISE_GRAPH_TOKENS = (*range(32, 513, 32), *range(576, 1025, 64), *range(1152, 2049, 128))
DECODE_KEY_BLOCK = 64  # keys per iteration of the decode-attention kernel


def decode_graph_sizes(max_num_seqs: int) -> list[int]:
    """The decode graphs to capture: every size up to the first covering max_num_seqs."""
    cap = next((s for s in DECODE_GRAPH_SIZES if s >= max_num_seqs), DECODE_GRAPH_SIZES[-1])
    return [s for s in DECODE_GRAPH_SIZES if s <= cap]


def decode_graph_size(num_seqs: int) -> int | None:
    """The captured batch size a decode step of num_seqs is padded to; None: it runs eagerly."""
    i = bisect_left(DECODE_GRAPH_SIZES, num_seqs)  # the sizes ascend: the first that holds it
    return DECODE_GRAPH_SIZES[i] if i < len(DECODE_GRAPH_SIZES) else None


def prefill_graph_key(num_tokens: int, num_seqs: int, max_tokens: int) -> tuple[int, int] | None:
    """The (padded tokens, padded prompts) graph a prefill-only step replays, or None when it
    runs eagerly (no captured token count <= ``max_tokens`` holds it, or more than 8 prompts)."""
    t = _first_holding(PREFILL_GRAPH_TOKENS, num_tokens, max_tokens)
    i = bisect_left(PREFILL_GRAPH_SEQS, num_seqs)
    return None if t is None or i == len(PREFILL_GRAPH_SEQS) else (t, PREFILL_GRAPH_SEQS[i])


def piecewise_graph_size(num_tokens: int, max_tokens: int) -> int | None:
    """The padded token count of the piecewise graphs a step of num_tokens replays, or None
    when it runs eagerly (no captured size <= ``max_tokens`` holds it)."""
    return _first_holding(PIECEWISE_GRAPH_TOKENS, num_tokens, max_tokens)


def _first_holding(sizes: tuple[int, ...], n: int, most: int) -> int | None:
    """The smallest of the ascending ``sizes`` that is >= n, if it is <= most."""
    i = bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) and sizes[i] <= most else None


def piecewise_graph_sizes(max_tokens: int) -> list[int]:
    """The piecewise graph token counts to capture for ``max_tokens``."""
    return [b for b in PIECEWISE_GRAPH_TOKENS if b <= max_tokens]


def decode_splits(num_seqs: int, kv_heads: int, num_sms: int) -> int:
    """Key-range splits per (sequence, KV head) of decode attention: about two programs per
    multiprocessor, at most 16 (on an H200, llama3_8b shapes: batch 8 x 4000 tokens goes from
    133 to 53 us a layer; batch 256 keeps one split)."""
    return max(1, min(16, -(-2 * num_sms // max(num_seqs * kv_heads, 1))))


def split_tokens(length: float, splits: int) -> int:
    """The keys one decode-attention program reads of a sequence of ``length`` split
    ``splits`` ways (each split rounded up to whole key blocks, as the kernel does)."""
    return math.ceil(math.ceil(length / splits) / DECODE_KEY_BLOCK) * DECODE_KEY_BLOCK
