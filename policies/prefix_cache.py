"""What a prefix-cache block is: its key, a cryptographic digest (BLAKE2s, 32 bytes) of a full
prompt block's content chained with the key of the block before it, so that equal keys mean
equal prompts up to the block's end (vLLM's keys since CVE-2025-25183; Python's hash() was not
collision-resistant: two different blocks with equal tuple hashes shared their KV). BLAKE2s
rather than BLAKE2b or SHA-256: on these short inputs it takes the fewest instructions
(BENCHMARKS.md, "Prefix-cache block keys").

A request's content is its segments (``Request.prefix_segments``), and both backends key it
from them alone, so the simulator and the real engine find the same hits. A workload's segment
is named by an int content key (the tokens it stands for are never drawn in the simulator); a
served prompt is one segment whose key is its token ids' bytes (``token_segments``), hashed as
they are. A block's digest covers the parent key, then either ``T`` and its token ids (a block
of served tokens) or ``S`` and its pieces, each named piece as (content key, start, end), so
the two key spaces never meet. Only prompt blocks are keyed: a generated token's block would
match nothing a workload sends again (docs/prefix_caching.md).
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2s

from policies.request import Request

_ROOT = bytes(32)  # the parent of a prompt's first block (a key: BLAKE2s's 32 bytes)
_TOKEN_BYTES = array("q").itemsize  # a served token id in a literal segment: an 8-byte int
# A block wholly inside one named segment: the parent, b"S", then its one piece as _block_key
# writes a named piece (b"n", content key, start, end).
_NAMED_BLOCK = struct.Struct("<32s2s3q").pack
_NAMED_PIECE = struct.Struct("<c3q").pack
_LITERAL_PIECE = struct.Struct("<cq").pack


def block_hashes(req: Request, block_size: int, keep: bool = True) -> list[bytes]:
    """The keys of ``req``'s full prompt blocks (computed once and kept on the request, for
    its scheduler's block size; ``keep=False`` for another size); empty for a request without
    segments."""
    hashes = req.block_hashes
    if hashes is not None and keep:
        return hashes
    hashes = []
    segments = req.prefix_segments
    if segments:
        try:
            _chain(segments, req.prompt_len // block_size, block_size, hashes)
        except struct.error:
            bad = [k for k, _ in segments if not _is_key(k)]
            if not bad:
                raise
            raise ValueError(f"request {req.request_id}: prefix segment key {bad[0]!r} is neither "
                             "an int in [-2**63, 2**63) nor token id bytes "
                             "(Request.prefix_segments)") from None
    if keep:
        req.block_hashes = hashes
    return hashes


def _chain(segments: Sequence[tuple[int | bytes, int]], num_full: int, block_size: int,
           out: list[bytes]) -> None:
    """Append the chained keys of the first ``num_full`` blocks of ``segments`` to ``out``:
    a segment's whole blocks one digest each over (content key, start, end) or the ids, a
    block that spans segments from its pieces (``_block_key``)."""
    parent = _ROOT
    pieces: list[tuple[int | bytes, int, int]] = []  # the pending block's (key, start, end)
    filled = 0
    digest, named, append = blake2s, _NAMED_BLOCK, out.append
    for key, length in segments:
        start = 0
        if filled and length > 0:  # the pending block takes this segment's first tokens
            start = min(length, block_size - filled)
            pieces.append((key, 0, start))
            filled += start
            if filled < block_size:
                continue
            parent = _block_key(parent, pieces)
            append(parent)
            pieces, filled = [], 0
        whole = min((length - start) // block_size, num_full - len(out))
        end = start + max(whole, 0) * block_size
        if type(key) is bytes:
            step = block_size * _TOKEN_BYTES
            for at in range(start * _TOKEN_BYTES, end * _TOKEN_BYTES, step):
                parent = digest(parent + b"T" + key[at:at + step]).digest()
                append(parent)
        else:
            for at in range(start, end, block_size):
                parent = digest(named(parent, b"Sn", key, at, at + block_size)).digest()
                append(parent)
        if len(out) >= num_full:
            break
        if end < length:  # the rest begins the next block
            pieces.append((key, end, length))
            filled = length - end


def _block_key(parent: bytes, pieces: list[tuple[int | bytes, int, int]]) -> bytes:
    """The key of a block made of pieces of several segments: ``T`` and its token ids where
    all are served tokens (the key it has inside one segment), else ``S`` and each piece
    tagged (``n``: a named piece's key, start and end; ``t``: a count of ids, then the ids)."""
    w = _TOKEN_BYTES
    if all(type(key) is bytes for key, _, _ in pieces):
        body = [b"T"] + [key[s * w:e * w] for key, s, e in pieces]
    else:
        body = [b"S"] + [_LITERAL_PIECE(b"t", e - s) + key[s * w:e * w] if type(key) is bytes
                         else _NAMED_PIECE(b"n", key, s, e) for key, s, e in pieces]
    return blake2s(parent + b"".join(body)).digest()


def _is_key(key: object) -> bool:
    """Whether ``key`` can name a segment: token id bytes, or an int that fits 8 bytes."""
    return type(key) is bytes or (isinstance(key, int) and -2**63 <= key < 2**63)


def token_segments(token_ids: Sequence[int]) -> tuple[tuple[bytes, int], ...]:
    """A served prompt's segments: one, keyed by its token ids as 8-byte ints (the key is the
    content itself, so equal runs of ids give equal block keys, whatever the block size)."""
    ids = array("q", token_ids)
    if sys.byteorder == "big":  # one layout everywhere
        ids.byteswap()
    return ((ids.tobytes(), len(ids)),)
