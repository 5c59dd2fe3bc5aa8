"""The paged KV block manager: free blocks, each request's block table, and the prefix cache
(content-addressed full prompt blocks, shared by reference count, evicted least recently used)."""

from __future__ import annotations

import random
from collections import OrderedDict, deque

from policies.prefix_cache import block_hashes
from policies.request import Request


class BlockManager:
    """Hands out fixed-size KV blocks; a request's block table grows as its slots are reserved.

    ``watermark`` keeps a fraction of blocks free at admission time so that running requests
    can still append slots (vLLM's default 1%); appends themselves may use every block.

    With ``enable_caching`` (vLLM V1's automatic prefix caching) a full prompt block, once
    scheduled for computation, is indexed by its key (policies/prefix_cache.py); a request
    admitted later starts with the longest run of its leading blocks found there, shared by
    reference count. A block no table holds is free, but an indexed one keeps its KV until it
    is needed: blocks are handed out from the never-indexed free ones first, then the indexed
    ones least recently freed first (that eviction drops the block from the index).
    """

    __slots__ = ("block_size", "num_blocks", "watermark_blocks", "enable_caching", "_returned",
                 "_next_fresh", "_refs", "_evictable", "_by_hash", "_hash_of", "unassigned")

    def __init__(self, num_blocks: int, block_size: int = 16, watermark: float = 0.01,
                 enable_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"scheduler.block_size must be >= 1, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"scheduler.watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.watermark_blocks = int(watermark * num_blocks)
        self.enable_caching = enable_caching
        # The uncached free list is the blocks never handed out (ids _next_fresh.., lowest
        # first) under a stack of returned ones (popped first): the order of one list
        # [n-1, ..., 0] popped from the end, in memory that grows with the blocks in use.
        self._returned: list[int] = []
        self._next_fresh = 0
        self._refs: dict[int, int] = {}  # block -> block tables holding it
        # The prefix cache: free indexed blocks in LRU order, and the index both ways
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[bytes, int] = {}  # block key -> block
        self._hash_of: dict[int, bytes] = {}
        # Blocks taken by count whose ids are not picked yet (a decode group's, which reads no
        # block table: policies/decode_group.py); ``ensure_slots`` picks them once the count
        # is taken back. They are not free. While any are, the free list holds more ids than
        # there are free blocks: only a caller that checked ``num_free_blocks`` (admission)
        # takes from it.
        self.unassigned = 0

    def shuffle_free(self, seed: int) -> None:
        """Hand free blocks out in a seeded random order, as an engine's churn of requests
        finishing and growing one block at a time leaves them: block tables then scatter over
        the cache as in a long run (the calibration's microbenchmarks use this)."""
        free = self._free_list()
        random.Random(seed).shuffle(free)
        self._returned, self._next_fresh = free, self.num_blocks

    def _free_list(self) -> list[int]:
        """Every unindexed free block, in the order pop() takes them from the end."""
        return list(range(self.num_blocks - 1, self._next_fresh - 1, -1)) + self._returned

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (indexed ones kept for reuse included)."""
        return (len(self._returned) + self.num_blocks - self._next_fresh + len(self._evictable)
                - self.unassigned)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache's index, held or free."""
        return len(self._by_hash)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` slots: the one rounding of tokens to blocks."""
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, num_tokens: int, hits: list[int] | None = None) -> int:
        """Free blocks a new request holding ``num_tokens`` slots takes, the cached blocks
        ``hits`` first: a held one is shared, a free one leaves the free pool all the same."""
        need = self.blocks_for(num_tokens)
        if hits:
            need += sum(1 for b in hits if b in self._evictable) - len(hits)
        return need

    def can_allocate(self, num_tokens: int, hits: list[int] | None = None) -> bool:
        """Whether a new request holding ``num_tokens`` slots, of which the cached blocks
        ``hits`` come first, can be admitted (watermark kept): num_free_blocks less
        blocks_needed, written out (every admission asks, and a full cache asks every window)."""
        need = self.blocks_needed(num_tokens, hits) if hits else self.blocks_for(num_tokens)
        return (len(self._returned) + self.num_blocks - self._next_fresh + len(self._evictable)
                - self.unassigned - need >= self.watermark_blocks)

    def blocks_freed_by(self, req: Request) -> int:
        """Blocks that freeing ``req`` would return: those no other request holds."""
        refs = self._refs
        return sum(1 for b in req.block_table if refs[b] == 1)

    def _take(self) -> int | None:
        """One free block: an unindexed one, else the least recently freed indexed one."""
        if self._returned:
            return self._returned.pop()
        if self._next_fresh < self.num_blocks:
            self._next_fresh += 1
            return self._next_fresh - 1
        if self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block)]
            return block
        return None

    def ensure_slots(self, req: Request, num_tokens: int) -> bool:
        """Grow ``req``'s block table to hold ``num_tokens`` slots; False (nothing taken) if short."""
        table = req.block_table
        need = self.blocks_for(num_tokens) - len(table)
        if need <= 0:
            return True
        refs = self._refs
        if need == 1:  # the common case: one more block
            returned = self._returned
            if returned:
                block = returned.pop()
            elif self._next_fresh < self.num_blocks:
                block = self._next_fresh
                self._next_fresh += 1
            else:
                block = self._take()
                if block is None:
                    return False
            refs[block] = 1
            table.append(block)
            return True
        if need > self.num_free_blocks:
            return False
        returned = self._returned
        got = min(need, len(returned))
        if got:  # the top of the stack, popped one by one: its last block first
            taken = returned[-got:]
            del returned[-got:]
            taken.reverse()
            table += taken
        fresh = min(need - got, self.num_blocks - self._next_fresh)
        if fresh:
            table += range(self._next_fresh, self._next_fresh + fresh)
            self._next_fresh += fresh
        for _ in range(need - got - fresh):
            table.append(self._take())
        refs.update(dict.fromkeys(table[-need:], 1))
        return True

    def trim(self, req: Request, num_tokens: int) -> None:
        """Give back ``req``'s blocks past the first ``num_tokens`` slots (a speculative
        decode's rejected draft tokens: its length grew by less than the slots it took)."""
        table = req.block_table
        keep = self.blocks_for(num_tokens)
        if len(table) <= keep:
            return
        self._release(table[keep:])
        del table[keep:]

    def free(self, req: Request) -> None:
        """Give back ``req``'s blocks; an indexed one no table holds stays cached (LRU order:
        the table's tail, least likely shared, is evicted first)."""
        refs = self._refs
        table = req.block_table
        req.num_hashed_blocks = 0
        req.block_hashes = None  # a finished request's memory; recomputed if it is re-admitted
        if not table:  # (a decode group's blocks are counted, not listed)
            return
        req.block_table = []
        if not self._hash_of:  # nothing indexed, so nothing shared: back to the free stack
            try:
                deque(map(refs.pop, table), maxlen=0)  # (each popped, in C)
            except KeyError as err:
                raise RuntimeError(f"block {err.args[0]} of request {req.request_id} freed "
                                   "twice") from None
            self._returned.extend(reversed(table))
            return
        for block in table:
            if block not in refs:
                raise RuntimeError(f"block {block} of request {req.request_id} freed twice")
        self._release(table)

    def _release(self, blocks: list[int]) -> None:
        """One reference less on each of ``blocks``, the last first: a block no table holds any
        more stays cached if it is indexed (evictable), else goes back to the free stack."""
        refs = self._refs
        for block in reversed(blocks):
            n = refs.pop(block)
            if n > 1:
                refs[block] = n - 1
            elif block in self._hash_of:
                self._evictable[block] = None
            else:
                self._returned.append(block)

    # ------------------------------------------------------------------ prefix cache
    def match(self, req: Request) -> list[int]:
        """The cached blocks of ``req``'s longest cached prefix (held or free; nothing taken),
        leaving at least its last token to compute (the step that samples needs it). A request
        that asks for its prompt's logprobs finds none: every prompt token's logits must be
        computed (as in vLLM V1); its blocks are still indexed for the requests after it."""
        if not self.enable_caching or req.prefix_segments is None:
            return []
        if req.sampling is not None and req.sampling.prompt_logprobs is not None:
            return []
        hashes = block_hashes(req, self.block_size)
        limit = min(len(hashes), (req.seq_len - 1) // self.block_size)
        by_hash = self._by_hash
        out = []
        for h in hashes[:limit]:
            block = by_hash.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def take_hits(self, req: Request, hits: list[int]) -> None:
        """Start ``req``'s empty block table with the cached blocks ``hits``."""
        refs, evictable = self._refs, self._evictable
        for block in hits:
            if block in evictable:
                del evictable[block]
            refs[block] = refs.get(block, 0) + 1
        req.block_table = list(hits)
        req.num_hashed_blocks = len(hits)

    def cache_blocks(self, req: Request, num_computed: int) -> None:
        """Index ``req``'s full prompt blocks within its first ``num_computed`` tokens (those
        scheduled for computation); a hash already indexed keeps its first block."""
        if not self.enable_caching or req.prefix_segments is None:
            return
        hashes = block_hashes(req, self.block_size)
        upto = min(len(hashes), num_computed // self.block_size)
        by_hash, hash_of, table = self._by_hash, self._hash_of, req.block_table
        for i in range(req.num_hashed_blocks, upto):
            h = hashes[i]
            if h not in by_hash:
                block = table[i]
                by_hash[h] = block
                hash_of[block] = h
        if upto > req.num_hashed_blocks:
            req.num_hashed_blocks = upto

    def check(self, requests: list[Request]) -> None:
        """Assert the invariants: a block's reference count is the number of block tables
        holding it, every block is held or free (never both), the index is consistent."""
        held: dict[int, int] = {}
        for r in requests:
            if len(r.block_table) != len(set(r.block_table)):
                raise AssertionError(f"request {r.request_id} holds a block twice")
            for b in r.block_table:
                held[b] = held.get(b, 0) + 1
        if held != self._refs:
            raise AssertionError("reference counts disagree with the block tables")
        if not self.enable_caching and any(n > 1 for n in held.values()):
            raise AssertionError("a block is in two block tables")
        free = set(self._free_list()) | set(self._evictable)
        if (len(held) + self.unassigned + self.num_free_blocks != self.num_blocks
                or free & set(held)):
            raise AssertionError(f"{len(held)} held + {self.unassigned} by count + "
                                 f"{self.num_free_blocks} free != {self.num_blocks} blocks")
        if set(self._evictable) - set(self._hash_of):
            raise AssertionError("a free cached block is not in the index")
        if {b: h for h, b in self._by_hash.items()} != self._hash_of:
            raise AssertionError("the index disagrees with itself")
