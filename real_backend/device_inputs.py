"""A window's inputs on the device: the static buffers its steps read, and its plan.

The buffers are what CUDA graphs and advance_step read (decode rows; the prefill graphs' padded
prompts). A window's ``WindowPlan`` is built from its host arrays (window_inputs.HostPlan) with
every host-to-device copy queued, never waited for: a pinned source stays in the plan's
``keep`` until its copy has run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from common.step_sizes import PREFILL_GRAPH_SEQS, PREFILL_GRAPH_TOKENS
from real_backend.attention import (
    AttentionMetadata,
    DecodeBuffers,
    DecodeMetadata,
    PrefillMetadata,
    RowBuffers,
)
from real_backend.ops import PAD_SLOT_ID
from real_backend.sampling import PenaltyState, RowSampling, StepPenalties, TokenMap
from real_backend.window_inputs import DecodeInputs, FlatInputs, HostPlan, SamplingRows

if TYPE_CHECKING:
    from real_backend.speculative import SpecPlan


@dataclass(slots=True)
class StepInputs:
    """A step-1 batch with multi-token rows (prefill chunks first, then single tokens)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # the last token of every sequence that samples
    # the tokens whose logits give prompt logprobs, and the prompt token after each
    prompt_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(slots=True)
class WindowPlan:
    """A window's device inputs, built from its ``HostPlan`` (window_inputs.py)."""

    num_steps: int
    step_rows: list[list[int]]  # step j's sample rows as indices into batch.seqs
    first: StepInputs | None  # None: step 1 is pure decode or a prefill graph (first_graph)
    first_graph: tuple[int, int] | None = None  # step 1 replays this prefill graph
    first_pieces: int | None = None  # step 1 (``first``) replays the piecewise graphs of this size
    first_load: Callable[[], None] | None = None  # copies step 1's inputs into its graph's buffers
    decode_loads: dict[int, Callable[[], None]] = field(default_factory=dict)  # step -> load
    gathers: dict[int, torch.Tensor] = field(default_factory=dict)  # step -> rows of last samples
    keep: list[torch.Tensor] = field(default_factory=list)  # pinned sources of queued copies
    map_writes: list[torch.Tensor] = field(default_factory=list)  # step -> map rows of its samples
    sampling: list[RowSampling] = field(default_factory=list)  # step -> rows' own settings
    host: HostPlan | None = None  # what it was built from (the logprobs' rows, on the host)
    emit_width: int = 1  # ids a row may emit a step (k + 1 when drafting; -1 pads the rest)
    spec: SpecPlan | None = None  # a drafting window's plan (real_backend/speculative.py)


def row_sampling(h: SamplingRows, dev: Callable[[np.ndarray], torch.Tensor],
                 penalties: PenaltyState | None = None) -> RowSampling:
    """``h`` on the device (``dev`` queues each array's copy), with the flags that let the
    sampler skip what no row needs, read on the host; ``penalties``: the state its penalized
    rows read."""
    greedy = h.temperature == 0
    sampled = ~greedy
    seeded = np.zeros(len(greedy), dtype=bool)
    seeded[h.seeded] = True
    out = RowSampling(
        dev(greedy), dev(np.where(greedy, 1.0, h.temperature).astype(np.float32)),
        dev(h.top_k), dev(np.where(h.top_p < 1.0, h.top_p, 2.0).astype(np.float32)),
        dev(h.seeded), dev(h.keys), dev(h.positions), h.first_step,
        all_greedy=bool(greedy.all()),
        any_top_k=bool((sampled & (h.top_k > 0)).any()),
        any_top_p=bool((sampled & (h.top_p < 1.0)).any()),
        any_unseeded=bool((sampled & ~seeded).any()),
        all_seeded=len(h.seeded) == len(greedy))
    if h.logprob_rows is not None:
        out.logprob_rows, out.num_logprobs = dev(h.logprob_rows), h.num_logprobs
    if h.penalty_where is not None:
        if penalties is None:
            raise RuntimeError("a window with penalized rows needs the runner's PenaltyState")
        values = [dev(np.ascontiguousarray(h.penalties[:, c])) for c in range(3)]
        out.penalties = StepPenalties(penalties, dev(h.penalty_where), dev(h.penalty_rows),
                                      *values)
    return out


class DeviceInputs:
    """The decode and prefill-graph buffers of one runner (``rows`` decode rows, block tables
    ``width`` blocks wide), and the device side of each window's inputs built into them; a
    token of a window in flight is read from ``token_map`` on the device."""

    def __init__(self, device: torch.device, rows: int, width: int, token_map: TokenMap,
                 penalties: PenaltyState | None = None) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        self.token_map = token_map
        self.penalties = penalties

        def buf(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.decode = DecodeBuffers(buf(rows), buf(rows), buf(rows).fill_(PAD_SLOT_ID),
                                    buf(rows, dtype=torch.int32),
                                    buf(rows, width, dtype=torch.int32))
        tokens, seqs = PREFILL_GRAPH_TOKENS[-1], PREFILL_GRAPH_SEQS[-1]
        self.prefill = RowBuffers(
            buf(tokens), buf(tokens), buf(tokens).fill_(PAD_SLOT_ID),
            buf(seqs + 1, dtype=torch.int32), buf(seqs, dtype=torch.int32),
            buf(seqs, width, dtype=torch.int32), buf(seqs))

    def to_device(self, arr: np.ndarray, keep: list[torch.Tensor]) -> torch.Tensor:
        t = torch.from_numpy(arr)
        if not self.cuda:
            return t
        t = t.pin_memory()
        keep.append(t)  # a non_blocking copy reads it later; it must outlive the copy
        return t.to(self.device, non_blocking=True)

    def plan(self, host: HostPlan) -> WindowPlan:
        """Device tensors (queued host-to-device copies) and load closures of a window."""
        plan = WindowPlan(host.num_steps, host.step_rows, None, host.first_graph,
                          host.first_pieces, host=host)
        if host.penalty_init is not None:  # queued before the window's steps, after the last's
            init = host.penalty_init
            dev = self.to_device
            self.penalties.build(dev(init.rows, plan.keep), init.num_rows,
                                 tuple(dev(a, plan.keep) for a in init.prompt),
                                 tuple(dev(a, plan.keep) for a in init.output))
        plan.map_writes = [self.to_device(a, plan.keep) for a in host.map_writes]
        if host.flat is not None:
            if host.first_graph is not None:
                plan.first_load = self._prefill_load(host.flat, host.first_graph, plan)
            else:
                plan.first = self._step_inputs(host.flat, plan)
        for j, d in host.decode.items():
            plan.decode_loads[j] = self._decode_load(d, plan)
        for j, rows in host.gathers.items():
            plan.gathers[j] = self.to_device(rows, plan.keep)
        built: dict[int, RowSampling] = {}
        for rows in host.sampling:
            if id(rows) not in built:
                built[id(rows)] = row_sampling(rows, lambda a: self.to_device(a, plan.keep),
                                               self.penalties)
            plan.sampling.append(built[id(rows)])
        return plan

    def _decode_load(self, d: DecodeInputs, plan: WindowPlan) -> Callable[[], None]:
        """Copies ``d`` into the decode buffers when run (window_inputs.DecodeInputs)."""
        n, padded, width = d.n, d.padded, d.tables.shape[1]
        tables = self.to_device(d.tables, plan.keep)
        seq_lens = self.to_device(d.seq_lens, plan.keep)
        first = d.step == 0
        if first:
            tokens, positions, slots = (self.to_device(a, plan.keep)
                                        for a in (d.tokens, d.positions, d.slots))
            fetch = (None if d.fetch is None
                     else tuple(self.to_device(a, plan.keep) for a in d.fetch))

        def load() -> None:
            b = self.decode
            b.num_rows, b.padded_rows = n, padded
            b.seq_lens[:padded].copy_(seq_lens, non_blocking=True)
            b.block_tables[:n, :width].copy_(tables, non_blocking=True)
            if first:
                b.input_ids[:padded].copy_(tokens, non_blocking=True)
                if fetch is not None:  # tokens of a window in flight, on the device
                    b.input_ids.index_copy_(0, fetch[0], self.token_map.read(fetch[1]))
                b.positions[:padded].copy_(positions, non_blocking=True)
                b.slot_mapping[:padded].copy_(slots, non_blocking=True)

        return load

    def _step_inputs(self, f: FlatInputs, plan: WindowPlan) -> StepInputs:
        """Fresh device tensors for an eager step 1."""
        dev = self.to_device
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
        prompt = (None if f.prompt_logprobs is None else
                  (dev(f.prompt_logprobs.indices, keep), dev(f.prompt_logprobs.targets, keep)))
        return StepInputs(input_ids, dev(f.positions, keep), meta, dev(f.logits_indices, keep),
                          prompt)

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
        srcs = [self.to_device(a, plan.keep) for a in host]

        def load() -> None:
            b = self.prefill
            dsts = [b.input_ids[:tokens], b.positions[:tokens], b.slot_mapping[:tokens],
                    b.query_start_loc[:seqs + 1], b.seq_lens[:seqs], b.block_tables[:seqs, :width],
                    b.logits_indices[:seqs]]
            for dst, src in zip(dsts, srcs, strict=True):
                dst.copy_(src, non_blocking=True)

        return load
