"""The scheduler's side of a window that has run (``update()``): its sampled tokens credited,
finished requests' blocks freed, the decode group advanced, overlap's placeholders settled. A
part of ``Scheduler`` (policies/scheduler.py), which forms the windows."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import islice

from policies.batch import Batch
from policies.request import Request, RequestState

_RUNNING = RequestState.RUNNING


class WindowUpdate:
    """``Scheduler.update`` and what it calls (the scheduler's state is its own)."""

    def update(self, batch: Batch, step_times: Sequence[float],
               sampled: Sequence[Sequence[int]] | None = None) -> list[Request]:
        """Take each step's sampled tokens and delivery times; finish requests and free blocks."""
        if len(step_times) != batch.num_steps:
            raise ValueError(f"update: {len(step_times)} step times for a {batch.num_steps}-step window")
        if self.overlap:
            return self._settle_placeholders(batch, step_times, sampled)
        if batch.decodes is not None:
            return self._advance_group(batch, step_times)
        finished: list[Request] = []
        wasted = 0
        k = len(step_times)
        for i, s in enumerate(batch.seqs):
            req = s.request
            n = s.num_steps
            computed = s.num_cached_tokens + s.num_query_tokens + n - 1
            req.num_computed_tokens = computed
            generated = req.num_output_tokens
            owed = req.max_tokens - generated
            if computed < req.prompt_len + generated:
                continue  # a prefill chunk that samples nothing
            if sampled is None:  # no token ids (the simulator): _credit's work, inline
                if n < owed:
                    req.token_times.extend(step_times if n == k else step_times[:n])
                    req.num_output_tokens = generated + n
                    continue
                useful, done = owed, True
                req.token_times.extend(step_times if owed == k else step_times[:owed])
                req.num_output_tokens = generated + owed
            else:
                useful = n if n < owed else owed
                useful, done = _credit(req, n, useful, useful == owed, sampled[i], step_times)
            wasted += n - useful
            if done:
                req.state = RequestState.FINISHED
                req.finish_time = step_times[useful - 1]
                self._free(req)
                finished.append(req)
        if finished:
            self.running = [r for r in self.running if r.state is _RUNNING]
        if self._grouped:  # the prefill window's requests decode now: they join
            joining = [s.request for s in batch.seqs if s.request.state is _RUNNING]
            for req in joining:
                if req.num_computed_tokens != req.prompt_len + req.num_output_tokens - 1:
                    raise RuntimeError(f"request {req.request_id} is still prefilling after "
                                       "a whole-prompt prefill window")
            self._group.join(joining)
        batch.num_wasted_steps = wasted
        self.stats.num_wasted_steps += wasted
        return finished

    def _advance_group(self, batch: Batch, step_times: Sequence[float]) -> list[Request]:
        """update() of a decode group's window: its finishing members finish."""
        finished, wasted = self._group.advance(batch.decodes, step_times)
        if finished:
            for req in finished:
                req.state = RequestState.FINISHED
                self._free(req)
            # every running request is a member, in join order (it joins in running order, and
            # a window that admits is not a group's): those left are the running list
            members = self._group.members
            if len(members) != len(self.running) - len(finished):
                raise RuntimeError(f"{len(self.running)} requests running, a decode group of "
                                   f"{len(members)} after {len(finished)} finished")
            self.running = list(members.values())
        batch.num_wasted_steps = wasted
        self.stats.num_wasted_steps += wasted
        return finished

    def _free(self, req: Request) -> None:
        """Give a finished request's blocks back, those taken by count (grouped) included:
        its reservation covered its computed tokens exactly."""
        bm = self.block_manager
        if self._grouped:  # (bm.blocks_for's rounding)
            bm.unassigned -= -(-req.num_computed_tokens // bm.block_size) - len(req.block_table)
        bm.free(req)

    def _settle_placeholders(self, batch: Batch, step_times: Sequence[float],
                             sampled: Sequence[Sequence[int]] | None) -> list[Request]:
        """update() with overlap: the window's placeholders become tokens, up to a stop."""
        if not self._in_flight or batch is not self._in_flight[0]:
            raise ValueError(f"update: window {batch.window_id} is not the oldest one in flight")
        self._in_flight.popleft()
        finished: list[Request] = []
        wasted = late = 0
        for i, s in enumerate(batch.seqs):
            useful = s.num_placeholders
            if useful == 0:
                continue  # a prefill chunk that samples nothing
            req = s.request
            n = s.num_steps
            if req.state is RequestState.FINISHED:  # stopped in the window before this one
                wasted += n
                late += n
                continue
            req.num_output_placeholders -= useful
            done = req.num_output_tokens + useful == req.max_tokens
            tokens = None if sampled is None else sampled[i]
            useful, done = _credit(req, n, useful, done, tokens, step_times)
            wasted += n - useful
            if done:
                req.state = RequestState.FINISHED
                req.finish_time = step_times[useful - 1]
                req.num_output_placeholders = 0  # a window formed since counted it on: wasted
                self.block_manager.free(req)  # none left if it was preempted while in flight
                finished.append(req)
        if finished:
            self.running = [r for r in self.running if r.state is _RUNNING]
            self.finishing = [r for r in self.finishing if r.state is _RUNNING]
            if any(r.state is RequestState.FINISHED for r in self.waiting):
                self.waiting = deque(r for r in self.waiting if r.state is not RequestState.FINISHED)
        batch.num_wasted_steps = wasted
        self.stats.num_wasted_steps += wasted
        self.stats.num_late_stop_steps += late
        return finished

def known_done(req: Request) -> bool:
    """Overlap: the request's last token is among its placeholders."""
    return req.num_output_tokens + req.num_output_placeholders >= req.max_tokens


def _credit(req: Request, n: int, useful: int, done: bool, tokens: Sequence[int] | None,
            step_times: Sequence[float]) -> tuple[int, bool]:
    """Give ``req`` the first ``useful`` of its ``n`` steps' tokens (``tokens``: the sampled ids,
    None where the backend samples none), stopping after an EOS; (tokens kept, finished)."""
    if tokens is not None:
        if len(tokens) < n:
            raise ValueError(f"update: request {req.request_id} got {len(tokens)} "
                             f"tokens for {n} steps")
        if req.eos_token_id is not None and req.eos_token_id in tokens[:useful]:
            useful = list(tokens[:useful]).index(req.eos_token_id) + 1
            done = True
        req.output_token_ids.extend(tokens[:useful])
    req.token_times.extend(islice(step_times, useful))
    req.num_output_tokens += useful
    return useful, done
