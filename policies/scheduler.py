"""The scheduler both backends call: the mechanism under a policy's decisions, forming each window
(queues, admission under budgets, lookahead reservation, recompute preemption, overlap's
placeholders) and taking its outcome (``update()``), over one state of its own."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import islice

from policies.base import Policy, StepTimeFn
from policies.batch import Batch, ScheduledSeq
from policies.block_manager import BlockManager
from policies.decode_group import DecodeGroup, DecodeWindow
from policies.hooks import PolicyHooks, SpeculationHooks
from policies.request import Request, RequestState
from policies.scheduler_config import SchedulerConfig, SchedulerStats
from policies.speculation import SpecDecodeStats, Speculation

_RUNNING = RequestState.RUNNING


def token_budget(policy: Policy, config: SchedulerConfig, max_model_len: int) -> int:
    """A window's tokens at most: ``scheduler.max_num_batched_tokens``, else vLLM's default
    (2048 with chunked prefill, else max(max_model_len, 2048))."""
    default = 2048 if policy.mixed_batches else max(max_model_len, 2048)
    return config.max_num_batched_tokens or default


class Scheduler:
    """Forms windows for one engine; knows nothing about clocks, devices or simpy.

    The loop of a backend: ``batch = schedule(now)``, run it, ``update(batch, ...)``. With
    ``scheduler.overlap`` one more ``schedule()`` may come between a window's launch and its
    ``update()`` (see ``schedule``). Both halves read and write one state (the queues, the
    block manager, the decode group, the windows in flight), so they are one class, in
    sections: requests in and out, forming a window, a window that has run, overlap's
    windows in flight, the decode group.
    """

    def __init__(self, policy: Policy, config: SchedulerConfig, num_blocks: int,
                 max_model_len: int, step_time_fn: StepTimeFn | None = None,
                 speculation: Speculation | None = None) -> None:
        self.policy = policy
        # the policy's hooks as called here (a user's policy's answers checked: policies/hooks.py)
        self.hooks = PolicyHooks(policy)
        self.config = config
        self.max_model_len = max_model_len
        if policy.max_steps > max_model_len:  # each step of a window takes a position
            raise ValueError(f"policy.num_steps = {policy.max_steps} exceeds model.max_model_len "
                             f"{max_model_len}: a window cannot run more steps than a sequence "
                             "has positions")
        self.max_num_batched_tokens = token_budget(policy, config, max_model_len)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.watermark,
                                          config.enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the tail is preempted first
        self.overlap = config.overlap
        # Overlap: requests whose last token a window in flight samples; they take no further
        # part, and their blocks stay theirs until that window's update().
        self.finishing: list[Request] = []
        self._in_flight: deque[Batch] = deque()  # overlap: formed and not yet updated, in order
        self.stats = SchedulerStats()
        self._window_id = 0
        # What the engine's clock has shown the scheduler (the times passed to it): recent
        # arrivals and the time per step of past windows. Policies may read them (adaptive).
        self.now = 0.0
        self.recent_arrivals: deque[float] = deque(maxlen=256)
        self.step_time: float | None = None  # EWMA of seconds per step, idle gaps excluded
        self._last_window: tuple[float, int] | None = None  # (start time, k)
        self.forming: list[ScheduledSeq] = []  # the window being formed, for the policy's hooks
        self.step_time_fn = step_time_fn  # a cost model's step time (Policy.needs_step_time)
        if policy.needs_step_time and step_time_fn is None:
            raise ValueError(f"policy {policy.name} sizes windows by time and needs a hardware "
                             "profile's cost model")
        # Speculative decoding (spec): its policy picks each decode's draft length (k) per
        # window and per request; a decode drafting k computes k + 1 tokens a step, and the
        # draft tokens it accepts are drawn as the window is formed (policies/speculation.py)
        self.speculation = speculation
        self.spec_stats = SpecDecodeStats()
        # KV slots a decode window may take past a request's tokens: one a step of the policy's
        # longest window, k + 1 a step where speculation drafts k (read for every request added)
        self.lookahead_slots = policy.max_steps * (
            1 if speculation is None else speculation.num_tokens + 1)
        self._spec_hooks = None
        if speculation is not None:
            self._spec_hooks = SpeculationHooks(speculation.policy)
            if speculation.policy.needs_step_time and step_time_fn is None:
                raise ValueError(f"speculation policy {speculation.policy.name} prices steps and "
                                 "needs a hardware profile's cost model")
        self._group: DecodeGroup | None = None  # group_decodes(): the running decoders' group
        # Between windows, every running request is in the group; its blocks past its block
        # table (all, for one admitted meanwhile) are taken by count. False while a window formed
        # one sequence at a time is out (its update() brings them back).
        self._grouped = False
        self._ungroup = False  # a request whose blocks may be shared came: no group from now
        # Disaggregation (add_prefilled): requests whose KV was computed on another replica,
        # waiting to be admitted as decoders
        self.prefilled: deque[Request] = deque()

    # ----------------------------------------------- requests in and out
    def add_request(self, req: Request) -> None:
        total = req.prompt_len + req.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"request {req.request_id}: prompt_len + max_tokens = {total} exceeds "
                             f"model.max_model_len {self.max_model_len}")
        if not self.policy.chunk_prefills and total > self.max_num_batched_tokens:
            # A recomputed request is prefilled whole, so its longest prefill must fit the budget.
            raise ValueError(
                f"request {req.request_id}: prompt_len + max_tokens = {total} exceeds "
                f"scheduler.max_num_batched_tokens {self.max_num_batched_tokens} and policy "
                f"{self.policy.name} does not chunk prefills")
        bm = self.block_manager
        need = bm.blocks_for(total + self.lookahead_slots)
        if need > bm.num_blocks - bm.watermark_blocks:
            raise ValueError(
                f"request {req.request_id} needs {need} KV blocks but the cache has "
                f"{bm.num_blocks} (minus {bm.watermark_blocks} watermark); give the KV cache more "
                "memory (gpu_memory_utilization) or use shorter requests")
        if req.prefix_segments is not None and self._group is not None \
                and self.config.enable_prefix_caching:  # its blocks may be shared
            self._ungroup = True  # before the next window (one may be in flight now)
        req.state = RequestState.WAITING
        req.waiting_since = req.arrival_time
        self.waiting.append(req)
        self.recent_arrivals.append(req.arrival_time)

    def abort(self, request_id: int) -> bool:
        """End request ``request_id`` now, wherever it is, and give its KV blocks back; False
        if the scheduler does not hold it (finished, or never added).

        Call it between windows (before ``schedule()``). With ``scheduler.overlap`` the request
        may be in the window in flight: its blocks are freed now all the same, because the
        backend runs windows in order, so a window formed from here on that takes a freed
        block writes it after the window in flight is done with it. That window's ``update()``
        finds the request finished and counts its slots as wasted, as it does for a request
        whose EOS it learns one window late.
        """
        for queue in (self.running, self.finishing, self.waiting):
            for req in queue:
                if req.request_id == request_id:
                    if req.group_offset is not None:
                        self._group.leave(req)
                    queue.remove(req)
                    self._free(req, RequestState.FINISHED)  # a preempted one holds no block
                    req.num_output_placeholders = 0
                    return True
        return False

    def _preempt(self, req: Request) -> None:
        """Recompute-preemption: give the blocks back (schedule() returns it to the queue)."""
        running = self.running
        if running and running[-1] is req:  # the usual victim: the tail
            running.pop()
        else:
            running.remove(req)
        self._free(req, RequestState.PREEMPTED)
        req.waiting_since = self.now
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1

    def _free(self, req: Request, state: RequestState) -> None:
        """``req`` leaves (``state``: finished, aborted or preempted) and gives its KV blocks
        back: the one way out, for every path. Blocks the decode group took by count for it
        go back too (its reservation covered its computed tokens exactly; a member's fields
        caught up first)."""
        req.state = state
        bm = self.block_manager
        if self._grouped:
            bm.unassigned -= bm.blocks_for(req.num_computed_tokens) - len(req.block_table)
        bm.free(req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting) or bool(self.running) or bool(self.finishing) \
            or bool(self.prefilled)

    def stalled(self) -> str | None:
        """Why this scheduler will never form a window, asked when ``schedule()`` formed none
        and none is in flight: it holds requests the policy formed no batch for (a user's
        ``admit`` that refuses them all, a budget of nothing), and nothing but a new request
        or an abort changes its state. None if it holds none. The one definition of a stalled
        engine: the simulator and an offline run stop with it once nothing more arrives, the
        server fails the requests it holds with it (/health says so)."""
        if not self.has_unfinished or self._in_flight:
            return None
        policy = self.policy
        prefilled = f" (and {len(self.prefilled)} prefilled elsewhere)" if self.prefilled else ""
        return (f"policy {policy.name} ({type(policy).__name__}) formed no batch with "
                f"{self.num_waiting} waiting{prefilled} and {self.num_running} running requests, "
                "and none in flight: they would wait forever")

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -------------------------------------------------- forming a window
    def defers_schedule(self) -> bool:
        """Overlap with ``scheduler.overlap_late_schedule``: whether the backend should form the
        next window as late as the window in flight allows (policies/late_schedule.py). Only
        while no request waits: then what the next window could still take is what arrives
        meanwhile, and forming it later loses nothing; with a queue, it is formed at once."""
        return (self.overlap and self.config.overlap_late_schedule and not self.waiting
                and bool(self._in_flight))

    def schedule(self, now: float) -> Batch | None:
        """Form the next window, or None when nothing can run.

        Without overlap, every window is update()d before the next schedule(). With
        ``scheduler.overlap``, schedule() may also be called once while the last window is still in
        flight (launched, not yet update()d), and the window it forms assumes that one's
        outcome: each of its requests continues with its KV computed and its samples counted
        as placeholders (the backend finds the newest one on the device, not the host); one
        whose ``max_tokens``-th token is among them is known done and left out; one that
        stops on EOS is learnt of one window late, and update() counts the slots it wastes in
        the window after. At most two windows are in flight, and update() takes them in the
        order they were formed. If that schedule() formed nothing, call update() before asking
        again: a request preempted while in flight is not re-admitted before its tokens are in.
        """
        if len(self._in_flight) > 1:
            raise RuntimeError("schedule(): two windows are in flight; update() the older first")
        self._observe(now)
        self.forming = []
        if self._ungroup:
            if self._grouped:
                self._leave_group()
            self._group, self._ungroup = None, False
        policy = self.policy
        if policy.orders_queue:
            self._order_queues()
        if self.prefilled:
            self._admit_prefilled()
        preempted: list[Request] = []
        if policy.preemptive and self.waiting:
            for victim in self.hooks.preempt_for_waiting(self):
                self._preempt(victim)
                preempted.append(victim)
        decodes = None
        if policy.mixed_batches:
            seqs, k, has_prefill = self._schedule_mixed(preempted)
        else:
            seqs, k, has_prefill, decodes = self._schedule_separate(preempted)
        # As vLLM does, victims rejoin the queue head only now, so none is re-admitted (and
        # recomputed) in the very window that preempted it; the earliest admitted goes first.
        self.waiting.extendleft(preempted)
        if not seqs and decodes is None:
            self._last_window = None  # the engine idles: the next gap is not a step time
            return None
        if not self.overlap:
            self._last_window = (now, k, has_prefill)
        else:  # the time to the next schedule() is the GPU time of the window now in flight
            older = self._in_flight[0] if self._in_flight else None
            self._last_window = (now, older.num_steps, older.has_prefill) if older else None
        if self.speculation is not None and self.speculation.acceptance is not None:
            self._draw_accepted(seqs)
        self._window_id += 1
        st = self.stats
        st.num_invocations += 1
        st.num_windows += 1
        st.num_steps += k
        batch = Batch(seqs, k, self._window_id, preempted, decodes=decodes)
        if self.overlap:
            self._hold_placeholders(batch)
            self._in_flight.append(batch)
        return batch

    def window_seqs(self, batch: Batch) -> list[tuple[Request, int, int, int, bool]]:
        """(request, query tokens, cached tokens, steps, is prefill) of each sequence of the
        window just formed (before its update()), a decode group's window's as the sequences it
        stands for: for traces and checks."""
        out = [(s.request, s.num_query_tokens, s.num_cached_tokens, s.num_steps, s.is_prefill)
               for s in batch.seqs]
        if batch.decodes is not None:  # every running request, at the window's position
            start, k = batch.decodes.start, batch.num_steps
            out += [(req, 1, req.num_computed_tokens + start - req.group_offset, k, False)
                    for req in self.running]
        return out

    def _observe(self, now: float) -> None:
        self.now = now
        if self._last_window is not None:
            start, k, had_prefill = self._last_window
            if now > start and not had_prefill:  # decode steps only
                per_step = (now - start) / k
                self.step_time = per_step if self.step_time is None else \
                    0.8 * self.step_time + 0.2 * per_step

    def _order_queues(self) -> None:
        """``policy.queue_key`` order (stable): the waiting queue, and for a preemptive policy
        the running one, whose tail is then its first victim."""
        key = self.hooks.queue_key
        try:
            self.waiting = deque(sorted(self.waiting, key=lambda r: key(r, self)))
            if self.policy.preemptive:
                self.running.sort(key=lambda r: key(r, self))
        except TypeError as err:  # keys that do not compare: a user's policy broke its contract
            if not self.hooks.checked:
                raise
            raise self.hooks.incomparable(err) from err

    def arrival_rate(self, horizon: float = 1.0) -> float:
        """Requests per second of the arrival stream over the last ``horizon`` seconds.

        Estimated from the spread of those arrivals, so a batch that arrived at one instant
        (offline, request_rate=inf) is no stream: its rate is 0.
        """
        first = last = None
        n = 0
        for t in reversed(self.recent_arrivals):
            if t <= self.now - horizon:
                break
            first = t
            last = last if last is not None else t
            n += 1
        if n < 2 or last <= first:
            return 0.0
        return (n - 1) / max(last - first, self.now - first)

    def _schedule_separate(self, preempted: list[Request]
                           ) -> tuple[list[ScheduledSeq], int, bool, DecodeWindow | None]:
        """vLLM V0 default: a prefill-only batch (one step) when prompts fit, else a decode window
        (the window, k, whether it has prefills, the decode group's window in its place)."""
        tokens, seqs = self.hooks.window_budget(self)
        if self.waiting:
            prefills = self._admit(tokens, seqs, steps=1)
            if prefills:
                return prefills, 1, True, None
        k = self.hooks.window_steps(self, False)
        if self._grouped and self.running and self._group_takes(k, tokens):
            return [], k, False, self._group.window(k)
        return self._reserve_decodes(k, tokens, preempted)[0], k, False, None

    def _schedule_mixed(self, preempted: list[Request]) -> tuple[list[ScheduledSeq], int, bool]:
        """Chunked-prefill family: decodes first, then prefill chunks up to the token budget."""
        policy, hooks = self.policy, self.hooks
        budget, max_seqs = hooks.window_budget(self)
        seqs, prefilling = self._reserve_decodes(policy.max_steps, budget, preempted)
        budget -= len(seqs) if self.speculation is None else sum(s.num_query_tokens
                                                                 for s in seqs)
        prefills: list[ScheduledSeq] = []
        self.forming = seqs + prefills
        for req in prefilling:  # prefills started in an earlier window continue first
            if budget <= 0:
                break
            if req.state is not _RUNNING:
                continue  # preempted for a decode's blocks
            chunk = hooks.chunk_size(req, req.seq_len - req.num_computed_tokens, budget, self)
            if chunk <= 0:
                break
            prefills.append(ScheduledSeq(req, chunk, req.num_computed_tokens, 1, True))
            self.forming.append(prefills[-1])
            if req.prefix_segments is not None:
                self.block_manager.cache_blocks(req, req.num_computed_tokens + chunk)
            budget -= chunk
        if self.waiting and budget > 0:
            lookahead = hooks.prefill_steps(policy.max_steps) - 1
            prefills += self._admit(budget, max_seqs, steps=lookahead + 1)
        k = hooks.window_steps(self, bool(prefills))
        for s in seqs:
            s.num_steps = k
        if prefills:
            steps = hooks.prefill_steps(k)
            for s in prefills:
                if s.samples:
                    s.num_steps = steps
            if not seqs:  # nobody decodes after step 1 (cp2 with prefills only): no empty steps
                k = max(s.num_steps for s in prefills)
        return seqs + prefills, k, bool(prefills)

    def _admit(self, budget: int, max_seqs: int, *, steps: int) -> list[ScheduledSeq]:
        """Admit waiting requests in queue order while tokens, seats and blocks allow; the
        first that does not fit stops admission (no request overtakes it)."""
        now = self.now
        out: list[ScheduledSeq] = []
        bm = self.block_manager
        policy = self.policy
        waiting, running = self.waiting, self.running
        forming = self.forming
        # the policy's admission hook, where it has its own (the base's admits every request)
        admit = None if type(policy).admit is Policy.admit else self.hooks.admit
        chunk_size = self.hooks.chunk_size
        i = 0
        while i < len(waiting) and budget > 0 and len(running) < max_seqs:
            req = waiting[i]
            if req.num_output_placeholders:
                if not policy.orders_queue:
                    break  # preempted while in flight: its tokens are not all known yet
                i += 1
                continue
            if admit is not None and not admit(req, self):
                i += 1
                continue
            # a preempted request recomputes its outputs too; a cached prefix is not computed
            hits = bm.match(req) if req.prefix_segments is not None else None
            cached = len(hits) * bm.block_size if hits else 0
            seq_len = req.prompt_len + req.num_output_tokens  # (req.seq_len)
            num_new = seq_len - cached
            q = chunk_size(req, num_new, budget, self)
            if q <= 0:
                break
            # the whole sequence, and the window's later steps' slots (one token a step) if
            # this chunk ends it: its num_slots past the cached tokens, at least seq_len
            reserve = seq_len + (steps - 1 if q == num_new else 0)
            if not bm.can_allocate(reserve, hits):
                break
            if hits:
                bm.take_hits(req, hits)
            if self._grouped:  # by count, as the group it joins once its prefill is done
                bm.unassigned += bm.blocks_for(reserve)
            else:
                bm.ensure_slots(req, reserve)
            if i == 0:
                waiting.popleft()
            else:
                del waiting[i]
            req.state = _RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            if req.waiting_since is not None:  # its wait in the queue ends
                wait = now - req.waiting_since
                if wait > req.max_wait:
                    req.max_wait = wait
                req.waiting_since = None
            req.num_computed_tokens = cached
            if req.num_preemptions == 0:
                req.num_cached_prompt_tokens = cached
            running.append(req)
            seq = ScheduledSeq(req, q, cached, steps if q == num_new else 1, True)
            out.append(seq)
            forming.append(seq)
            if hits is not None:  # its blocks computed by this window are found from now on
                bm.cache_blocks(req, cached + q)
            budget -= q
        return out

    def _reserve_decodes(self, k: int, budget: int, preempted: list[Request]
                         ) -> tuple[list[ScheduledSeq], list[Request]]:
        """Reserve each decoding request's slots for k steps (its ``num_slots``), preempting
        from the tail; (the decodes, the running requests still prefilling, in running order).

        The one pass a window makes over the running requests, so it is where they are told
        apart (``Request.in_prefill``), under mixed batches only: a separate-batch window
        prefills whole prompts, so there every running request decodes (a test holds the
        scheduler to that). Where a block runs short or the window has fewer seats than
        requests run, the decoders from there on go through the loop that preempts."""
        out: list[ScheduledSeq] = []
        prefilling: list[Request] = []
        bm = self.block_manager
        ensure, bs = bm.ensure_slots, bm.block_size
        running = self.running
        mixed = self.policy.mixed_batches
        i = 0
        if budget >= len(running) and self.speculation is None:
            # the common case, one token a step, in one pass until a block runs short
            append = out.append
            for i, req in enumerate(running):  # noqa: B007 (i: where a shortage stopped it)
                if mixed and req.in_prefill:
                    prefilling.append(req)
                    continue
                cached = req.num_computed_tokens
                end = cached + k  # its num_slots: one token a step
                # the block table holds the window's slots already (the common case)
                if not (end <= len(req.block_table) * bs or ensure(req, end)):
                    break
                append(ScheduledSeq(req, 1, cached, k, False))
            else:
                self.forming = out
                return out, prefilling
        rest = running[i:]
        prefilling += [r for r in rest if r.in_prefill]
        out = self._reserve_preempting(out, [r for r in rest if not r.in_prefill], k, budget,
                                       preempted)
        self.forming = out
        return out, prefilling

    def _reserve_preempting(self, out: list[ScheduledSeq], decoders: list[Request], k: int,
                            budget: int, preempted: list[Request]) -> list[ScheduledSeq]:
        """``out`` (the decodes reserved so far) and k steps' slots for each of ``decoders``
        (running requests that decode, in running order) while the window has room for
        sequences (their tokens, where speculation drafts: k + 1 a step), preempting the
        policy's victims where blocks run short."""
        ensure, bs = self.block_manager.ensure_slots, self.block_manager.block_size
        running = self.running
        spec = self._spec_hooks
        if spec is not None:
            drafts = spec.window_tokens(self)
        used = sum(s.num_query_tokens for s in out)  # the window's tokens reserved so far
        for req in decoders:
            if len(out) >= budget:
                break
            if req.state is not _RUNNING:
                continue  # preempted for one before it
            cached = req.num_computed_tokens
            if spec is None:
                seq = ScheduledSeq(req, 1, cached, k, False)
                end = cached + k  # its num_slots: one token a step
            else:  # its draft and the newest token a step, within the window's token budget
                w = (spec.request_tokens(req, drafts, self) if drafts else 0) + 1
                if used + w > budget:
                    break
                seq = ScheduledSeq(req, w, cached, k, False, 0, w)
                end = cached + seq.num_slots
            if end <= len(req.block_table) * bs:
                out.append(seq)
                used += seq.num_query_tokens
                continue
            while not ensure(req, end):
                victim = self.hooks.preemption_victim(self, req)
                before = running.index(victim) < running.index(req)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
                if before:  # reserved earlier in this window: its slots are gone
                    used -= sum(s.num_query_tokens for s in out if s.request is victim)
                    out = [s for s in out if s.request is not victim]
            else:
                out.append(seq)
                used += seq.num_query_tokens
        return out

    def _draw_accepted(self, seqs: list[ScheduledSeq]) -> None:
        """Each speculating decode's accepted draft tokens at each of its steps, from the
        workload's acceptance process (the same draws for every backend), as the step's
        request would see them: its output tokens before the step (overlap's placeholders
        counted) and its k."""
        draw = self.speculation.acceptance.num_accepted
        for s in seqs:
            k = s.num_decode_tokens - 1
            if k <= 0 or s.is_prefill:
                continue
            req = s.request
            rid, n = req.request_id, req.num_output_tokens + req.num_output_placeholders
            accepted = []
            for _ in range(s.num_steps):
                a = draw(rid, n, k)
                accepted.append(a)
                n += a + 1
            s.num_accepted = accepted

    # --------------------------------------------- a window that has run
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
            if s.num_decode_tokens != 1:  # several tokens a step
                wasted += self._credit_wide(s, None if sampled is None else sampled[i],
                                            step_times, finished)
                continue
            req = s.request
            n = s.num_steps
            # one token a step: its computed tokens catch up by the window's (its num_slots)
            req.num_computed_tokens = s.num_cached_tokens + s.num_query_tokens + n - 1
            if not s.num_sampled_tokens:
                continue  # a prefill chunk that samples nothing
            generated = req.num_output_tokens
            owed = req.max_tokens - generated
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
                req.finish_time = step_times[useful - 1]
                self._free(req, RequestState.FINISHED)
                finished.append(req)
        if finished:
            self.running = [r for r in self.running if r.state is _RUNNING]
        if self._group is not None:
            self._join(batch)
        batch.num_wasted_steps = wasted
        self.stats.num_wasted_steps += wasted
        return finished

    def _credit_wide(self, s: ScheduledSeq, tokens: Sequence[int] | None,
                     step_times: Sequence[float], finished: list[Request]) -> int:
        """update()'s work for a sequence that computes several tokens a step (its
        ``num_decode_tokens``), apart from the one-token loop it would slow: its computed
        tokens, its tokens up to its owed ones (each at its step's time), its finish; the steps
        it ran past its end."""
        req = s.request
        computed = s.num_cached_tokens + s.num_kept_slots
        req.num_computed_tokens = computed
        if not s.num_sampled_tokens:
            return 0  # (a prefill chunk that samples nothing)
        owed = req.max_tokens - req.num_output_tokens
        emits = s.num_emitted_tokens
        useful = emits if emits < owed else owed
        useful, done = _credit(req, emits, useful, useful == owed, tokens,
                               s.emit_times(step_times))
        steps = s.steps_for(useful)
        if s.num_accepted is not None:
            self.spec_stats.record(s.num_accepted, s.num_decode_tokens - 1, steps)
        if done:
            req.finish_time = step_times[steps - 1]
            self._free(req, RequestState.FINISHED)
            finished.append(req)
        elif s.num_accepted is not None:  # the rejected draft tokens' slots are rolled back
            self.block_manager.trim(req, computed)
        return s.num_steps - steps

    # --------------------------------------- overlap's windows in flight
    def _hold_placeholders(self, batch: Batch) -> None:
        """Overlap: move each request past ``batch`` as if it ran to its end without stopping:
        its KV is computed, its samples are placeholders, and a request that samples its last
        token in it leaves ``running`` for ``finishing``."""
        done = False
        for s in batch.seqs:
            req = s.request
            w = s.num_decode_tokens
            # every token the window computes for it (its num_slots) but rejected draft tokens
            req.num_computed_tokens = s.num_cached_tokens + (
                s.num_query_tokens + (s.num_steps - 1) * w if s.num_accepted is None
                else s.num_kept_slots)
            if s.num_sampled_tokens:  # it samples
                owed = req.max_tokens - req.num_output_tokens - req.num_output_placeholders
                s.num_placeholders = min(s.num_steps if w == 1 else s.num_emitted_tokens, owed)
                req.num_output_placeholders += s.num_placeholders
                done = done or s.num_placeholders == owed
        if done:
            running = self.running
            self.running = [r for r in running if not known_done(r)]
            self.finishing += [r for r in running if known_done(r)]

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
            if s.num_decode_tokens == 1:  # one token a step
                steps, done = _credit(req, n, useful, done, tokens, step_times)
            else:
                useful, done = _credit(req, s.num_emitted_tokens, useful, done, tokens,
                                       s.emit_times(step_times))
                steps = s.steps_for(useful)
                if s.num_accepted is not None:
                    self.spec_stats.record(s.num_accepted, s.num_decode_tokens - 1, steps)
            wasted += n - steps
            if done:
                req.finish_time = step_times[steps - 1]
                req.num_output_placeholders = 0  # a window formed since counted it on: wasted
                self._free(req, RequestState.FINISHED)  # none left if preempted in flight
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

    # -------------------------------------------------- the decode group
    def group_decodes(self) -> None:
        """Keep the running decoders as one group (policies/decode_group.py): for a backend
        that needs a decode window's totals, not its sequences (the simulator). The windows are
        the same; it applies under separate batches without overlap, where no policy hook reads
        a running request (``Policy.reads_running``), every decode computes one token a step
        (no speculation) and no block is shared (prefix caching);
        elsewhere this does nothing."""
        policy = self.policy
        if (self.overlap or policy.mixed_batches or policy.chunk_prefills or policy.preemptive
                or vars(type(policy)).get("reads_running", True) or self.running or self.waiting
                or self.speculation is not None):  # the group's members decode one a step
            return
        bm = self.block_manager
        self._group = DecodeGroup(bm.blocks_for, bm.block_size)
        self._grouped = True

    def _group_takes(self, k: int, budget: int) -> bool:
        """Whether the decode group forms this k-step decode window (its blocks taken by
        count): every running request decodes in it. Where one would not (too few blocks or
        tokens for all), the members leave and the caller forms the window one sequence at a
        time; they join again at its update()."""
        bm = self.block_manager
        if budget >= len(self.running) and \
                (need := self._group.blocks_needed(k)) <= bm.num_free_blocks:
            bm.unassigned += need
            return True
        self._leave_group()
        return False

    def _leave_group(self) -> None:
        """Every member leaves the decode group: its fields caught up, its blocks picked."""
        group, bm = self._group, self.block_manager
        for req in self.running:
            group.catch_up(req)
            computed = req.num_computed_tokens
            bm.unassigned -= bm.blocks_for(computed) - len(req.block_table)
            bm.ensure_slots(req, computed)
        group.clear()
        self._grouped = False
        if bm.unassigned:
            raise RuntimeError(f"{bm.unassigned} blocks taken by count are in no block table")

    def _join(self, batch: Batch) -> None:
        """update() of a window formed one sequence at a time: its running requests decode now
        and join the decode group (those of a prefill window; all, where they had left it)."""
        if self._grouped:  # (their blocks taken by count at admission)
            joining = [s.request for s in batch.seqs if s.request.state is _RUNNING]
        else:
            joining = self.running
            blocks_for = self.block_manager.blocks_for
            for req in joining:
                if len(req.block_table) != blocks_for(req.num_computed_tokens):
                    raise RuntimeError(f"request {req.request_id} joins the decode group with "
                                       "blocks for other than its computed tokens")
        for req in joining:
            if req.in_prefill:
                raise RuntimeError(f"request {req.request_id} is still prefilling after "
                                   "a whole-prompt prefill window")
        self._group.join(joining)
        self._grouped = True

    def _advance_group(self, batch: Batch, step_times: Sequence[float]) -> list[Request]:
        """update() of a decode group's window: its finishing members finish."""
        finished, wasted = self._group.advance(batch.decodes, step_times)
        if finished:
            # every running request is a member, in join order, and the finished come in join
            # order: each is found from where the one before it was, so one C-level scan in all
            running, i = self.running, 0
            for req in finished:
                self._free(req, RequestState.FINISHED)
                i = running.index(req, i)
                del running[i]
        batch.num_wasted_steps = wasted
        self.stats.num_wasted_steps += wasted
        return finished

    # ------------------------------------- hand-off between replicas
    # Prefill/decode disaggregation (simulator/disaggregation.py): a prefill replica's scheduler
    # gives a request up once it has sampled its first token and keeps its blocks until its KV
    # has been sent; a decode replica's scheduler admits it with that KV present. Requests are
    # taken and admitted one by one: the decode group (group_decodes) is kept on the decode
    # side (an admitted request joins it), and must be off on the prefill side.

    def take_prefilled(self) -> list[Request]:
        """After ``update()``: the running requests that have sampled a token (their prompt's KV
        computed) leave this scheduler, in admission order, to be decoded elsewhere; their
        blocks stay held until ``release``. Needs per-sequence decodes (no decode group, no
        overlap): the backend calls it on a scheduler that decodes nothing of its own."""
        if self._grouped or self.overlap:
            raise RuntimeError("take_prefilled: a prefill-only scheduler keeps no decode group "
                               "and no overlap")
        running = self.running
        taken = [r for r in running if r.num_output_tokens]
        if taken:
            self.running = [r for r in running if not r.num_output_tokens]
        return taken

    def release(self, req: Request) -> None:
        """Give back the blocks of a request ``take_prefilled`` gave up (its KV has been sent);
        it goes on elsewhere, in the state it has there."""
        self._free(req, req.state)

    def add_prefilled(self, req: Request, now: float) -> None:
        """``req`` continues here with the KV of its sequence but its newest token computed
        elsewhere (a prefill replica's, sent over a link): it waits to be admitted as a decoder
        (in arrival order, before the next window is formed), its blocks taken at admission
        as any request's are. (Whether it fits this replica at all is checked before the run,
        as for every request: experiments/choices.py request_limit.)"""
        if req.num_output_tokens < 1 or req.num_output_tokens >= req.max_tokens:
            raise ValueError(f"request {req.request_id}: add_prefilled takes a request that has "
                             f"sampled 1 to max_tokens - 1 tokens, got {req.num_output_tokens}")
        req.state = RequestState.WAITING
        req.waiting_since = now
        req.num_computed_tokens = req.seq_len - 1
        self.prefilled.append(req)

    def _admit_prefilled(self) -> None:
        """Admit prefilled requests (``add_prefilled``) in arrival order while seats and blocks
        allow (watermark kept): each holds its computed tokens' blocks and decodes from the
        next window on; the first that does not fit waits (none overtakes it)."""
        bm = self.block_manager
        queue, running = self.prefilled, self.running
        max_seqs, now = self.config.max_num_seqs, self.now
        while queue and len(running) < max_seqs:
            req = queue[0]
            computed = req.num_computed_tokens
            if not bm.can_allocate(computed):
                break
            queue.popleft()
            req.state = _RUNNING
            if self._grouped:  # by count, as a group member's blocks are
                bm.unassigned += bm.blocks_for(computed)
                self._group.join((req,))
            else:
                bm.ensure_slots(req, computed)
            wait = now - req.waiting_since
            if wait > req.max_wait:
                req.max_wait = wait
            req.waiting_since = None
            running.append(req)


def known_done(req: Request) -> bool:
    """Overlap: the request's last token is among its placeholders."""
    return req.num_output_tokens + req.num_output_placeholders >= req.max_tokens


def _credit(req: Request, emits: int, useful: int, done: bool, tokens: Sequence[int] | None,
            times: Sequence[float]) -> tuple[int, bool]:
    """Give ``req`` the first ``useful`` of the ``emits`` tokens its window may emit
    (``tokens``: the sampled ids, None where the backend samples none; ``times``: each one's
    step time), stopping after an EOS; (tokens kept, finished)."""
    if tokens is not None:
        if len(tokens) < emits:
            raise ValueError(f"update: request {req.request_id} got {len(tokens)} "
                             f"tokens for {emits} it may emit")
        if req.eos_token_id is not None and req.eos_token_id in tokens[:useful]:
            useful = list(tokens[:useful]).index(req.eos_token_id) + 1
            done = True
        req.output_token_ids.extend(tokens[:useful])
    req.token_times.extend(islice(times, useful))
    req.num_output_tokens += useful
    return useful, done
