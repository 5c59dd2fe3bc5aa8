"""The running decoders of separate-batch scheduling as one group: a decode window's cost in the
number of requests that finish or need a KV block, not in the number running.

In vLLM V0's separate batches every running request of a decode window decodes its k tokens, so
a window is the same for all of them but those that finish in it. A ``DecodeGroup`` keeps one
position counter that each decode window moves by k; a member keeps its own fields as they were
when it joined, and the group's position then (``Request.group_offset``): its progress since is
the counter less that offset, the same for every member's computed and output tokens, and its
decode tokens' times are that run of the group's step log. Its blocks past its block table are
held by count (``BlockManager.unassigned``). The group itself holds only what a window needs
without reading the members one by one: how many sit at each offset within a block, their
offsets' sum and largest, and who ends at which position (the same windows, blocks and times as
per-sequence windows: tests/test_decode_group.py)."""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from operator import mul

from policies.request import Request


@dataclass(slots=True, eq=False)
class DecodeWindow:
    """A group's decode window as the backend sees it: its totals in place of its sequences.

    Every member takes part in all k steps at one token a step; the members whose last token
    falls in the window are ``finishing``, as (end position, join order, request) in join
    order."""

    start: int  # the group's position at the window: its steps are positions start..start+k-1
    num_seqs: int
    kv_tokens: int  # over the members: cached tokens plus the newest one (step 1's KV)
    max_kv_tokens: int  # the longest member's
    finishing: list[tuple[int, int, Request]]
    # by update(): (start position, end position) of each finished member's decode tokens in
    # the log, in the order update() returned them; its token_times holds its tokens from
    # before it joined, the backend adds these (as delivery times: simulator/front_end.py)
    runs: list[tuple[int, int]] = field(default_factory=list)

    def owed(self) -> list[int]:
        """The tokens each finishing member still owes at the window's start (<= k)."""
        return [end - self.start for end, _, _ in self.finishing]


class DecodeGroup:
    """The position counter, its step log, and the members' counts a window reads.

    A member's lead is its computed tokens less the position (constant while it is a member):
    its computed tokens at any position are lead + position."""

    __slots__ = ("block_size", "position", "log", "size", "_blocks_for", "_new_blocks",
                 "_by_lead", "_lead_sum", "_longest", "_left", "_ends", "_joined")

    def __init__(self, blocks_for: Callable[[int], int], block_size: int) -> None:
        self.block_size = block_size
        self._blocks_for = blocks_for  # the block manager's rounding of tokens to blocks
        self._new_blocks: dict[int, list[int]] = {}  # k -> new blocks by tokens held mod bs
        self.position = 0  # decode positions so far: each group window adds its k
        self.log: list[float] = []  # the step time of every position (update()'s step_times)
        self.size = 0  # members
        self._by_lead = [0] * block_size  # members by lead mod block_size
        self._lead_sum = 0
        # the leads negated as a heap, with the leads of members gone since (a count each):
        # the longest member is the top once those are popped
        self._longest: list[int] = []
        self._left: defaultdict[int, int] = defaultdict(int)
        # end position -> (join order, request) of the members whose last token it is
        self._ends: dict[int, list[tuple[int, Request]]] = {}
        self._joined = 0

    def join(self, reqs: Iterable[Request]) -> None:
        """``reqs`` decode from here on, in this order (the scheduler checks that each one's
        blocks hold exactly its computed tokens)."""
        pos, bs = self.position, self.block_size
        by_lead, longest, ends = self._by_lead, self._longest, self._ends
        order = self._joined
        leads = 0
        for req in reqs:
            lead = req.num_computed_tokens - pos
            req.group_offset = pos
            by_lead[lead % bs] += 1
            leads += lead
            heapq.heappush(longest, -lead)
            end = pos + req.max_tokens - req.num_output_tokens  # the position of its last token
            if end <= pos:  # (a window takes the ends at its own positions only)
                raise RuntimeError(f"request {req.request_id} joins the decode group owing no "
                                   "token")
            ending = ends.get(end)
            if ending is None:
                ends[end] = [(order, req)]
            else:
                ending.append((order, req))
            order += 1
        self.size += order - self._joined
        self._joined = order
        self._lead_sum += leads

    def catch_up(self, req: Request) -> None:
        """Write member ``req``'s progress since it joined into its computed and output tokens
        and token times; it is a member no more (the group's counts are the caller's: ``leave``
        or ``clear``)."""
        joined, pos = req.group_offset, self.position
        req.num_computed_tokens += pos - joined
        req.num_output_tokens += pos - joined
        req.token_times.extend(self.log[joined:pos])
        req.group_offset = None

    def leave(self, req: Request) -> None:
        """Member ``req`` leaves (caught up), the others stay."""
        lead = req.num_computed_tokens - req.group_offset
        end = req.group_offset + req.max_tokens - req.num_output_tokens
        self.catch_up(req)
        ending = self._ends[end]
        ending[:] = [e for e in ending if e[1] is not req]
        if not ending:
            del self._ends[end]
        self.size -= 1
        self._by_lead[lead % self.block_size] -= 1
        self._lead_sum -= lead
        self._left[lead] += 1

    def clear(self) -> None:
        """Every member has left (each one caught up by the caller)."""
        self.size = self._lead_sum = 0
        self._by_lead = [0] * self.block_size
        self._longest.clear()
        self._left.clear()
        self._ends.clear()

    def blocks_needed(self, k: int) -> int:
        """New KV blocks the members take to reserve k slots each: a member holding c tokens
        needs blocks_for(c + k) - blocks_for(c), which depends on c mod bs alone."""
        new = self._new_blocks.get(k)
        if new is None:
            blocks_for = self._blocks_for
            new = self._new_blocks[k] = [blocks_for(r + k) - blocks_for(r)
                                         for r in range(self.block_size)]
        shift = self.position % self.block_size  # a lead of l holds (l + position) mod bs
        return sum(map(mul, self._by_lead, new[shift:] + new[:shift]))

    def window(self, k: int) -> DecodeWindow:
        """The next window of k steps (its blocks already taken); its finishing members (those
        whose end is one of its positions) leave the ends now."""
        pos = self.position
        longest, left = self._longest, self._left
        while (top := -longest[0]) in left:  # members gone
            if left[top] == 1:
                del left[top]
            else:
                left[top] -= 1
            heapq.heappop(longest)
        ends, finishing = self._ends, []
        for end in range(pos + 1, pos + k + 1):  # the ends at the window's positions
            ending = ends.pop(end, None)
            if ending is not None:
                for order, req in ending:
                    finishing.append((end, order, req))
        n = self.size
        if len(finishing) > 1:
            finishing.sort(key=_join_order)
        return DecodeWindow(pos, n, self._lead_sum + n * (pos + 1), pos + 1 + top, finishing)

    def advance(self, win: DecodeWindow, step_times: Sequence[float]) -> tuple[list[Request], int]:
        """The window ran: its positions get ``step_times``; the finishing members take their
        last tokens and leave, in join order (their computed and output tokens and finish time
        written; their decode tokens' times are their runs of the log, ``win.runs``). (the
        finished, the steps they ran past their ends)"""
        k = len(step_times)
        pos = win.start
        self.log.extend(step_times)
        self.position = pos + k
        finished: list[Request] = []
        wasted = 0
        by_lead, left, bs = self._by_lead, self._left, self.block_size
        leads = 0
        for end, _, req in win.finishing:
            joined = req.group_offset
            lead = req.num_computed_tokens - joined
            by_lead[lead % bs] -= 1
            leads += lead
            left[lead] += 1
            req.group_offset = None
            owed = end - pos
            req.num_computed_tokens = lead + pos + k
            req.num_output_tokens = req.max_tokens
            req.finish_time = step_times[owed - 1]
            wasted += k - owed
            win.runs.append((joined, end))
            finished.append(req)
        self.size -= len(finished)
        self._lead_sum -= leads
        return finished, wasted


def _join_order(entry: tuple[int, int, Request]) -> int:
    return entry[1]
