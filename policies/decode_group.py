"""The running decoders of separate-batch scheduling kept as one group: a decode window's cost
in the number of requests that finish or need a KV block, not in the number running.

In vLLM V0's separate batches every running request of a decode window decodes its k tokens, so
a window is the same for all of them but those that finish in it. A ``DecodeGroup`` keeps them
by where they stand against one position counter that each decode window moves by k: a member's
computed and output tokens are where it joined plus the positions since, its blocks a count
fixed by its offset within a block, its end a position the group reaches, and its decode
tokens' times a slice of the log of the group's step times. The scheduler keeps the group in
step with its per-sequence windows (the same windows, blocks and times:
tests/test_decode_group.py) and gives it up (``settle``: every member's fields written back)
where a window needs a request's own state: a shortage of blocks, a budget below the running
count (docs/policies.md)."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from policies.request import Request

_ORDER = 1 << 40  # more joins than a group ever has


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
    """The members' shared position, their blocks by offset, their ends, and the step log."""

    __slots__ = ("block_size", "position", "log", "members", "_joined_at", "_by_offset",
                 "_offset_sum", "_longest", "_ends", "_joined")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.position = 0  # decode positions so far: each group window adds its k
        self.log: list[float] = []  # the step time of every position (update()'s step_times)
        # join order -> request, in join order (a member leaves only at its end or when all
        # do); and in the same order, its offset (its computed tokens less the position), the
        # position it joined at and its output tokens then
        self.members: dict[int, Request] = {}
        self._joined_at: dict[int, tuple[int, int, int]] = {}
        self._by_offset = [0] * block_size  # members by offset mod block_size
        self._offset_sum = 0
        # a heap of int keys, -offset times _ORDER plus the join order (one int compares
        # faster than a tuple; stale ones kept), and the members by end position (join orders;
        # a window takes the positions it covers)
        self._longest: list[int] = []
        self._ends: dict[int, list[int]] = {}
        self._joined = 0

    def join(self, reqs: Iterable[Request]) -> None:
        """``reqs`` decode from here on, in this order; each one's computed tokens fill exactly
        its block table."""
        pos, bs, members, joined_at = self.position, self.block_size, self.members, self._joined_at
        by_offset, longest, ends = self._by_offset, self._longest, self._ends
        order = self._joined
        offsets = 0
        for req in reqs:
            outputs = req.num_output_tokens
            offset = req.num_computed_tokens - pos
            members[order] = req
            joined_at[order] = (offset, pos, outputs)
            by_offset[offset % bs] += 1
            offsets += offset
            heapq.heappush(longest, -offset * _ORDER + order)
            end = pos + req.max_tokens - outputs  # the position of its last token
            if end <= pos:  # (a window takes the ends at its own positions only)
                raise RuntimeError(f"request {req.request_id} joins the decode group owing no "
                                   "token")
            ending = ends.get(end)
            if ending is None:
                ends[end] = [order]
            else:
                ending.append(order)
            order += 1
        self._joined = order
        self._offset_sum += offsets

    def members_at(self, win: DecodeWindow) -> list[tuple[Request, int]]:
        """The members of ``win`` (before its update()) in join order with their cached
        tokens: the sequences a per-sequence decode window would list."""
        return [(req, joined[0] + win.start)
                for req, joined in zip(self.members.values(), self._joined_at.values())]

    def blocks_needed(self, k: int) -> int:
        """New KV blocks the members take to reserve k slots each: a member holding c tokens
        needs ceil((c + k) / bs) - ceil(c / bs), which depends on c mod bs alone."""
        bs, pos, need = self.block_size, self.position, 0
        for off, count in enumerate(self._by_offset):
            if count:
                r = (off + pos) % bs
                need += count * ((r + k + bs - 1) // bs - (r + bs - 1) // bs)
        return need

    def window(self, k: int) -> DecodeWindow:
        """The next window of k steps (its blocks already taken); its finishing members (those
        whose end is one of its positions) leave the ends now."""
        pos = self.position
        longest, members = self._longest, self.members
        while longest[0] % _ORDER not in members:
            heapq.heappop(longest)
        ends, finishing = self._ends, []
        for end in range(pos + 1, pos + k + 1):  # the ends at the window's positions
            orders = ends.pop(end, None)
            if orders is not None:
                for order in orders:
                    finishing.append((end, order, members[order]))
        n = len(members)
        if len(finishing) > 1:
            finishing.sort(key=_join_order)
        return DecodeWindow(pos, n, self._offset_sum + n * (pos + 1),
                            pos + 1 - longest[0] // _ORDER, finishing)

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
        members, joined_at, bs = self.members, self._joined_at, self.block_size
        for end, order, req in win.finishing:
            del members[order]
            offset, joined, _ = joined_at.pop(order)
            self._by_offset[offset % bs] -= 1
            self._offset_sum -= offset
            owed = end - pos
            req.num_computed_tokens = offset + pos + k
            req.num_output_tokens = req.max_tokens
            req.finish_time = step_times[owed - 1]
            wasted += k - owed
            win.runs.append((joined, end))
            finished.append(req)
        return finished, wasted

    def settle(self) -> list[Request]:
        """Write every member's computed and output tokens and token times back and empty the
        group; the members, in join order (their blocks by count are the caller's to assign)."""
        pos, log = self.position, self.log
        out = []
        for req, (offset, joined, outputs) in zip(self.members.values(),
                                                  self._joined_at.values()):
            req.num_computed_tokens = offset + pos
            req.num_output_tokens = outputs + pos - joined
            req.token_times.extend(log[joined:pos])
            out.append(req)
        self.members.clear()
        self._joined_at.clear()
        self._by_offset = [0] * self.block_size
        self._offset_sum = 0
        self._longest.clear()
        self._ends.clear()
        return out


def _join_order(entry: tuple[int, int, Request]) -> int:
    return entry[1]
