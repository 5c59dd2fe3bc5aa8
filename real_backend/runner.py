"""Runs one scheduler window on the model: host inputs built once, k device steps back to back with
advance_step between them, each step's sampled ids pythonized as soon as they reach the host; with
overlap scheduling, launched before the previous window's ids are known (the token map)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain
from time import perf_counter

import numpy as np
import torch

from policies.batch import Batch, ScheduledSeq
from policies.request import Request
from policies.step_sizes import (
    PREFILL_GRAPH_SEQS,
    PREFILL_GRAPH_TOKENS,
    decode_graph_sizes,
    piecewise_graph_size,
    prefill_graph_key,
)
from real_backend.async_output import StepOutputs
from real_backend.attention import AttentionMetadata, DecodeMetadata, PrefillMetadata
from real_backend.config import BackendConfig
from real_backend.cuda_graphs import (
    DecodeGraphs,
    PiecewiseGraphs,
    PrefillGraphs,
    capture_decode_graphs,
    capture_piecewise_graphs,
    capture_prefill_graphs,
)
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
from real_backend.sampling import TokenMap, sample


@dataclass(slots=True)
class WindowResult:
    step_times: list[float]  # when step j's ids were pythonized (the clock's seconds)
    sampled: list[list[int]]  # per batch.seqs[i]: one id per step it took part in, [] if none
    prepare_s: float  # CPU: building and queueing the window's inputs
    pythonize_s: float  # CPU: device ids -> Python ints
    gpu_step_s: list[float]  # device time of each step (CUDA events); 0 on CPU
    num_tokens: int  # tokens computed in step 1
    launch_s: float = 0.0  # CPU: queueing step 1's kernels (eager steps are launch-bound)


@dataclass(slots=True)
class DecodeBuffers:
    """Static device inputs of decode steps: CUDA graphs read them, advance_step rewrites them."""

    input_ids: torch.Tensor  # [rows] int64
    positions: torch.Tensor  # [rows] int64
    slot_mapping: torch.Tensor  # [rows] int64
    seq_lens: torch.Tensor  # [rows] int32
    block_tables: torch.Tensor  # [rows, max_blocks_per_seq] int32
    num_rows: int = 0  # rows holding real sequences now
    padded_rows: int = 0  # rows the next decode step computes (a captured graph's size)

    def meta(self, rows: int) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping[:rows], 0, None,
                                 DecodeMetadata(self.seq_lens[:rows], self.block_tables[:rows]))


@dataclass(slots=True)
class PrefillBuffers:
    """Static device inputs of the prefill graphs: up to 8 prompts' tokens, padded."""

    input_ids: torch.Tensor  # [tokens] int64
    positions: torch.Tensor  # [tokens] int64
    slot_mapping: torch.Tensor  # [tokens] int64, -1 on padding tokens
    query_start_loc: torch.Tensor  # [seqs + 1] int32; padding sequences start and end at the end
    seq_lens: torch.Tensor  # [seqs] int32, 0 on padding sequences
    block_tables: torch.Tensor  # [seqs, max_blocks_per_seq] int32
    logits_indices: torch.Tensor  # [seqs] int64, 0 on padding rows

    def meta(self, tokens: int, seqs: int) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping[:tokens], tokens, PrefillMetadata(
            self.query_start_loc[:seqs + 1], self.seq_lens[:seqs], self.block_tables[:seqs],
            tokens), None)


@dataclass(slots=True)
class FlatInputs:
    """Host arrays of a step-1 batch with multi-token rows (prefill chunks first, then decodes)."""

    tokens: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    query_start: np.ndarray  # [P + 1] over the prefill rows
    prefill_seq_lens: np.ndarray  # [P]
    prefill_tables: np.ndarray  # [P, width]
    decode_seq_lens: np.ndarray  # [D]
    decode_tables: np.ndarray  # [D, width]
    logits_indices: np.ndarray  # the last token of every sequence that samples
    num_prefill_tokens: int
    max_query_len: int
    fetch: tuple[np.ndarray, np.ndarray] | None = None  # (token index, map row): see _host_tokens


@dataclass(slots=True)
class StepInputs:
    """A step-1 batch with multi-token rows (prefill chunks first, then single tokens)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # the last token of every sequence that samples


@dataclass(slots=True)
class WindowPlan:
    step_rows: list[list[int]]  # step j's sample rows as indices into batch.seqs
    first: StepInputs | None  # None: step 1 is pure decode or a prefill graph (first_graph)
    first_graph: tuple[int, int] | None = None  # step 1 replays this prefill graph
    first_pieces: int | None = None  # step 1 (``first``) replays the piecewise graphs of this size
    first_load: Callable[[], None] | None = None  # copies step 1's inputs into its graph's buffers
    decode_loads: dict[int, Callable[[], None]] = field(default_factory=dict)  # step -> load
    gathers: dict[int, torch.Tensor] = field(default_factory=dict)  # step -> rows of last samples
    keep: list[torch.Tensor] = field(default_factory=list)  # pinned sources of queued copies
    map_rows: list[int] | None = None  # overlap: each sequence's token-map row
    map_writes: list[torch.Tensor] = field(default_factory=list)  # step -> map rows of its samples


@dataclass(slots=True)
class LaunchedWindow:
    """A window whose k steps are queued on the device; ``finish_window`` collects its ids."""

    batch: Batch
    plan: WindowPlan
    outputs: StepOutputs
    timers: list[tuple[torch.cuda.Event, torch.cuda.Event]]
    prepare_s: float
    launch_s: float


def _slots(req: Request, start: int, end: int, block_size: int) -> np.ndarray:
    pos = np.arange(start, end)
    table = np.asarray(req.block_table, dtype=np.int64)
    return table[pos // block_size] * block_size + pos % block_size


def _table_rows(seqs: list[ScheduledSeq], width: int) -> np.ndarray:
    """Block tables as one zero-padded [len(seqs), width] array, filled in a single scatter."""
    tables = [s.request.block_table for s in seqs]
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    total = int(lens.sum())
    flat = np.fromiter(chain.from_iterable(tables), dtype=np.int32, count=total)
    rows = np.repeat(np.arange(len(tables)), lens)
    cols = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
    out = np.zeros((len(tables), width), dtype=np.int32)
    out[rows, cols] = flat
    return out


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
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        # Wasted multi-step slots run up to max_lookahead positions past max_model_len.
        width = -(-(model.spec.max_model_len + max_lookahead) // block_size)
        rows = max(max_num_seqs, decode_graph_sizes(max_num_seqs)[-1])  # room for graph padding

        def buf(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=self.device)

        self.buffers = DecodeBuffers(buf(rows), buf(rows), buf(rows).fill_(PAD_SLOT_ID),
                                     buf(rows, dtype=torch.int32),
                                     buf(rows, width, dtype=torch.int32))
        self.prefill_graphs = PrefillGraphs()
        self.prefill_graph_replays = 0
        self.piecewise = PiecewiseGraphs()
        self.piecewise_replays = 0
        self.piecewise_capture_s = 0.0
        self.piece_buffers: PieceBuffers | None = None
        tokens, seqs = PREFILL_GRAPH_TOKENS[-1], PREFILL_GRAPH_SEQS[-1]
        self.prefill_buffers = PrefillBuffers(
            buf(tokens), buf(tokens), buf(tokens).fill_(PAD_SLOT_ID),
            buf(seqs + 1, dtype=torch.int32), buf(seqs, dtype=torch.int32),
            buf(seqs, width, dtype=torch.int32), buf(seqs))

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
        self.graphs = capture_decode_graphs(self._decode_eager, sizes)
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
        sequences, then a num_seqs decode), on a one-block scratch cache (memory profiling) or
        on block 0 of the real one (warm-up)."""
        spec = self.model.spec
        saved = self.kv_cache
        if scratch:
            self.kv_cache = allocate_kv_cache(spec, 1, self.block_size, self.model.dtype,
                                              self.device)
        num_seqs = max(1, min(num_seqs, num_tokens))
        lens = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
        prefill = [ScheduledSeq(self._block0_request(i, n), n, 0, 1, True)
                   for i, n in enumerate(lens)]
        self.run_window(Batch(prefill, 1))
        decode = [ScheduledSeq(self._block0_request(i, 1), 1, 0, 2, False) for i in range(num_seqs)]
        self.run_window(Batch(decode, 2))  # two steps: advance_step is compiled here too
        self.kv_cache = saved

    @torch.inference_mode()
    def warm_up(self, num_tokens: int, num_seqs: int) -> None:
        """Before the clock starts, on block 0 of the cache: the largest eager steps (so the
        allocator already holds their memory), then a mixed prefill + decode step at each decode
        batch size that picks a new number of key splits: each count is its own compiled
        decode-attention kernel, and compiling one in a served run stalls it for ~0.4 s."""
        self.profile_run(num_tokens, num_seqs, scratch=False)
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

    # ------------------------------------------------------------------ the window
    def run_window(self, batch: Batch) -> WindowResult:
        return self.finish_window(self.launch_window(batch))

    @torch.inference_mode()
    def launch_window(self, batch: Batch, overlap: bool = False) -> LaunchedWindow:
        """Build the window's inputs and queue its k steps; the device may still be running them
        on return. With ``overlap`` the window before it may still be in flight: a token it
        samples is read from the token map, and its outputs stay pending beside this one's."""
        t0 = perf_counter()
        plan = self._plan(batch, overlap)
        prepare_s = perf_counter() - t0
        outputs, older = self.outputs, None
        if overlap:
            self._overlap_outputs.reverse()
            outputs, older = self._overlap_outputs
        outputs.start(batch.num_steps, max(len(plan.step_rows[0]), 1))
        timers = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(batch.num_steps)] if self.cuda else []
        sampled = None
        launch_s = 0.0
        for j in range(batch.num_steps):
            if timers:
                timers[j][0].record()
            t_launch = perf_counter()
            logits = self._first_step(plan) if j == 0 else self._next_step(plan, j, sampled)
            sampled = sample(logits, self.cfg.sampling, self.generator)
            if plan.map_writes:
                self.token_map.write(plan.map_writes[j], sampled)
            if timers:
                timers[j][1].record()
            if j == 0:
                launch_s = perf_counter() - t_launch
            outputs.push(j, sampled)
            # a step pythonized before the window in flight is drained would get an earlier
            # delivery time than that window's tokens (a launch-bound mixed step can be done
            # by now); its ids wait for finish_window instead
            if older is None or not older.pending:
                outputs.poll()
        return LaunchedWindow(batch, plan, outputs, timers, prepare_s, launch_s)

    def finish_window(self, w: LaunchedWindow) -> WindowResult:
        """Wait for the window's ids (each step's copy) and hand them over per sequence."""
        outputs, batch = w.outputs, w.batch
        outputs.drain()
        gpu = ([a.elapsed_time(b) / 1e3 for a, b in w.timers] if w.timers
               else [0.0] * batch.num_steps)
        return WindowResult(list(outputs.times), self._per_seq(batch, w.plan, outputs.ids),
                            w.prepare_s, outputs.pythonize_s, gpu,
                            sum(s.num_query_tokens for s in batch.seqs), w.launch_s)

    def _first_step(self, plan: WindowPlan) -> torch.Tensor:
        if plan.first_graph is not None:
            plan.first_load()
            self.prefill_graph_replays += 1
            return self.prefill_graphs.replay(plan.first_graph)[:len(plan.step_rows[0])]
        if plan.first is None:
            plan.decode_loads[0]()
            return self._decode(self.buffers.num_rows)
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
        return compute_logits(self.model, hidden[f.logits_indices])

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

    def _decode_eager(self, rows: int) -> torch.Tensor:
        b = self.buffers
        hidden = forward(self.model, b.input_ids[:rows], b.positions[:rows], b.meta(rows),
                         self.kv_cache, self.kernels)
        return compute_logits(self.model, hidden)

    def _prefill_static(self, tokens: int, seqs: int) -> torch.Tensor:
        """A prefill step over the static prefill buffers (what a prefill graph captures):
        logits [seqs, vocab] of the rows that logits_indices picks."""
        p = self.prefill_buffers
        hidden = forward(self.model, p.input_ids[:tokens], p.positions[:tokens],
                         p.meta(tokens, seqs), self.kv_cache, self.kernels)
        return compute_logits(self.model, hidden[p.logits_indices[:seqs]])

    # ------------------------------------------------------------------ host-side inputs
    def _to_device(self, arr: np.ndarray, keep: list[torch.Tensor]) -> torch.Tensor:
        t = torch.from_numpy(arr)
        if not self.cuda:
            return t
        t = t.pin_memory()
        keep.append(t)  # a non_blocking copy reads it later; it must outlive the copy
        return t.to(self.device, non_blocking=True)

    def _plan(self, batch: Batch, overlap: bool = False) -> WindowPlan:
        seqs = batch.seqs
        multi = [i for i, s in enumerate(seqs) if s.num_query_tokens > 1]
        single = [i for i, s in enumerate(seqs) if s.num_query_tokens == 1]
        order = multi + single
        if multi:
            sample_rows = [i for i in order if seqs[i].samples]
        else:
            sample_rows = order  # a graph computes every row; non-sampling ones are ignored
        step_rows = [sample_rows] + [[i for i in sample_rows if seqs[i].num_steps > j]
                                     for j in range(1, batch.num_steps)]
        plan = WindowPlan(step_rows, None)
        if overlap:  # every step's samples go to the token map, where the next window reads them
            plan.map_rows = rows = self.token_map.rows([s.request for s in seqs])
            for j, step in enumerate(step_rows):
                if j and step == step_rows[j - 1]:
                    plan.map_writes.append(plan.map_writes[-1])
                else:
                    plan.map_writes.append(self._to_device(
                        np.array([rows[i] for i in step], dtype=np.int64), plan.keep))
        if multi:
            flat = self._flat_inputs(seqs, multi, single, plan.map_rows)
            key = (prefill_graph_key(len(flat.tokens), len(multi), self.cfg.prefill_graph_max_tokens)
                   if not single and self.prefill_graphs.graphs else None)
            if key is not None:
                plan.first_graph = key
                plan.first_load = self._prefill_load(flat, key, plan)
            else:
                plan.first = self._step_inputs(flat, plan)
                if self.piecewise.graphs:
                    plan.first_pieces = piecewise_graph_size(len(flat.tokens),
                                                             self.cfg.piecewise_graph_max_tokens)
        else:
            plan.decode_loads[0] = self._decode_load(seqs, order, 0, plan)
        loaded = order if not multi else None
        for j in range(1, batch.num_steps):
            rows = step_rows[j]
            if rows != step_rows[j - 1]:
                pos = {i: r for r, i in enumerate(step_rows[j - 1])}
                plan.gathers[j] = self._to_device(
                    np.array([pos[i] for i in rows], dtype=np.int64), plan.keep)
            if rows != loaded:
                plan.decode_loads[j] = self._decode_load(seqs, rows, j, plan)
                loaded = rows
        return plan

    def _decode_load(self, seqs: list[ScheduledSeq], rows: list[int], step: int,
                     plan: WindowPlan) -> Callable[[], None]:
        """Host-built decode state for ``rows`` at ``step``, copied into the buffers when run.

        Step 0 gets complete inputs (the newest token, its position and slot, seq_lens counting
        it). A later step gets seq_lens = tokens cached so far and block tables; advance_step
        derives the rest from the previous step's samples.
        """
        n = len(rows)
        padded = (self.graphs.padded_size(n) if self.graphs.graphs else None) or n
        rs = [seqs[i] for i in rows]
        width = max((len(s.request.block_table) for s in rs), default=1)
        tables = self._to_device(_table_rows(rs, width), plan.keep)
        seq_lens = np.zeros(padded, dtype=np.int32)
        seq_lens[:n] = [s.num_cached_tokens + s.num_query_tokens + step - 1 for s in rs]
        fetch = None
        if step == 0:
            seq_lens[:n] += 1
            tokens = np.zeros(padded, dtype=np.int64)
            ids, fetch = self._host_tokens(rs, [plan.map_rows[i] for i in rows]
                                           if plan.map_rows else None)
            tokens[:n] = ids
            if fetch is not None:
                fetch = tuple(self._to_device(a, plan.keep) for a in fetch)
            positions = np.zeros(padded, dtype=np.int64)
            positions[:n] = [s.num_cached_tokens for s in rs]
            slots = np.full(padded, PAD_SLOT_ID, dtype=np.int64)
            bs = self.block_size
            slots[:n] = [s.request.block_table[s.num_cached_tokens // bs] * bs
                         + s.num_cached_tokens % bs for s in rs]
            tokens, positions, slots = (self._to_device(a, plan.keep)
                                        for a in (tokens, positions, slots))
        seq_lens_dev = self._to_device(seq_lens, plan.keep)

        def load() -> None:
            b = self.buffers
            b.num_rows, b.padded_rows = n, padded
            b.seq_lens[:padded].copy_(seq_lens_dev, non_blocking=True)
            b.block_tables[:n, :width].copy_(tables, non_blocking=True)
            if step == 0:
                b.input_ids[:padded].copy_(tokens, non_blocking=True)
                if fetch is not None:  # tokens of a window in flight, on the device
                    b.input_ids.index_copy_(0, fetch[0], self.token_map.read(fetch[1]))
                b.positions[:padded].copy_(positions, non_blocking=True)
                b.slot_mapping[:padded].copy_(slots, non_blocking=True)

        return load

    def _flat_inputs(self, seqs: list[ScheduledSeq], multi: list[int], single: list[int],
                     map_rows: list[int] | None = None) -> FlatInputs:
        bs = self.block_size
        pre = [seqs[i] for i in multi]
        dec = [seqs[i] for i in single]
        every = pre + dec
        # prefill chunks' tokens are all known (a request is re-admitted only once its tokens
        # are); a decode's may be in flight
        ids, fetch = self._host_tokens(dec, [map_rows[i] for i in single] if map_rows else None)
        tokens = np.concatenate([np.asarray(s.request.token_ids(
            s.num_cached_tokens, s.num_cached_tokens + s.num_query_tokens), dtype=np.int64)
            for s in pre] + [np.asarray(ids, dtype=np.int64)])
        positions = np.concatenate([np.arange(s.num_cached_tokens,
                                              s.num_cached_tokens + s.num_query_tokens)
                                    for s in every])
        slots = np.concatenate([_slots(s.request, s.num_cached_tokens,
                                       s.num_cached_tokens + s.num_query_tokens, bs)
                                for s in every])
        q_lens = np.array([s.num_query_tokens for s in every], dtype=np.int64)
        ends = np.cumsum(q_lens)
        logits_indices = np.array([ends[r] - 1 for r, s in enumerate(every) if s.samples],
                                  dtype=np.int64)
        query_start = np.zeros(len(pre) + 1, dtype=np.int32)
        query_start[1:] = ends[:len(pre)]
        width = max(len(s.request.block_table) for s in every)
        return FlatInputs(
            tokens, positions, slots, query_start,
            np.array([s.num_cached_tokens + s.num_query_tokens for s in pre], dtype=np.int32),
            _table_rows(pre, width),
            np.array([s.num_cached_tokens + 1 for s in dec], dtype=np.int32),
            _table_rows(dec, width), logits_indices, int(ends[len(pre) - 1]),
            int(q_lens[:len(pre)].max()),
            None if fetch is None else (fetch[0] + int(ends[len(pre) - 1]), fetch[1]))

    @staticmethod
    def _host_tokens(rs: list[ScheduledSeq], map_rows: list[int] | None
                     ) -> tuple[list[int], tuple[np.ndarray, np.ndarray] | None]:
        """The single input token of each decoding sequence as far as the host knows it, and
        (index into ``rs``, token-map row) of those sampled by a window still in flight (their
        host id is 0 until the device gathers them): overlap scheduling's placeholders."""
        ids, index, rows = [], [], []
        for r, s in enumerate(rs):
            req, pos = s.request, s.num_cached_tokens
            if pos < req.prompt_len + len(req.output_token_ids):
                ids.append(req.token_ids(pos, pos + 1)[0])
            elif map_rows is None:
                raise RuntimeError(f"request {req.request_id}: the token at position {pos} is "
                                   "not known yet (a window formed with overlap needs "
                                   "launch_window(batch, overlap=True))")
            else:
                ids.append(0)
                index.append(r)
                rows.append(map_rows[r])
        if not index:
            return ids, None
        return ids, (np.array(index, dtype=np.int64), np.array(rows, dtype=np.int64))

    def _step_inputs(self, f: FlatInputs, plan: WindowPlan) -> StepInputs:
        """Fresh device tensors for an eager step 1."""
        dev = self._to_device
        keep = plan.keep
        prefill = PrefillMetadata(dev(f.query_start, keep), dev(f.prefill_seq_lens, keep),
                                  dev(f.prefill_tables, keep), f.max_query_len)
        decode = DecodeMetadata(dev(f.decode_seq_lens, keep), dev(f.decode_tables, keep)) \
            if len(f.decode_seq_lens) else None
        meta = AttentionMetadata(dev(f.slots, keep), f.num_prefill_tokens, prefill, decode)
        input_ids = dev(f.tokens, keep)
        if f.fetch is not None:  # queued behind the window in flight, whose samples it reads
            input_ids.index_copy_(0, dev(f.fetch[0], keep),
                                  self.token_map.read(dev(f.fetch[1], keep)))
        return StepInputs(input_ids, dev(f.positions, keep), meta, dev(f.logits_indices, keep))

    def _prefill_load(self, f: FlatInputs, key: tuple[int, int],
                      plan: WindowPlan) -> Callable[[], None]:
        """Padded host copies of a prefill-only step 1, copied into the graph buffers when run.
        Padding tokens write no KV (slot -1) and belong to no sequence; padding sequences are
        empty (they start at the last real token's end) and sample row 0, which is ignored."""
        tokens, seqs = key
        n, p = len(f.tokens), len(f.prefill_seq_lens)

        def pad(a: np.ndarray, size: int, value: int) -> np.ndarray:
            out = np.full(size, value, dtype=a.dtype)
            out[:len(a)] = a
            return out

        width = f.prefill_tables.shape[1]
        tables = np.zeros((seqs, width), dtype=np.int32)
        tables[:p] = f.prefill_tables
        host = [pad(f.tokens, tokens, 0), pad(f.positions, tokens, 0),
                pad(f.slots, tokens, PAD_SLOT_ID), pad(f.query_start, seqs + 1, n),
                pad(f.prefill_seq_lens, seqs, 0), tables, pad(f.logits_indices, seqs, 0)]
        srcs = [self._to_device(a, plan.keep) for a in host]

        def load() -> None:
            b = self.prefill_buffers
            dsts = [b.input_ids[:tokens], b.positions[:tokens], b.slot_mapping[:tokens],
                    b.query_start_loc[:seqs + 1], b.seq_lens[:seqs], b.block_tables[:seqs, :width],
                    b.logits_indices[:seqs]]
            for dst, src in zip(dsts, srcs, strict=True):
                dst.copy_(src, non_blocking=True)

        return load

    @staticmethod
    def _per_seq(batch: Batch, plan: WindowPlan, ids: list[list[int]]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in batch.seqs]
        for j, rows in enumerate(plan.step_rows):
            step_ids = ids[j]
            for r, i in enumerate(rows):
                if batch.seqs[i].samples:
                    out[i].append(step_ids[r])
        return out

