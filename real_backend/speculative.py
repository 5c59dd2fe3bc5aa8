"""Speculative decoding in the real engine: the drafter (a draft model with its own paged KV
cache, or n-gram prompt lookup), each step's verify over k + 1 positions per row, acceptance
(the scheduler's counts, ScheduledSeq.num_accepted, or the target's greedy tokens) and the
rollback, all on the device with no host sync inside a window.

A drafting step of a row whose newest (uncomputed) token ``t`` sits at position ``p``:

1. the drafter proposes d1..dk (the draft model runs k + 1 one-token steps over t, d1..dk at
   p..p+k, writing its KV there; its last step only keeps its cache whole when all k are
   accepted);
2. the target computes [t, d1..dk] at p..p+k in one flat forward (prefill-style attention over
   the paged cache) and samples g0..gk, one per position;
3. a drafts are accepted (given, or the length of the prefix where d_i+1 == g_i), and the step
   emits d1..da, g_a; the row's next step starts at p + a + 1 with g_a.

Rollback needs no copy: KV past p + a is overwritten by the next step (the scheduler's block
manager frees blocks past the request's new length). The draft cache uses the target's block
tables; a request's draft KV is known valid up to ``draft_len`` (kept per request, reset by a
preemption) and caught up by one flat draft forward when a window drafts for it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch
import yaml

from common.model_spec import ModelSpec
from common.paths import conf_dir
from common.step_sizes import decode_graph_sizes
from policies.base import check_int, check_settings
from policies.batch import Batch, ScheduledSeq
from policies.speculation import SpecDecodeStats
from real_backend.attention import AttentionMetadata, DecodeBuffers, PrefillMetadata, RowBuffers
from real_backend.cuda_graphs import capture_graph
from real_backend.kernels import Kernels
from real_backend.kv_cache import KVCache, allocate_kv_cache
from real_backend.model import Llama, compute_logits, forward
from real_backend.ops import PAD_SLOT_ID
from real_backend.sampling import SamplingParams, sample

METHODS = ("draft", "ngram")


@dataclass(frozen=True, slots=True)
class SpecSettings:
    """The engine's part of the ``spec`` config group (conf/spec/*.yaml)."""

    method: str = "draft"  # draft | ngram
    num_tokens: int = 2  # k: the most tokens drafted a step (adaptive policies draft fewer)
    draft_model: str = "same"  # a conf/model name; same: the target itself, sharing its weights
    draft_weights: str | None = None  # a Hugging Face directory; None: seeded random weights
    ngram_min: int = 1  # prompt lookup tries the longest suffix first, down to this
    ngram_max: int = 3

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"spec.method must be off, draft or ngram, got {self.method!r}")
        check_int("spec.num_tokens", self.num_tokens, 1)
        if not isinstance(self.draft_model, str) or not self.draft_model:
            raise ValueError(f"spec.draft_model must be a conf/model name or same, "
                             f"got {self.draft_model!r}")
        check_int("spec.ngram_min", self.ngram_min, 1)
        if check_int("spec.ngram_max", self.ngram_max, 1) < self.ngram_min:
            raise ValueError(f"spec.ngram_max {self.ngram_max} is below spec.ngram_min "
                             f"{self.ngram_min}")

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any] | None) -> SpecSettings | None:
        """None for ``method: off`` (or no mapping): no drafter is built."""
        d = dict(d or {})
        if d.get("method", "off") in ("off", None, False):
            return None
        check_settings("spec", d, (f.name for f in fields(cls)))
        return cls(**d)


def draft_spec(settings: SpecSettings, target: ModelSpec) -> ModelSpec | None:
    """The draft model's shape (None: the target itself), checked against the target's: the
    draft's token ids must be the target's."""
    if settings.method != "draft" or settings.draft_model == "same":
        return None
    path = conf_dir() / "model" / f"{settings.draft_model}.yaml"
    if not path.is_file():
        raise ValueError(f"spec.draft_model {settings.draft_model!r} is not a conf/model name")
    spec = ModelSpec.from_dict(yaml.safe_load(path.read_text()))
    check_draft(spec, target)
    return spec


def check_draft(draft: ModelSpec, target: ModelSpec) -> None:
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"spec.draft_model {draft.name} has vocab_size {draft.vocab_size} but "
                         f"model {target.name} has {target.vocab_size}: the draft must share "
                         "the target's vocabulary")
    if draft.max_model_len < target.max_model_len:
        raise ValueError(f"spec.draft_model {draft.name} has max_model_len {draft.max_model_len}"
                         f", below model {target.name}'s {target.max_model_len}")


# ------------------------------------------------------------------ the window's host plan
@dataclass(slots=True)
class SpecStep:
    """Step j of a drafting window as host arrays; ``rows`` index the window's sequences."""

    rows: np.ndarray  # [R] int64
    qlen: np.ndarray  # [R] tokens the target computes
    k: np.ndarray  # [R] tokens drafted (0: a prefill row, or a row that does not draft)
    prefill: np.ndarray  # [R] bool: a step-1 prefill chunk (advances by its length)
    samples: np.ndarray  # [R] bool
    accepted: np.ndarray  # [R] given accepted counts, -1: verified greedily
    tokens: np.ndarray  # [T] ids the host knows (prefill chunks, step 1's newest tokens), else 0
    token_row: np.ndarray  # [T] each token's row
    offset: np.ndarray  # [T] its offset in the row
    from_device: np.ndarray  # [T] bool: its id comes from the device (the newest token, drafts)
    logit_index: np.ndarray  # [L] tokens whose logits are sampled
    logit_slot: np.ndarray  # [L] row * (K + 1) + column of each sample
    draft_rows: np.ndarray  # [D] positions among the R rows that draft


@dataclass(slots=True)
class SpecPlan:
    """A drafting window: each step's host arrays, the window's starting state, and what the
    drafter needs before step 1."""

    width: int  # K + 1: tokens a row may emit a step
    steps: list[SpecStep]
    step_rows: list[list[int]]  # step j's sample rows, as runner.WindowPlan has them
    start: np.ndarray  # [N] position of each sequence's first query token
    last: np.ndarray  # [N] its newest token (0 where the host does not know it yet)
    tables: np.ndarray  # [N, width] int32
    # (sequence, first position, ids): draft KV to compute before step 1
    catch_up: list[tuple[int, int, list[int]]]
    history: tuple[np.ndarray, np.ndarray] | None = None  # n-gram: [N, L] ids, [N] lengths
    keep: list[torch.Tensor] = field(default_factory=list)  # pinned sources of queued copies


def _accepted(s: ScheduledSeq, k: int, steps: int) -> list[int] | None:
    """The scheduler's accepted counts of ``s``'s drafting steps, checked."""
    acc = s.num_accepted
    if acc is None:
        return None
    if len(acc) != steps or any(not 0 <= a <= k for a in acc):
        raise ValueError(f"ScheduledSeq.num_accepted {list(acc)} of request "
                         f"{s.request.request_id}: needs {steps} counts in [0, {k}]")
    return list(acc)


def plan_spec_window(batch: Batch, max_k: int, ngram: bool,
                     draft_len: Callable[[ScheduledSeq], int] | None) -> SpecPlan:
    """The host side of a drafting window (every sequence samples with the backend's sampler)."""
    seqs, width = batch.seqs, max_k + 1
    n = len(seqs)
    k = np.array([s.num_decode_tokens - 1 for s in seqs], dtype=np.int64)
    if (k > max_k).any():
        i = int(np.argmax(k > max_k))
        raise ValueError(f"request {seqs[i].request.request_id} drafts {k[i]} tokens a step but "
                         f"spec.num_tokens is {max_k}")
    for s in seqs:
        if not s.is_prefill and s.num_query_tokens != s.num_decode_tokens:
            raise ValueError(f"request {s.request.request_id}: a decode computes "
                             f"num_decode_tokens={s.num_decode_tokens} tokens in step 1, "
                             f"not {s.num_query_tokens}")
    start = np.array([s.num_cached_tokens for s in seqs], dtype=np.int64)
    last = np.array([0 if s.is_prefill else s.request.token_ids(p, p + 1)[0]
                     for s, p in zip(seqs, start.tolist(), strict=True)], dtype=np.int64)
    tw = max(len(s.request.block_table) for s in seqs)
    tables = np.zeros((n, tw), dtype=np.int32)
    for i, s in enumerate(seqs):
        tables[i, :len(s.request.block_table)] = s.request.block_table
    given = []
    for s, ki in zip(seqs, k.tolist(), strict=True):
        drafting_steps = (s.num_steps - 1 if s.is_prefill else s.num_steps) if s.samples else 0
        given.append(_accepted(s, ki, drafting_steps) if ki else None)
    steps, step_rows = [], []
    for j in range(batch.num_steps):
        rows = [i for i, s in enumerate(seqs) if s.num_steps > j and (j == 0 or s.samples)]
        pre = np.array([j == 0 and seqs[i].is_prefill for i in rows], dtype=bool)
        kr = np.where(pre, 0, k[rows])
        qlen = np.where(pre, [seqs[i].num_query_tokens for i in rows], kr + 1)
        samples = np.array([seqs[i].samples for i in rows], dtype=bool)
        acc = np.full(len(rows), -1, dtype=np.int64)
        for r, i in enumerate(rows):
            if given[i] is not None and not pre[r]:
                acc[r] = given[i][j - 1 if seqs[i].is_prefill else j]
        ends = np.cumsum(qlen)
        token_row = np.repeat(np.arange(len(rows)), qlen)
        offset = np.arange(int(ends[-1])) - np.repeat(ends - qlen, qlen)
        tokens = np.zeros(len(offset), dtype=np.int64)
        from_device = np.ones(len(offset), dtype=bool)
        for r, i in enumerate(rows):
            if pre[r]:  # a prefill chunk's tokens are known
                s = seqs[i]
                a = int(ends[r] - qlen[r])
                tokens[a:ends[r]] = s.request.token_ids(s.num_cached_tokens,
                                                        s.num_cached_tokens + s.num_query_tokens)
                from_device[a:ends[r]] = False
        # logits: every position of a decode row, the last token of a prefill row that samples
        li, ls = [], []
        for r in range(len(rows)):
            if pre[r]:
                if samples[r]:
                    li.append(int(ends[r]) - 1)
                    ls.append(r * width)
            else:
                li += range(int(ends[r] - qlen[r]), int(ends[r]))
                ls += range(r * width, r * width + int(qlen[r]))
        steps.append(SpecStep(np.array(rows, dtype=np.int64), qlen.astype(np.int64), kr, pre,
                              samples, acc, tokens, token_row, offset, from_device,
                              np.array(li, dtype=np.int64), np.array(ls, dtype=np.int64),
                              np.flatnonzero(kr > 0)))
        step_rows.append([i for r, i in enumerate(rows) if samples[r]])
    plan = SpecPlan(width, steps, step_rows, start, last, tables, [])
    # the sequences that draft in this window, from where their drafting starts
    drafting = {i: int(s.num_cached_tokens + (s.num_query_tokens if s.is_prefill else 0))
                for i, s in enumerate(seqs) if k[i] and s.samples
                and (not s.is_prefill or s.num_steps > 1)}
    if draft_len is not None:
        for i, p in drafting.items():
            a = min(draft_len(seqs[i]), p)
            if a < p:
                plan.catch_up.append((i, a, seqs[i].request.token_ids(a, p)))
    if ngram and drafting:
        known = [s.num_cached_tokens + (s.num_query_tokens if s.is_prefill else 1)
                 for s in seqs]
        length = max(known) + batch.num_steps * width + 1
        hist = np.zeros((n, length), dtype=np.int64)
        for i in drafting:
            hist[i, :known[i]] = seqs[i].request.token_ids(0, known[i])
        plan.history = (hist, np.array(known, dtype=np.int64))
    return plan


def _same_sampling(p: SamplingParams, backend: SamplingParams) -> bool:
    if p.seed is not None or p.penalized or p.logprobs is not None \
            or p.prompt_logprobs is not None:
        return False
    return (p.greedy and backend.greedy) or (p.temperature, p.top_k, p.top_p) == (
        backend.temperature, backend.top_k, backend.top_p)


# ------------------------------------------------------------------ n-gram prompt lookup
def ngram_propose(hist: torch.Tensor, lens: torch.Tensor, k: int, n_min: int,
                  n_max: int) -> torch.Tensor:
    """Drafts [R, k] by prompt lookup: the continuation of the latest earlier occurrence of
    each row's longest matching suffix (n_max tokens down to n_min) in its own history
    (``hist`` [R, L], the first ``lens`` ids of a row valid); a row with no match drafts its
    newest token repeated. Tensor ops only: no host sync."""
    rows, length = hist.shape
    ar = torch.arange(length, device=hist.device)
    newest = hist.gather(1, (lens - 1).clamp(min=0)[:, None])
    drafts = newest.expand(rows, k).clone()
    found = torch.zeros(rows, dtype=torch.bool, device=hist.device)
    for n in range(n_max, n_min - 1, -1):
        if n >= length:
            continue
        suffix = hist.gather(1, (lens[:, None] - n + torch.arange(n, device=hist.device))
                             .clamp(min=0))
        windows = hist.unfold(1, n, 1)  # [R, L - n + 1, n]
        match = (windows == suffix[:, None, :]).all(-1)
        starts = ar[:length - n + 1]
        # an earlier occurrence with a token after it (not the suffix itself)
        match &= (starts[None, :] + n < lens[:, None]) & (lens[:, None] > n)
        best = torch.where(match, starts[None, :], -1).amax(1)  # the latest one
        hit = (best >= 0) & ~found
        cols = (best[:, None] + n + torch.arange(k, device=hist.device))
        cols = torch.minimum(cols, (lens - 1)[:, None]).clamp(min=0)
        drafts = torch.where(hit[:, None], hist.gather(1, cols), drafts)
        found |= hit
    return drafts


# ------------------------------------------------------------------ static buffers and graphs
def _slots(tables: torch.Tensor, pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """Each row's slot of ``pos`` through its block table (a position past the table reads its
    last entry: the caller masks it)."""
    col = (pos // block_size).clamp(max=tables.shape[1] - 1)
    return tables.gather(1, col[:, None])[:, 0].long() * block_size + pos % block_size


class Speculator:
    """The runner's speculative side: the drafter, the verify and draft buffers and graphs, the
    draft KV cache's per-request valid lengths and the counters."""

    def __init__(self, settings: SpecSettings, target: Llama, draft: Llama | None,
                 kernels: Kernels, block_size: int, max_rows: int, max_tokens: int,
                 table_width: int, graphs: bool = False) -> None:
        self.settings, self.target, self.kernels = settings, target, kernels
        self.draft = draft  # None for n-gram lookup; the target itself for draft_model same
        self.block_size = block_size
        self.width = settings.num_tokens + 1
        self.device = target.device
        self.draft_cache: KVCache | None = None
        self.draft_lens: dict[int, tuple[int, int]] = {}  # request -> (preemptions, draft_len)
        self.counters = SpecDecodeStats()  # as verified: every drafting step to a request's end
        self.verify_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # padded rows -> graph
        self.verify_logits: dict[int, torch.Tensor] = {}
        self.draft_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.draft_ids: dict[int, torch.Tensor] = {}
        dev = self.device

        def buf(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=dev)

        tokens = max(max_tokens, max_rows * self.width)
        self.verify = RowBuffers(buf(tokens), buf(tokens), buf(tokens).fill_(PAD_SLOT_ID),
                                 buf(max_rows + 1, dtype=torch.int32),
                                 buf(max_rows, dtype=torch.int32),
                                 buf(max_rows, table_width, dtype=torch.int32), buf(tokens))
        self._arange = torch.arange(tokens, device=dev)
        self.drafts = DecodeBuffers(buf(max_rows), buf(max_rows), buf(max_rows).fill_(PAD_SLOT_ID),
                                    buf(max_rows, dtype=torch.int32),
                                    buf(max_rows, table_width, dtype=torch.int32))
        self.max_tokens = max_tokens  # the most tokens of one catch-up forward
        # The verify graphs' one output (``graphs``: they will be captured), allocated before
        # the memory profile sizes the KV cache around it: an output per padded row count
        # would hold sum(sizes) x (k + 1) rows of fp32 logits (6 GB at k=2, vocab 128k).
        self.verify_out: torch.Tensor | None = None
        if graphs:
            self.verify_out = torch.empty((max_rows * self.width, target.spec.vocab_size),
                                          dtype=torch.float32, device=dev)

    def allocate_draft_cache(self, num_blocks: int) -> None:
        """The draft model's cache: as many blocks as the target's, read by the same tables."""
        if self.draft is not None:
            d = self.draft
            self.draft_cache = allocate_kv_cache(d.spec, num_blocks, self.block_size, d.dtype,
                                                 self.device)

    # -------------------------------------------------------------- the forwards (graphed)
    def verify_forward(self, kv: KVCache, tokens: int, rows: int, max_query_len: int,
                       num_logits: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Target logits at the buffers' first ``num_logits`` logits indices (into ``out``)."""
        v = self.verify
        hidden = forward(self.target, v.input_ids[:tokens], v.positions[:tokens],
                         v.meta(tokens, rows, max_query_len), kv, self.kernels)
        return compute_logits(self.target, hidden[v.logits_indices[:num_logits]], out)

    def draft_forward(self, rows: int) -> torch.Tensor:
        """The draft model's greedy next token for the buffers' first ``rows`` rows."""
        b = self.drafts
        hidden = forward(self.draft, b.input_ids[:rows], b.positions[:rows], b.meta(rows),
                         self.draft_cache, self.kernels)
        return compute_logits(self.draft, hidden).argmax(-1)

    @torch.inference_mode()
    def capture_graphs(self, kv: KVCache, max_num_seqs: int, pool: object) -> None:
        """CUDA graphs of the uniform verify (every row k + 1 tokens, k = spec.num_tokens;
        their logits a view of ``verify_out``) and of the draft model's step, per padded row
        count, in the runner's graph pool."""
        k1 = self.width
        if self.verify_out is None:
            raise ValueError("the verify graphs write verify_out: build the Speculator with "
                             "graphs=True")
        out = self.verify_out
        v, b = self.verify, self.drafts
        v.seq_lens.zero_()
        v.slot_mapping.fill_(PAD_SLOT_ID)
        b.seq_lens.zero_()
        b.slot_mapping.fill_(PAD_SLOT_ID)
        for r in sorted(decode_graph_sizes(max_num_seqs), reverse=True):
            if r > v.seq_lens.shape[0]:
                continue
            v.query_start_loc[:r + 1].zero_()  # empty rows: capture computes no attention
            v.logits_indices[:r * k1].copy_(self._arange[:r * k1])
            self.verify_graphs[r], self.verify_logits[r] = capture_graph(
                lambda r=r: self.verify_forward(kv, r * k1, r, k1, r * k1, out[:r * k1]), pool)
            if self.draft is not None:
                self.draft_graphs[r], self.draft_ids[r] = capture_graph(
                    lambda r=r: self.draft_forward(r), pool)

    def start_run(self) -> None:
        """A run starts (on a kept runner too): no draft KV is known valid, nothing counted."""
        self.draft_lens.clear()
        self.counters = SpecDecodeStats()

    def _padded(self, graphs: dict[int, Any], n: int) -> int | None:
        return min((r for r in graphs if r >= n), default=None)

    # -------------------------------------------------------------- a window
    def draft_len(self, s: ScheduledSeq) -> int:
        """Positions of ``s``'s request whose draft KV is known valid (0 after a preemption)."""
        req = s.request
        preempted, n = self.draft_lens.get(req.request_id, (-1, 0))
        return n if preempted == req.num_preemptions else 0

    def plan(self, batch: Batch, sampling: SamplingParams) -> SpecPlan:
        """The window's host plan; every row samples with ``sampling`` (backend.sampling): a
        request asking for settings of its own is refused in one line."""
        for s in batch.seqs:
            p = s.request.sampling
            if p is not None and not _same_sampling(p, sampling):
                raise ValueError(f"request {s.request.request_id}: speculative decoding samples "
                                 "every request with backend.sampling (no sampling settings, "
                                 "seed, penalties or logprobs of its own)")
        return plan_spec_window(batch, self.settings.num_tokens, self.settings.method == "ngram",
                                self.draft_len if self.draft is not None else None)

    def run_steps(self, plan: SpecPlan, kv: KVCache, sampling: SamplingParams,
                  generator: torch.Generator,
                  push: Callable[[int, torch.Tensor], None],
                  timers: list[tuple[torch.cuda.Event, torch.cuda.Event]]) -> None:
        """Queue the window's steps; ``push(j, ids)`` takes step j's emitted ids [rows * (K+1)]
        (-1 past a row's emitted tokens) of its sample rows."""
        dev = self.device

        def to(a: np.ndarray) -> torch.Tensor:
            return self._to(a, plan.keep)

        start, last, tables = to(plan.start), to(plan.last), to(plan.tables)
        if plan.catch_up:
            self._catch_up(plan, tables, to)
        hist = lens = None
        if plan.history is not None:
            hist, lens = to(plan.history[0]), to(plan.history[1])
        k1 = plan.width
        cols = torch.arange(k1, device=dev)
        for j, st in enumerate(plan.steps):
            if timers:
                timers[j][0].record()
            rows, r = to(st.rows), len(st.rows)
            drafts = torch.zeros((r, k1 - 1), dtype=torch.int64, device=dev)
            if len(st.draft_rows):
                d = to(st.draft_rows)
                rd = rows.index_select(0, d)
                kd = to(st.k[st.draft_rows])
                if self.draft is not None:
                    drafts[d] = self._draft(last[rd], start[rd], tables[rd], kd, k1 - 1)
                else:
                    s = self.settings
                    drafts[d] = ngram_propose(hist[rd], lens[rd], k1 - 1, s.ngram_min,
                                              s.ngram_max)
            logits = self._verify(st, kv, rows, start, last, tables, drafts, to)
            sampled = sample(logits, sampling, generator)
            g = torch.full((r * k1,), -1, dtype=torch.int64, device=dev)
            g[to(st.logit_slot)] = sampled
            g = g.view(r, k1)
            # acceptance: the given counts, else the drafts' prefix the target agrees with
            k = to(st.k)
            agree = (drafts == g[:, :-1]) & (cols[None, :-1] < k[:, None])
            greedy = agree.long().cumprod(1).sum(1)
            given = to(st.accepted)
            acc = torch.where(given >= 0, given, greedy)
            bonus = g.gather(1, acc[:, None])
            emitted = torch.where(cols[None] < acc[:, None], torch.cat([drafts, bonus], 1),
                                  torch.where(cols[None] == acc[:, None], bonus, -1))
            # the rollback: the next step starts past the accepted tokens, from the bonus token
            pre = to(st.prefill)
            qlen = to(st.qlen)
            start.index_copy_(0, rows, start[rows] + torch.where(pre, qlen, acc + 1))
            last.index_copy_(0, rows, bonus[:, 0])
            if hist is not None:
                h, n = hist[rows], lens[rows]
                idx = (n[:, None] + cols[None]).clamp(max=hist.shape[1] - 1)
                h.scatter_(1, idx, torch.where(cols[None] <= acc[:, None], emitted,
                                               h.gather(1, idx)))
                hist[rows] = h
                lens.index_copy_(0, rows, n + acc + 1)
            if timers:
                timers[j][1].record()
            keep = np.flatnonzero(st.samples)
            out = emitted if len(keep) == r else emitted[to(keep)]
            push(j, out.reshape(-1))

    def _to(self, a: np.ndarray, keep: list[torch.Tensor]) -> torch.Tensor:
        """``a`` on the device, its copy queued: from pinned memory (kept in ``keep`` until the
        window is collected), so that the host never waits for the steps queued before it."""
        t = torch.from_numpy(np.ascontiguousarray(a))
        if self.device.type != "cuda":
            return t
        t = t.pin_memory()
        keep.append(t)
        return t.to(self.device, non_blocking=True)

    def _catch_up(self, plan: SpecPlan, tables: torch.Tensor,
                  to: Callable[[np.ndarray], torch.Tensor]) -> None:
        """Flat draft forwards over the positions each drafting request's draft KV lacks, at
        most ``max_tokens`` tokens each (the memory profile's bound: a window may owe whole
        histories, e.g. after preemptions)."""
        for spans in catch_up_chunks(plan.catch_up, self.max_tokens):
            self._catch_up_forward(spans, tables, to)

    def _catch_up_forward(self, spans: list[tuple[int, int, list[int]]], tables: torch.Tensor,
                          to: Callable[[np.ndarray], torch.Tensor]) -> None:
        lens = np.array([len(ids) for _, _, ids in spans], dtype=np.int64)
        seq = np.array([i for i, _, _ in spans], dtype=np.int64)
        first = np.array([a for _, a, _ in spans], dtype=np.int64)
        tokens = np.fromiter((t for _, _, ids in spans for t in ids), dtype=np.int64,
                             count=int(lens.sum()))
        row = np.repeat(np.arange(len(spans)), lens)
        pos = np.repeat(first, lens) + np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens,
                                                                         lens)
        t = tables[to(seq)]
        pos_d = to(pos)
        row_d = to(row)
        slots = _slots(t[row_d], pos_d, self.block_size)
        qsl = to(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
        seq_lens = to((first + lens).astype(np.int32))
        meta = AttentionMetadata(slots, len(pos), PrefillMetadata(qsl, seq_lens, t,
                                                                  int(lens.max())), None)
        forward(self.draft, to(tokens), pos_d, meta, self.draft_cache, self.kernels)

    def _draft(self, last: torch.Tensor, start: torch.Tensor, tables: torch.Tensor,
               k: torch.Tensor, max_k: int) -> torch.Tensor:
        """Drafts [D, max_k] of the draft model: max_k + 1 one-token steps over the newest
        token and the drafts, each row writing its KV at positions up to its own k only."""
        b, n = self.drafts, last.shape[0]
        padded = self._padded(self.draft_graphs, n) or n
        w = tables.shape[1]
        b.block_tables[:n, :w].copy_(tables)
        b.input_ids[:n].copy_(last)
        b.input_ids[n:padded].zero_()
        b.positions[n:padded].zero_()
        b.seq_lens[n:padded].zero_()
        b.slot_mapping[n:padded].fill_(PAD_SLOT_ID)
        out = torch.empty((n, max_k), dtype=torch.int64, device=self.device)
        for i in range(max_k + 1):
            pos = start + i
            b.positions[:n].copy_(pos)
            b.seq_lens[:n].copy_((start + k.clamp(max=i) + 1).to(torch.int32))
            b.slot_mapping[:n].copy_(torch.where(k >= i, _slots(tables, pos, self.block_size),
                                                 PAD_SLOT_ID))
            if padded in self.draft_graphs:
                self.draft_graphs[padded].replay()
                ids = self.draft_ids[padded][:n]
            else:
                ids = self.draft_forward(padded)[:n]
            if i < max_k:
                out[:, i] = ids
                b.input_ids[:n].copy_(ids)
        return out

    def _verify(self, st: SpecStep, kv: KVCache, rows: torch.Tensor, start: torch.Tensor,
                last: torch.Tensor, tables: torch.Tensor, drafts: torch.Tensor,
                to: Callable[[np.ndarray], torch.Tensor]) -> torch.Tensor:
        """Target logits of the step's sampled positions: the flat batch built in the verify
        buffers from the host's tokens, the newest tokens and the drafts."""
        v, k1 = self.verify, self.width
        r, t = len(st.rows), len(st.tokens)
        token_row = to(st.token_row)
        offset = to(st.offset)
        ids = to(st.tokens)
        newest = last[rows][token_row]
        drafted = drafts[token_row, (offset - 1).clamp(0, drafts.shape[1] - 1)]
        from_dev = to(st.from_device)
        ids = torch.where(from_dev, torch.where(offset == 0, newest, drafted), ids)
        base = start[rows]
        pos = base[token_row] + offset
        t_rows = tables[rows]
        uniform = not st.prefill.any() and bool((st.qlen == k1).all())
        graph = self._padded(self.verify_graphs, r) if uniform else None
        padded = graph or r
        tokens = padded * k1 if graph else t
        v.input_ids[:t].copy_(ids)
        v.positions[:t].copy_(pos)
        v.slot_mapping[:t].copy_(_slots(t_rows[token_row], pos, self.block_size))
        v.input_ids[t:tokens].zero_()
        v.positions[t:tokens].zero_()
        v.slot_mapping[t:tokens].fill_(PAD_SLOT_ID)
        qsl = np.concatenate([[0], np.cumsum(st.qlen)]).astype(np.int32)
        v.query_start_loc[:r + 1].copy_(to(qsl))
        v.query_start_loc[r + 1:padded + 1].fill_(t)  # padding rows: empty, at the end
        v.seq_lens[:r].copy_((base + to(st.qlen)).to(torch.int32))
        v.seq_lens[r:padded].zero_()
        v.block_tables[:r, :t_rows.shape[1]].copy_(t_rows)
        n_logits = len(st.logit_index)
        if graph:  # every token's logits, in order: the uniform verify's logit indices
            v.logits_indices[:tokens].copy_(self._arange[:tokens])
            self.verify_graphs[graph].replay()
            return self.verify_logits[graph][:n_logits]
        v.logits_indices[:n_logits].copy_(to(st.logit_index))
        return self.verify_forward(kv, t, r, int(st.qlen.max()), n_logits)

    def finish(self, batch: Batch, plan: SpecPlan, ids: list[list[int]]) -> None:
        """The window's ids are in (before the scheduler's update): count each drafting
        request's drafts and acceptances up to its last token, as the scheduler does; where the
        engine verified (num_accepted None) record the counts it found in the ScheduledSeq,
        from which the scheduler grows the request; move its valid draft length past its
        accepted tokens."""
        seqs, k1 = batch.seqs, plan.width
        plan.keep.clear()  # every step has run: their copies too
        accepted: list[list[int]] = [[] for _ in seqs]
        for j, rows in enumerate(plan.step_rows):
            step = ids[j]
            for m, i in enumerate(rows):
                s = seqs[i]
                if s.num_decode_tokens > 1 and not (j == 0 and s.is_prefill):
                    accepted[i].append(sum(1 for x in step[m * k1:(m + 1) * k1] if x >= 0) - 1)
        for i, s in enumerate(seqs):
            acc = accepted[i]
            if not acc:
                continue
            req = s.request
            owed = req.max_tokens - req.num_output_tokens - (1 if s.is_prefill else 0)
            steps = 0
            while steps < len(acc) and owed > 0:
                owed -= acc[steps] + 1
                steps += 1
            self.counters.record(acc, s.num_decode_tokens - 1, steps)
            if s.num_accepted is None and not s.is_prefill:
                s.num_accepted = acc  # verified here: what the scheduler's update() credits
        if self.draft is None:
            return
        if len(self.draft_lens) > 4 * max(len(seqs), 64):  # forget requests long gone
            here = {s.request.request_id for s in seqs}
            self.draft_lens = {r: v for r, v in self.draft_lens.items() if r in here}
        for i, a, ids_ in plan.catch_up:
            req = seqs[i].request
            self.draft_lens[req.request_id] = (req.num_preemptions, a + len(ids_))
        for i, s in enumerate(seqs):
            if accepted[i]:
                base = s.num_cached_tokens + (s.num_query_tokens if s.is_prefill else 0)
                self.draft_lens[s.request.request_id] = (
                    s.request.num_preemptions, base + sum(accepted[i]) + len(accepted[i]))

def catch_up_chunks(spans: list[tuple[int, int, list[int]]], max_tokens: int
                    ) -> list[list[tuple[int, int, list[int]]]]:
    """``spans`` (sequence, first position, ids) packed into forwards of at most
    ``max_tokens`` tokens, in order; a span too long for the room left is split, and its later
    part starts the next forward (a position's KV is written before a later forward reads it)."""
    chunks: list[list[tuple[int, int, list[int]]]] = [[]]
    room = max_tokens
    for i, first, ids in spans:
        while ids:
            if room == 0:
                chunks.append([])
                room = max_tokens
            part = ids[:room]
            chunks[-1].append((i, first, part))
            first, ids, room = first + len(part), ids[len(part):], room - len(part)
            if ids:
                room = 0
    return [c for c in chunks if c]


def build_speculator(settings: SpecSettings, target: Llama, kernels: Kernels, block_size: int,
                     max_num_seqs: int, max_num_batched_tokens: int, table_width: int,
                     seed: int, graphs: bool = False) -> Speculator:
    """The drafter of ``settings`` beside ``target``: the target itself (draft_model same),
    or a conf/model shape with its own weights (draft_weights, else seeded random ones);
    ``graphs``: its verify and draft steps will be captured as CUDA graphs."""
    from real_backend.weights import load_hf_model, random_model

    draft: Llama | None = None
    if settings.method == "draft":
        shape = draft_spec(settings, target.spec)
        if shape is None:
            draft = target
        elif settings.draft_weights:
            draft = load_hf_model(shape, settings.draft_weights, target.device, target.dtype)
        else:
            draft = random_model(shape, target.device, target.dtype, seed + 1)
    return Speculator(settings, target, draft, kernels, block_size, max_num_seqs,
                      max_num_batched_tokens, table_width, graphs)
