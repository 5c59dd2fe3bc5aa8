"""What a prefix-cache block is: the hash of a full prompt block, chained over the blocks
before it, from the request's content segments (equal keys at equal places mean equal tokens).

Both backends hash a request the same way from the workload's segments, so the simulator and
the real engine find the same hits; a served request's segments are its token ids cut into
blocks (``token_segments``). Only prompt blocks are hashed: a generated token's block would
match nothing a workload sends again (docs/prefix_caching.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.request import Request


def block_hashes(req: Request, block_size: int, keep: bool = True) -> list[int]:
    """The chained hashes of ``req``'s full prompt blocks (computed once and kept on the
    request, for its scheduler's block size; ``keep=False`` for another size); empty for a
    request without segments."""
    hashes = req.block_hashes
    if hashes is not None and keep:
        return hashes
    hashes = []
    segments = req.prefix_segments
    if segments:
        num_full = req.prompt_len // block_size
        parent = 0
        pieces: list[tuple[int, int, int]] = []  # (key, start, end) within the segment
        filled = 0
        for key, length in segments:
            start = 0
            if not filled:  # the blocks wholly inside this segment: one piece each
                whole = min(length // block_size, num_full - len(hashes))
                for start in range(0, whole * block_size, block_size):
                    parent = hash((parent, ((key, start, start + block_size),)))
                    hashes.append(parent)
                start = whole * block_size
            while start < length and len(hashes) < num_full:
                take = min(length - start, block_size - filled)
                pieces.append((key, start, start + take))
                start += take
                filled += take
                if filled == block_size:
                    parent = hash((parent, tuple(pieces)))
                    hashes.append(parent)
                    pieces, filled = [], 0
            if len(hashes) == num_full:
                break
    if keep:
        req.block_hashes = hashes
    return hashes


def token_segments(token_ids: Sequence[int], block_size: int) -> tuple[tuple[int, int], ...]:
    """A served prompt's segments: each block-size run of its token ids keyed by their hash
    (a key names the run's tokens, so equal keys at equal places are equal tokens)."""
    return tuple((hash(tuple(token_ids[i:i + block_size])), len(token_ids[i:i + block_size]))
                 for i in range(0, len(token_ids), block_size))
