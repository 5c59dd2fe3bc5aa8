"""Runs one scheduler window on the model: host inputs built once, k device steps back to back with
advance_step between them, each step's sampled ids pythonized as soon as they reach the host; with
overlap scheduling, launched before the previous window's ids are known (the token map)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from time import perf_counter

import torch

from common.step_sizes import decode_graph_sizes, piecewise_graph_size, prefill_graph_key
from policies.batch import Batch, ScheduledSeq
from policies.request import Request
from policies.sampling_params import Logprob
from real_backend.async_output import StepOutputs
from real_backend.attention import DecodeBuffers, RowBuffers
from real_backend.config import BackendConfig
from real_backend.cuda_graphs import (
    DecodeGraphs,
    PiecewiseGraphs,
    PrefillGraphs,
    capture_decode_graphs,
    capture_piecewise_graphs,
    capture_prefill_graphs,
)
from real_backend.device_inputs import DeviceInputs, WindowPlan
from real_backend.kernels import select_kernels
from real_backend.kv_cache import KVCache, allocate_kv_cache
from real_backend.model import (
    Llama,
    PieceBuffers,
    compute_logits,
    decoder_piece,
    forward,
    forward_piecewise,
)
from real_backend.ops import PAD_SLOT_ID
from real_backend.sampling import PenaltyState, TokenMap, sample, sample_rows, top_logprobs
from real_backend.speculative import Speculator
from real_backend.window_inputs import HostPlan, PlanSizes, plan_window

PROMPT_LOGITS_ROWS = 1024  # prompt logprobs take the logits of this many tokens at a time


@dataclass(slots=True)
class WindowResult:
    step_times: list[float]  # when step j's ids were pythonized (the clock's seconds)
    sampled: list[list[int]]  # per batch.seqs[i]: one id per step it took part in, [] if none
    prepare_s: float  # CPU: building and queueing the window's inputs
    pythonize_s: float  # CPU: device ids -> Python ints
    gpu_step_s: list[float]  # device time of each step (CUDA events); 0 on CPU
    num_tokens: int  # tokens computed in step 1
    launch_s: float = 0.0  # CPU: queueing step 1's kernels (eager steps are launch-bound)
    # per batch.seqs[i], beside ``sampled``: each sampled token's logprobs, where its request
    # asks for them ([] where not); None where no request of the window asks
    logprobs: list[list[Logprob]] | None = None
    # batch.seqs[i] -> (the first prompt position, its logprobs and the next ones'): the
    # prompt logprobs its chunk gave, where its request asks for them
    prompt_logprobs: dict[int, tuple[int, list[Logprob]]] | None = None


@dataclass(slots=True)
class LaunchedWindow:
    """A window whose k steps are queued on the device; ``finish_window`` collects its ids."""

    batch: Batch
    plan: WindowPlan
    outputs: StepOutputs
    timers: list[tuple[torch.cuda.Event, torch.cuda.Event]]
    prepare_s: float
    launch_s: float


class ModelRunner:
    """Owns the device side: model, KV cache, decode buffers, CUDA graphs, sampler, outputs."""

    def __init__(self, model: Llama, cfg: BackendConfig, block_size: int, max_num_seqs: int,
                 max_lookahead: int, clock: Callable[[], float] = perf_counter) -> None:
        self.model, self.cfg = model, cfg
        self.device = model.device
        self.cuda = self.device.type == "cuda"
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.kernels = select_kernels(cfg.kernel_set)
        self.kv_cache: KVCache | None = None
        self.graphs = DecodeGraphs()
        self.outputs = StepOutputs(self.device, clock, cfg.async_output)
        # With overlap two windows' outputs are pending at once: they alternate between these.
        self._overlap_outputs = [self.outputs, StepOutputs(self.device, clock, True)]
        self.token_map = TokenMap(2 * max_num_seqs, self.device)  # running + finishing requests
        self.penalties = PenaltyState(model.spec.vocab_size, self.device)
        # tensor parallelism, rank 0 while serving: hands each window to the worker ranks
        self.publish: Callable[[HostPlan], None] | None = None
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        # Wasted multi-step slots run up to max_lookahead positions past max_model_len.
        width = -(-(model.spec.max_model_len + max_lookahead) // block_size)
        rows = max(max_num_seqs, decode_graph_sizes(max_num_seqs)[-1])  # room for graph padding

        self.inputs = DeviceInputs(self.device, rows, width, self.token_map, self.penalties)
        # The decode graphs' one output: allocated before the memory profile, so that the KV
        # cache is sized around it (an output per graph would hold sum(sizes) rows of logits).
        self.graph_logits: torch.Tensor | None = None
        if cfg.use_cuda_graphs and self.cuda:
            self.graph_logits = torch.empty((rows, model.spec.vocab_size), dtype=torch.float32,
                                            device=self.device)
        self.prefill_graphs = PrefillGraphs()
        self.prefill_graph_replays = 0
        self.piecewise = PiecewiseGraphs()
        self.piecewise_replays = 0
        self.piecewise_capture_s = 0.0
        self.piece_buffers: PieceBuffers | None = None
        self.spec: Speculator | None = None  # speculative decoding (build.py sets it)

    @property
    def buffers(self) -> DecodeBuffers:
        """The static decode inputs (CUDA graphs and advance_step read them)."""
        return self.inputs.decode

    @property
    def prefill_buffers(self) -> RowBuffers:
        """The prefill graphs' static inputs."""
        return self.inputs.prefill

    @property
    def clock(self) -> Callable[[], float]:
        """The clock of the pythonization (delivery) times."""
        return self.outputs.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        for outputs in self._overlap_outputs:
            outputs.clock = clock

    # ------------------------------------------------------------------ setup
    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = allocate_kv_cache(self.model.spec, num_blocks, self.block_size,
                                          self.model.dtype, self.device)
        if self.spec is not None:
            self.spec.allocate_draft_cache(num_blocks)

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture decode graphs for the padded batch sizes up to max_num_seqs (CUDA only)."""
        if not (self.cfg.use_cuda_graphs and self.cuda):
            return
        self.graphs = DecodeGraphs()  # capture runs the eager path
        b = self.buffers
        b.seq_lens.zero_()  # rows of length 0 read nothing; slot -1 writes nothing
        b.slot_mapping.fill_(PAD_SLOT_ID)
        sizes = [s for s in decode_graph_sizes(self.max_num_seqs) if s <= b.input_ids.shape[0]]
        logits = self.graph_logits
        self.graphs = capture_decode_graphs(lambda n: self._decode_eager(n, logits[:n]), sizes)
        if self.spec is not None:
            self.spec.capture_graphs(self.kv_cache, self.max_num_seqs, self.graphs.pool)
        self.prefill_graphs = PrefillGraphs()
        if self.cfg.prefill_graph_max_tokens:
            p = self.prefill_buffers
            p.query_start_loc.zero_()  # every sequence empty: capture computes no attention
            p.seq_lens.zero_()
            p.slot_mapping.fill_(PAD_SLOT_ID)
            self.prefill_graphs = capture_prefill_graphs(
                self._prefill_static, self.cfg.prefill_graph_max_tokens, self.graphs.pool)
        self.piecewise = PiecewiseGraphs()
        if self.cfg.piecewise_graph_max_tokens:
            model = self.model
            self.piece_buffers = pb = PieceBuffers.allocate(
                model.spec, self.cfg.piecewise_graph_max_tokens, model.dtype, self.device)
            t0 = perf_counter()
            self.piecewise = capture_piecewise_graphs(
                lambda t, i: decoder_piece(model, pb, i, t, self.kernels),
                len(model.layers) + 1, self.cfg.piecewise_graph_max_tokens, self.graphs.pool)
            self.piecewise_capture_s = perf_counter() - t0

    def _block0_request(self, i: int, n: int) -> Request:
        # Every block id is 0: contents are garbage, but shapes and memory are the real ones.
        # (Block 0 of the real cache may take it: every slot is written before it is read.)
        return Request(-1 - i, 0.0, n, 1, prompt_token_ids=[0] * n,
                       block_table=[0] * (-(-(n + 2) // self.block_size)))

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_seqs: int, scratch: bool = True) -> None:
        """The largest eager steps the scheduler can form (num_tokens of prefill over num_seqs
        sequences, then a num_seqs decode, then, speculating, a drafting window of num_seqs
        rows: the draft's catch-up over num_tokens, its k + 1 steps and the verify over
        num_seqs x (k + 1) positions with their logits), on one-block scratch caches (memory
        profiling) or on block 0 of the real ones (warm-up)."""
        num_seqs = max(1, min(num_seqs, num_tokens))
        lens = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
        with self._profile_caches(scratch):
            prefill = [ScheduledSeq(self._block0_request(i, n), n, 0, 1, True)
                       for i, n in enumerate(lens)]
            self.run_window(Batch(prefill, 1))
            decode = [ScheduledSeq(self._block0_request(i, 1), 1, 0, 2, False)
                      for i in range(num_seqs)]
            self.run_window(Batch(decode, 2))  # two steps: advance_step is compiled here too
            if self.spec is not None:
                self._drafting_window(lens)

    @torch.inference_mode()
    def profile_graph_steps(self, num_seqs: int) -> None:
        """Eagerly, on scratch caches, the largest steps captured as CUDA graphs (a prefill of
        the most tokens a prefill or piecewise graph takes, a num_seqs decode; speculating,
        the verify of num_seqs rows and the draft's steps): the transient memory their graphs'
        pool keeps (the peak of the largest), which the KV cache must leave room for."""
        cfg = self.cfg
        tokens = min(max(cfg.prefill_graph_max_tokens, cfg.piecewise_graph_max_tokens),
                     self.model.spec.max_model_len - 2)
        with self._profile_caches(True):
            if tokens > 0:
                prefill = [ScheduledSeq(self._block0_request(0, tokens), tokens, 0, 1, True)]
                self.run_window(Batch(prefill, 1))
            decode = [ScheduledSeq(self._block0_request(i, 1), 1, 0, 1, False)
                      for i in range(num_seqs)]
            self.run_window(Batch(decode, 1))
            if self.spec is not None:
                self._drafting_window([1] * num_seqs)

    def _drafting_window(self, lens: list[int]) -> None:
        """A one-step drafting window on block 0: row i caught up over lens[i] positions (cut
        to the model's length), then drafting k tokens and verifying k + 1; then a fresh
        start for the run (no draft KV known valid, nothing counted)."""
        k1 = self.spec.width
        room = self.model.spec.max_model_len - 2 * k1
        seqs = []
        for i, n in enumerate(lens):
            n = max(1, min(n, room))
            req = Request(-1 - i, 0.0, n + 1, 1, prompt_token_ids=[0] * (n + 1),
                          block_table=[0] * (-(-(n + 2 * k1) // self.block_size)))
            seqs.append(ScheduledSeq(req, k1, n, 1, False, 0, k1))
        self.run_window(Batch(seqs, 1))
        self.spec.start_run()

    @contextmanager
    def _profile_caches(self, scratch: bool) -> Iterator[None]:
        """With ``scratch``: one-block KV caches for the target and the draft model in place of
        the real ones (allocated later, to what the profile leaves) for the block's duration."""
        spec = self.spec
        saved, saved_draft = self.kv_cache, spec.draft_cache if spec else None
        if scratch:
            m = self.model
            self.kv_cache = allocate_kv_cache(m.spec, 1, self.block_size, m.dtype, self.device)
            if spec is not None and spec.draft is not None:
                d = spec.draft
                spec.draft_cache = allocate_kv_cache(d.spec, 1, self.block_size, d.dtype,
                                                     self.device)
        try:
            yield
        finally:
            self.kv_cache = saved
            if spec is not None:
                spec.draft_cache = saved_draft

    @torch.inference_mode()
    def warm_up(self, num_tokens: int, num_seqs: int) -> None:
        """Before the clock starts, on block 0 of the cache: the largest eager steps (so the
        allocator already holds their memory), then a mixed prefill + decode step at each decode
        batch size that picks a new number of key splits: each count is its own compiled
        decode-attention kernel, and compiling one in a served run stalls it."""
        self.profile_run(num_tokens, num_seqs, scratch=False)
        if self.spec is not None:
            self._warm_up_speculative(num_seqs)
        if self.kernels.name != "triton":
            return
        from real_backend.triton_ops import decode_splits

        kv_heads = self.model.spec.num_kv_heads
        first_of: dict[int, int] = {}
        for b in range(1, num_seqs + 1):
            first_of.setdefault(decode_splits(b, kv_heads, self.device), b)
        for b in first_of.values():
            seqs = [ScheduledSeq(self._block0_request(0, 16), 16, 0, 1, True)]
            seqs += [ScheduledSeq(self._block0_request(1 + i, 1), 1, 0, 1, False)
                     for i in range(b)]
            self.run_window(Batch(seqs, 1))

    def _warm_up_speculative(self, num_seqs: int) -> None:
        """A drafting window of two steps on block 0 (the draft's catch-up, its steps and the
        verify compile here, not in a served step), then a fresh start for the run."""
        k1 = self.spec.settings.num_tokens + 1
        n = 16
        seqs = []
        for i in range(min(num_seqs, 4)):
            req = Request(-1 - i, 0.0, n, 1, prompt_token_ids=[0] * n,
                          block_table=[0] * (-(-(n + 2 * k1) // self.block_size)))
            seqs.append(ScheduledSeq(req, k1, n - 1, 2, False, 0, k1))
        self.run_window(Batch(seqs, 2))
        self.spec.start_run()

    # ------------------------------------------------------------------ the window
    def run_window(self, batch: Batch) -> WindowResult:
        return self.finish_window(self.launch_window(batch))

    @torch.inference_mode()
    def launch_window(self, batch: Batch, overlap: bool = False) -> LaunchedWindow:
        """Build the window's inputs and queue its k steps; the device may still be running them
        on return. With ``overlap`` the window before it may still be in flight: a token it
        samples is read from the token map, and its outputs stay pending beside this one's."""
        if any(s.num_decode_tokens > 1 for s in batch.seqs):
            return self._launch_speculative(batch, overlap)
        t0 = perf_counter()
        host = self._host_plan(batch, overlap)
        if self.publish is not None:  # tensor parallelism: every worker rank runs it too
            self.publish(host)
        plan = self.inputs.plan(host)
        prepare_s = perf_counter() - t0
        outputs, older = self.outputs, None
        if overlap:
            self._overlap_outputs.reverse()
            outputs, older = self._overlap_outputs
        outputs.start(batch.num_steps, max(len(plan.step_rows[0]), 1))
        timers = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(batch.num_steps)] if self.cuda else []
        launch_s = self._launch_steps(plan, outputs, older, timers)
        return LaunchedWindow(batch, plan, outputs, timers, prepare_s, launch_s)

    def _launch_speculative(self, batch: Batch, overlap: bool) -> LaunchedWindow:
        """A window whose decodes draft (num_decode_tokens = k + 1): real_backend/speculative.py
        queues its steps; each step's ids are the tokens every row emits, k + 1 columns a row."""
        if self.spec is None:
            raise ValueError("a window drafts tokens (ScheduledSeq.num_decode_tokens > 1) but "
                             "the runner has no drafter: set spec.method to draft or ngram")
        if overlap or self.publish is not None:
            raise ValueError("speculative decoding runs without scheduler.overlap and without "
                             "tensor parallelism")
        t0 = perf_counter()
        spec = self.spec.plan(batch, self.cfg.sampling)
        plan = WindowPlan(batch.num_steps, spec.step_rows, None, emit_width=spec.width,
                          spec=spec)
        prepare_s = perf_counter() - t0
        outputs = self.outputs
        outputs.start(batch.num_steps, max(len(r) for r in spec.step_rows) * spec.width or 1)
        timers = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(batch.num_steps)] if self.cuda else []

        launch_s = [0.0]

        def push(j: int, ids: torch.Tensor) -> None:
            if j == 0:  # the CPU time of queueing step 1
                launch_s[0] = perf_counter() - t
            outputs.push(j, ids)
            outputs.poll()

        t = perf_counter()
        self.spec.run_steps(spec, self.kv_cache, self.cfg.sampling, self.generator, push, timers)
        return LaunchedWindow(batch, plan, outputs, timers, prepare_s, launch_s[0])

    @torch.inference_mode()
    def launch_plan(self, host: HostPlan) -> Callable[[], None]:
        """A worker rank: queue the k steps of a window rank 0 broadcast (no ids come back: every
        rank samples the same ones). The returned wait() blocks until they ran, after which
        their inputs' pinned host copies may go."""
        plan = self.inputs.plan(host)
        self._launch_steps(plan)
        if not self.cuda:
            return plan.keep.clear
        done = torch.cuda.Event()
        done.record()

        def wait() -> None:
            done.synchronize()
            plan.keep.clear()

        return wait

    def _launch_steps(self, plan: WindowPlan, outputs: StepOutputs | None = None,
                      older: StepOutputs | None = None,
                      timers: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None
                      ) -> float:
        """Queue the window's steps, each sampled and (``outputs``) its ids copied to the host;
        the CPU time of queueing step 1."""
        sampled = None
        launch_s = 0.0
        for j in range(plan.num_steps):
            if timers:
                timers[j][0].record()
            t_launch = perf_counter()
            if j == 0:
                logits, extra = self._first_step(plan)
            else:
                logits, extra = self._next_step(plan, j, sampled), {}
            rows = plan.sampling[j] if plan.sampling else None
            sampled = (sample_rows(logits, rows, j, self.generator) if rows is not None
                       else sample(logits, self.cfg.sampling, self.generator))
            if rows is not None and rows.logprob_rows is not None and outputs is not None:
                lp = rows.logprob_rows
                extra["values"], extra["ids"] = top_logprobs(
                    logits.index_select(0, lp), sampled.index_select(0, lp), rows.num_logprobs)
            if plan.map_writes:
                self.token_map.write(plan.map_writes[j], sampled)
            if timers:
                timers[j][1].record()
            if j == 0:
                launch_s = perf_counter() - t_launch
            if outputs is None:
                continue
            outputs.push(j, sampled, extra)
            # a step pythonized before the window in flight is drained would get an earlier
            # delivery time than that window's tokens (a launch-bound mixed step can be done
            # by now); its ids wait for finish_window instead
            if older is None or not older.pending:
                outputs.poll()
        return launch_s

    def poll_window(self, w: LaunchedWindow) -> None:
        """Pythonize the window's steps that have finished on the device (never blocks)."""
        w.outputs.poll()

    def finish_window(self, w: LaunchedWindow) -> WindowResult:
        """Wait for the window's ids (each step's copy) and hand them over per sequence."""
        outputs, batch = w.outputs, w.batch
        outputs.drain()
        gpu = ([a.elapsed_time(b) / 1e3 for a, b in w.timers] if w.timers
               else [0.0] * batch.num_steps)
        out = WindowResult(list(outputs.times), self._per_seq(batch, w.plan, outputs.ids),
                           w.prepare_s, outputs.pythonize_s, gpu,
                           sum(s.num_query_tokens for s in batch.seqs), w.launch_s)
        if w.plan.host is not None:
            out.logprobs, out.prompt_logprobs = _logprobs(batch, w.plan, outputs.extra)
        if w.plan.spec is not None:
            self.spec.finish(batch, w.plan.spec, outputs.ids)
        return out

    def _first_step(self, plan: WindowPlan) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Step 1's logits, and the prompt logprobs it computes (none but in a flat step)."""
        if plan.first_graph is not None:
            plan.first_load()
            self.prefill_graph_replays += 1
            return self.prefill_graphs.replay(plan.first_graph)[:len(plan.step_rows[0])], {}
        if plan.first is None:
            plan.decode_loads[0]()
            return self._decode(self.buffers.num_rows), {}
        f = plan.first
        if plan.first_pieces is None:
            hidden = forward(self.model, f.input_ids, f.positions, f.meta, self.kv_cache,
                             self.kernels)
        else:
            n, pb, size = f.input_ids.shape[0], self.piece_buffers, plan.first_pieces
            pb.input_ids[:n].copy_(f.input_ids)
            pb.positions[:n].copy_(f.positions)
            self.piecewise_replays += 1
            hidden = forward_piecewise(self.model, pb, n, f.meta, self.kv_cache, self.kernels,
                                       lambda i: self.piecewise.replay(size, i))
        extra = {}
        if f.prompt_logprobs is not None:  # (every rank: with tp the logits are gathered)
            extra = self._prompt_logprobs(hidden, *f.prompt_logprobs,
                                          plan.host.flat.prompt_logprobs.num)
        return compute_logits(self.model, hidden[f.logits_indices]), extra

    def _prompt_logprobs(self, hidden: torch.Tensor, indices: torch.Tensor,
                         targets: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
        """The prompt logprobs of ``targets`` from the logits at ``indices``, a slice of
        tokens at a time (a whole prompt's logits at once could take gigabytes)."""
        values, ids = [], []
        for a in range(0, indices.shape[0], PROMPT_LOGITS_ROWS):
            b = a + PROMPT_LOGITS_ROWS
            v, i = top_logprobs(compute_logits(self.model, hidden[indices[a:b]]), targets[a:b], k)
            values.append(v)
            ids.append(i)
        return {"prompt_values": torch.cat(values), "prompt_ids": torch.cat(ids)}

    def _next_step(self, plan: WindowPlan, j: int, sampled: torch.Tensor) -> torch.Tensor:
        b = self.buffers
        if j in plan.gathers:
            sampled = sampled.index_select(0, plan.gathers[j])
        if j in plan.decode_loads:
            plan.decode_loads[j]()
        self.kernels.advance_step(b.padded_rows, b.num_rows, self.block_size, b.input_ids,
                                  sampled, b.positions, b.seq_lens, b.slot_mapping,
                                  b.block_tables)
        return self._decode(b.num_rows)

    def _decode(self, n: int) -> torch.Tensor:
        b = self.buffers
        if b.padded_rows in self.graphs.graphs:
            return self.graphs.replay(b.padded_rows)[:n]
        return self._decode_eager(b.padded_rows)[:n]

    def _decode_eager(self, rows: int, out: torch.Tensor | None = None) -> torch.Tensor:
        b = self.buffers
        hidden = forward(self.model, b.input_ids[:rows], b.positions[:rows], b.meta(rows),
                         self.kv_cache, self.kernels)
        return compute_logits(self.model, hidden, out)

    def _prefill_static(self, tokens: int, seqs: int) -> torch.Tensor:
        """A prefill step over the static prefill buffers (what a prefill graph captures):
        logits [seqs, vocab] of the rows that logits_indices picks."""
        p = self.prefill_buffers
        hidden = forward(self.model, p.input_ids[:tokens], p.positions[:tokens],
                         p.meta(tokens, seqs), self.kv_cache, self.kernels)
        return compute_logits(self.model, hidden[p.logits_indices[:seqs]])

    # ------------------------------------------------------------------ host-side inputs
    def _host_plan(self, batch: Batch, overlap: bool) -> HostPlan:
        pre = self.prefill_graphs.graphs and self.cfg.prefill_graph_max_tokens
        pieces = self.piecewise.graphs and self.cfg.piecewise_graph_max_tokens
        sizes = PlanSizes(
            self.block_size,
            lambda n: (self.graphs.padded_size(n) if self.graphs.graphs else None) or n,
            (lambda t, s: prefill_graph_key(t, s, pre)) if pre else None,
            (lambda t: piecewise_graph_size(t, pieces)) if pieces else None)
        return plan_window(batch, sizes, self.token_map.rows if overlap else None,
                           self.cfg.sampling, self.penalties.rows)

    @staticmethod
    def _per_seq(batch: Batch, plan: WindowPlan, ids: list[list[int]]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in batch.seqs]
        width = plan.emit_width
        for j, rows in enumerate(plan.step_rows):
            step_ids = ids[j]
            for r, i in enumerate(rows):
                if not batch.seqs[i].samples:
                    continue
                if width == 1:
                    out[i].append(step_ids[r])
                else:  # a drafting step: its emitted tokens, then -1s
                    out[i] += [t for t in step_ids[r * width:(r + 1) * width] if t >= 0]
        return out



def _logprobs(batch: Batch, plan: WindowPlan, extra: list[dict[str, list]]
              ) -> tuple[list[list[Logprob]] | None, dict[int, tuple[int, list[Logprob]]] | None]:
    """The window's logprobs per sequence (WindowResult.logprobs, .prompt_logprobs), each cut
    to the number its request asks for, from each step's copies (``extra``)."""
    host, seqs = plan.host, batch.seqs
    out = None
    for j, h in enumerate(host.sampling):
        if h.logprob_rows is None:
            continue
        if out is None:
            out = [[] for _ in seqs]
        rows, values, ids = plan.step_rows[j], extra[j]["values"], extra[j]["ids"]
        for m, r in enumerate(h.logprob_rows.tolist()):
            i = rows[r]
            if seqs[i].samples:
                n = seqs[i].request.sampling.logprobs
                out[i].append((values[m][0], ids[m][:n], values[m][1:1 + n]))
    prompt = None
    pl = host.flat.prompt_logprobs if host.flat is not None else None
    if pl is not None:
        prompt, values, ids, a = {}, extra[0]["prompt_values"], extra[0]["prompt_ids"], 0
        for i, first, count in pl.spans:
            n = seqs[i].request.sampling.prompt_logprobs
            prompt[i] = (first, [(v[0], t[:n], v[1:1 + n])
                                 for v, t in zip(values[a:a + count], ids[a:a + count],
                                                 strict=True)])
            a += count
    return out, prompt
