"""The paged KV block manager: a free list of physical blocks and each request's block table."""

from __future__ import annotations

import random

from policies.request import Request


class BlockManager:
    """Hands out fixed-size KV blocks; a request's block table grows as its slots are reserved.

    ``watermark`` keeps a fraction of blocks free at admission time so that running requests
    can still append slots (vLLM's default 1%); appends themselves may use every block.
    """

    __slots__ = ("block_size", "num_blocks", "watermark_blocks", "_returned", "_next_fresh",
                 "_owned")

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
        # The free list is the blocks never handed out (ids _next_fresh.., lowest first) under a
        # stack of returned ones (popped first): the order of one list [n-1, ..., 0] popped from
        # the end, in memory that grows with the blocks in use, never with the cache's size.
        self._returned: list[int] = []
        self._next_fresh = 0
        self._owned: set[int] = set()

    def shuffle_free(self, seed: int) -> None:
        """Hand free blocks out in a seeded random order, as an engine's churn of requests
        finishing and growing one block at a time leaves them: block tables then scatter over
        the cache as in a long run (the calibration's microbenchmarks use this)."""
        free = self._free_list()
        random.Random(seed).shuffle(free)
        self._returned, self._next_fresh = free, self.num_blocks

    def _free_list(self) -> list[int]:
        """Every free block, in the order pop() takes them from the end (for shuffle and check)."""
        return list(range(self.num_blocks - 1, self._next_fresh - 1, -1)) + self._returned

    @property
    def num_free_blocks(self) -> int:
        return len(self._returned) + self.num_blocks - self._next_fresh

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new request holding ``num_tokens`` slots can be admitted (watermark kept)."""
        return self.num_free_blocks - self.blocks_for(num_tokens) >= self.watermark_blocks

    def ensure_slots(self, req: Request, num_tokens: int) -> bool:
        """Grow ``req``'s block table to hold ``num_tokens`` slots; False (nothing taken) if short."""
        table = req.block_table
        need = -(-num_tokens // self.block_size) - len(table)
        if need <= 0:
            return True
        returned, owned = self._returned, self._owned
        if need == 1:  # the common case: one more block
            if returned:
                block = returned.pop()
            elif self._next_fresh < self.num_blocks:
                block = self._next_fresh
                self._next_fresh += 1
            else:
                return False
            owned.add(block)
            table.append(block)
            return True
        if need > len(returned) + self.num_blocks - self._next_fresh:  # num_free_blocks
            return False
        for _ in range(need):
            if returned:
                block = returned.pop()
            else:
                block = self._next_fresh
                self._next_fresh += 1
            owned.add(block)
            table.append(block)
        return True

    def free(self, req: Request) -> None:
        owned = self._owned
        for block in req.block_table:
            if block not in owned:
                raise RuntimeError(f"block {block} of request {req.request_id} freed twice")
            owned.discard(block)
        self._returned.extend(reversed(req.block_table))
        req.block_table = []

    def check(self, requests: list[Request]) -> None:
        """Assert the invariant: every block is either free or in exactly one block table."""
        owned = [b for r in requests for b in r.block_table]
        if len(owned) != len(set(owned)):
            raise AssertionError("a block is in two block tables")
        if len(owned) + self.num_free_blocks != self.num_blocks:
            raise AssertionError(
                f"{len(owned)} owned + {self.num_free_blocks} free != {self.num_blocks} blocks")
        if set(owned) != self._owned or self._owned.intersection(self._returned):
            raise AssertionError("the owned set disagrees with the free list")
