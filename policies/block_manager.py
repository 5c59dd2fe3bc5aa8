"""The paged KV block manager: a free list of physical blocks and each request's block table."""

from __future__ import annotations

import random

from policies.request import Request


class BlockManager:
    """Hands out fixed-size KV blocks; a request's block table grows as its slots are reserved.

    ``watermark`` keeps a fraction of blocks free at admission time so that running requests
    can still append slots (vLLM's default 1%); appends themselves may use every block.
    """

    __slots__ = ("block_size", "num_blocks", "watermark_blocks", "_free", "_is_free")

    def __init__(self, num_blocks: int, block_size: int = 16, watermark: float = 0.01) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"scheduler.block_size must be >= 1, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"scheduler.watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.watermark_blocks = int(watermark * num_blocks)
        # Pop from the end: low block ids are handed out first, which keeps runs reproducible.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_blocks

    def shuffle_free(self, seed: int) -> None:
        """Hand free blocks out in a seeded random order, as an engine's churn of requests
        finishing and growing one block at a time leaves them: block tables then scatter over
        the cache as in a long run (the calibration's microbenchmarks use this)."""
        random.Random(seed).shuffle(self._free)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new request holding ``num_tokens`` slots can be admitted (watermark kept)."""
        return len(self._free) - self.blocks_for(num_tokens) >= self.watermark_blocks

    def ensure_slots(self, req: Request, num_tokens: int) -> bool:
        """Grow ``req``'s block table to hold ``num_tokens`` slots; False (nothing taken) if short."""
        table = req.block_table
        need = -(-num_tokens // self.block_size) - len(table)
        if need <= 0:
            return True
        free = self._free
        if need > len(free):
            return False
        for _ in range(need):
            block = free.pop()
            self._is_free[block] = 0
            table.append(block)
        return True

    def free(self, req: Request) -> None:
        is_free = self._is_free
        for block in req.block_table:
            if is_free[block]:
                raise RuntimeError(f"block {block} of request {req.request_id} freed twice")
            is_free[block] = 1
        self._free.extend(reversed(req.block_table))
        req.block_table = []

    def check(self, requests: list[Request]) -> None:
        """Assert the invariant: every block is either free or in exactly one block table."""
        owned = [b for r in requests for b in r.block_table]
        if len(owned) != len(set(owned)):
            raise AssertionError("a block is in two block tables")
        if len(owned) + len(self._free) != self.num_blocks:
            raise AssertionError(
                f"{len(owned)} owned + {len(self._free)} free != {self.num_blocks} blocks")
        if any(self._is_free[b] for b in owned) or not all(self._is_free[b] for b in self._free):
            raise AssertionError("free map disagrees with the free list")
