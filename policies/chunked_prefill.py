"""chunked_prefill: mixed batches, decodes first, then prefill chunks up to the token budget."""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import Policy, register


@register
@dataclass(frozen=True)
class ChunkedPrefill(Policy):
    name = "chunked_prefill"
    mixed_batches = True
    chunk_prefills = True
