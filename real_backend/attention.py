"""Attention over the paged KV cache: the per-step metadata and the prefill/decode split."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from real_backend.kernels import Kernels


@dataclass(slots=True)
class PrefillMetadata:
    """Sequences whose step computes several tokens; their rows come first in the flat batch."""

    query_start_loc: torch.Tensor  # [P + 1] int32, offsets of each sequence's new tokens
    seq_lens: torch.Tensor  # [P] int32, cached prefix + new tokens
    block_tables: torch.Tensor  # [P, width] int32
    max_query_len: int


@dataclass(slots=True)
class DecodeMetadata:
    """Sequences computing one token each; rows after the prefill rows, CUDA-graph padding last."""

    seq_lens: torch.Tensor  # [D] int32, 0 on padding rows
    block_tables: torch.Tensor  # [D, width] int32


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, -1 on padding rows
    num_prefill_tokens: int
    prefill: PrefillMetadata | None
    decode: DecodeMetadata | None


@dataclass(slots=True)
class RowBuffers:
    """Static device inputs of a flat batch of rows of several tokens (prompt chunks for the
    prefill graphs, a verify's drafts and target token), padded: CUDA graphs read them, and an
    eager forward runs over the same tensors."""

    input_ids: torch.Tensor  # [tokens] int64
    positions: torch.Tensor  # [tokens] int64
    slot_mapping: torch.Tensor  # [tokens] int64, -1 on padding tokens
    query_start_loc: torch.Tensor  # [rows + 1] int32; padding rows start and end at the end
    seq_lens: torch.Tensor  # [rows] int32, 0 on padding rows
    block_tables: torch.Tensor  # [rows, max_blocks_per_seq] int32
    logits_indices: torch.Tensor  # int64: the tokens whose logits are read, 0 on padding

    def meta(self, tokens: int, rows: int, max_query_len: int | None = None
             ) -> AttentionMetadata:
        """The first ``tokens`` tokens in ``rows`` rows (``max_query_len``: the longest row's
        tokens; None: ``tokens``)."""
        return AttentionMetadata(self.slot_mapping[:tokens], tokens, PrefillMetadata(
            self.query_start_loc[:rows + 1], self.seq_lens[:rows], self.block_tables[:rows],
            tokens if max_query_len is None else max_query_len), None)


@dataclass(slots=True)
class DecodeBuffers:
    """Static device inputs of one-token steps (decode steps, a draft model's steps): CUDA
    graphs read them, advance_step rewrites a decode step's."""

    input_ids: torch.Tensor  # [rows] int64
    positions: torch.Tensor  # [rows] int64
    slot_mapping: torch.Tensor  # [rows] int64
    seq_lens: torch.Tensor  # [rows] int32
    block_tables: torch.Tensor  # [rows, max_blocks_per_seq] int32
    num_rows: int = 0  # rows holding real sequences now
    padded_rows: int = 0  # rows the next decode step computes (a captured graph's size)

    def meta(self, rows: int) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping[:rows], 0, None,
                                 DecodeMetadata(self.seq_lens[:rows], self.block_tables[:rows]))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, kernels: Kernels,
                    scale: float) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend every query over its cached context."""
    kernels.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    p, dec = meta.prefill, meta.decode
    n = meta.num_prefill_tokens
    outs = []
    if p is not None:
        outs.append(kernels.prefill_attention(q[:n], k_cache, v_cache, p.block_tables,
                                              p.query_start_loc, p.seq_lens, scale,
                                              p.max_query_len))
    if dec is not None:
        outs.append(kernels.decode_attention(q[n:], k_cache, v_cache, dec.block_tables,
                                             dec.seq_lens, scale))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
