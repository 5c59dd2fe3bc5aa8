"""A window's inputs as host arrays (``HostPlan``): which rows sample at each step, step 1's flat
prefill + decode batch or its decode rows, later steps' decode state, overlap's token-map rows,
and each row's own sampling settings where a request has them (its penalties' rows, the
logprobs it asks for, its prompt's logprobs).
Built from the scheduler's batch on rank 0; with tensor parallelism it is the compact window
description rank 0 broadcasts, and every rank turns it into device inputs (runner.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from policies.batch import Batch, ScheduledSeq
from policies.request import Request
from policies.sampling_params import SamplingParams
from real_backend.ops import PAD_SLOT_ID
from real_backend.sampling import seed_key


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
    fetch: tuple[np.ndarray, np.ndarray] | None = None  # (token index, map row): see host_tokens
    prompt_logprobs: PromptLogprobs | None = None  # the prompt tokens whose logprobs it returns


@dataclass(slots=True)
class PromptLogprobs:
    """The prompt logprobs a step-1 batch computes: the logits at a token give the logprob of
    the prompt token after it (vLLM's prompt_logprobs; the first prompt token has none)."""

    indices: np.ndarray  # [t] int64 tokens of the flat batch whose logits are taken
    targets: np.ndarray  # [t] int64 the prompt token after each
    num: int  # the most top logprobs one of them asks for
    spans: list[tuple[int, int, int]]  # (sequence, first target position, tokens), in order


@dataclass(slots=True)
class DecodeInputs:
    """Decode state of ``n`` rows (padded to ``padded``, a decode graph's size) loaded before a
    step. Step 0 gets complete inputs (the newest token, its position and slot, seq_lens
    counting it); a later step gets seq_lens = tokens cached so far and block tables, and
    advance_step derives the rest from the previous step's samples."""

    step: int
    n: int
    padded: int
    tables: np.ndarray  # [n, width] int32
    seq_lens: np.ndarray  # [padded] int32
    tokens: np.ndarray | None = None  # [padded] int64 (step 0)
    positions: np.ndarray | None = None
    slots: np.ndarray | None = None
    fetch: tuple[np.ndarray, np.ndarray] | None = None  # (row, token-map row): see host_tokens


@dataclass(slots=True)
class SamplingRows:
    """Each sample row's settings, for the steps that sample the same rows (from
    ``first_step`` on): the request's own, else the backend's (sampling.RowSampling)."""

    first_step: int
    temperature: np.ndarray  # [n] float32, 0: greedy
    top_k: np.ndarray  # [n] int64, -1: whole vocabulary
    top_p: np.ndarray  # [n] float32
    seeded: np.ndarray  # [s] int64: rows with a seed
    keys: np.ndarray  # [s] int64: their seed keys (sampling.seed_key)
    positions: np.ndarray  # [s] int64: the position each samples at first_step
    logprob_rows: np.ndarray | None = None  # [m] int64: rows that ask for logprobs
    num_logprobs: int = 0  # the most top logprobs one of them asks for
    # rows with a penalty: their positions among the rows, their PenaltyState rows and penalties
    penalty_where: np.ndarray | None = None  # [q] int64
    penalty_rows: np.ndarray | None = None  # [q] int64
    penalties: np.ndarray | None = None  # [q, 3] float32: presence, frequency, repetition


@dataclass(slots=True)
class PenaltyInit:
    """The ``PenaltyState`` rows a window (re)builds before its first step, from the tokens
    the host knows: (row, token id) pairs of their prompts and outputs."""

    rows: np.ndarray  # [r] int64
    num_rows: int  # rows the state must hold
    prompt: tuple[np.ndarray, np.ndarray]
    output: tuple[np.ndarray, np.ndarray]


@dataclass(slots=True)
class HostPlan:
    """Everything the device needs of a window, as host arrays (picklable, compact)."""

    num_steps: int
    step_rows: list[list[int]]  # step j's sample rows as indices into batch.seqs
    flat: FlatInputs | None = None  # step 1 with multi-token rows (else decode[0] loads it)
    first_graph: tuple[int, int] | None = None  # step 1 replays this prefill graph
    first_pieces: int | None = None  # step 1 replays the piecewise graphs of this size
    decode: dict[int, DecodeInputs] = field(default_factory=dict)  # step -> rows to load
    gathers: dict[int, np.ndarray] = field(default_factory=dict)  # step -> rows of last samples
    map_rows: list[int] | None = None  # overlap: each sequence's token-map row
    map_writes: list[np.ndarray] = field(default_factory=list)  # step -> map rows of its samples
    # step -> its rows' own sampling settings; empty when no request has its own (every offline
    # run), and the whole window samples with the backend's setting
    sampling: list[SamplingRows] = field(default_factory=list)
    penalty_init: PenaltyInit | None = None  # penalty rows built before step 1


@dataclass(frozen=True, slots=True)
class PlanSizes:
    """What the runner's captured graphs make of a window's sizes."""

    block_size: int
    decode_padded: Callable[[int], int]  # decode rows -> rows the step computes
    prefill_key: Callable[[int, int], tuple[int, int] | None] | None  # (tokens, prompts) -> graph
    piecewise_size: Callable[[int], int | None] | None  # tokens -> piecewise graphs' size


def plan_window(batch: Batch, sizes: PlanSizes,
                map_rows: Callable[[list[Request]], list[int]] | None = None,
                sampling: SamplingParams | None = None,
                penalty_rows: PenaltyRows | None = None) -> HostPlan:
    """The window's host inputs; ``map_rows`` (overlap) gives each request's token-map row;
    ``sampling``: the backend's, for the rows of requests without their own; ``penalty_rows``
    each penalized request's PenaltyState row (and which are new). A sequence whose prompt
    logprobs this window computes runs in the flat step 1 (eager or piecewise, which keep
    every token's hidden state), whatever its length."""
    seqs = batch.seqs
    for s in seqs:
        if s.num_decode_tokens != 1:
            raise ValueError(f"real_backend: request {s.request.request_id} decodes "
                             f"{s.num_decode_tokens} tokens a step (ScheduledSeq."
                             "num_decode_tokens): a drafting window runs through "
                             "real_backend/speculative.py")
    own = any(s.request.sampling is not None for s in seqs)  # never in an offline run
    spans = ({i: span for i, s in enumerate(seqs) if (span := _prompt_span(s)) is not None}
             if own else {})
    multi = [i for i, s in enumerate(seqs) if s.num_query_tokens > 1]
    single = [i for i, s in enumerate(seqs) if s.num_query_tokens == 1]
    if spans:  # a one-token chunk that gives prompt logprobs runs in the flat step too
        multi = [i for i, s in enumerate(seqs) if s.num_query_tokens > 1 or i in spans]
        single = [i for i in single if i not in spans]
    order = multi + single
    if multi:
        sample_rows = [i for i in order if seqs[i].samples]
    else:
        sample_rows = order  # a graph computes every row; non-sampling ones are ignored
    step_rows = [sample_rows] + [[i for i in sample_rows if seqs[i].num_steps > j]
                                 for j in range(1, batch.num_steps)]
    plan = HostPlan(batch.num_steps, step_rows)
    if map_rows is not None:  # every step's samples go to the token map
        plan.map_rows = rows = map_rows([s.request for s in seqs])
        for j, step in enumerate(step_rows):
            plan.map_writes.append(plan.map_writes[-1] if j and step == step_rows[j - 1]
                                   else np.array([rows[i] for i in step], dtype=np.int64))
    if multi:
        plan.flat = flat = flat_inputs(seqs, multi, single, sizes.block_size, plan.map_rows)
        if spans:
            flat.prompt_logprobs = prompt_logprobs(seqs, multi, spans, flat)
        if not single and not spans and sizes.prefill_key is not None:
            plan.first_graph = sizes.prefill_key(len(flat.tokens), len(multi))
        if plan.first_graph is None and sizes.piecewise_size is not None:
            plan.first_pieces = sizes.piecewise_size(len(flat.tokens))
    else:
        plan.decode[0] = decode_inputs(seqs, order, 0, sizes, plan.map_rows)
    loaded = order if not multi else None
    for j in range(1, batch.num_steps):
        rows = step_rows[j]
        if rows != step_rows[j - 1]:
            pos = {i: r for r, i in enumerate(step_rows[j - 1])}
            plan.gathers[j] = np.array([pos[i] for i in rows], dtype=np.int64)
        if rows != loaded:
            plan.decode[j] = decode_inputs(seqs, rows, j, sizes)
            loaded = rows
    if own:
        pen_rows = None
        if penalty_rows is not None:
            penalized = [i for i in step_rows[0]
                         if (p := seqs[i].request.sampling) is not None and p.penalized]
            if penalized:
                pen_rows, plan.penalty_init = penalty_inputs(seqs, penalized, penalty_rows)
        for j, rows in enumerate(step_rows):
            plan.sampling.append(plan.sampling[-1] if j and rows == step_rows[j - 1]
                                 else sampling_rows(seqs, rows, j, sampling or SamplingParams(),
                                                    pen_rows))
    return plan


# (requests) -> each one's PenaltyState row, and the indices of those new (sampling.PenaltyState)
PenaltyRows = Callable[[list[Request]], tuple[list[int], list[int]]]


def sampling_rows(seqs: list[ScheduledSeq], rows: list[int], step: int,
                  default: SamplingParams,
                  penalty_rows: dict[int, int] | None = None) -> SamplingRows:
    """The settings of ``rows`` (sequence indices) at ``step``; ``penalty_rows``: each
    penalized sequence's PenaltyState row."""
    params = [seqs[i].request.sampling or default for i in rows]
    seeded = [r for r, p in enumerate(params) if p.seed is not None and not p.greedy]
    # a temperature beyond float32's range samples uniformly either way: cast without numpy's
    # overflow warning
    temperature = np.minimum([p.temperature for p in params], np.finfo(np.float32).max)
    out = SamplingRows(
        step, temperature.astype(np.float32),
        np.array([p.top_k for p in params], dtype=np.int64),
        np.array([p.top_p for p in params], dtype=np.float32),
        np.array(seeded, dtype=np.int64),
        np.array([seed_key(params[r].seed) for r in seeded], dtype=np.int64),
        # the token sampled at step j sits past the tokens computed by then
        np.array([_computed_by(seqs[rows[r]], step) for r in seeded], dtype=np.int64))
    asking = [r for r, p in enumerate(params) if p.logprobs is not None]
    if asking:
        out.logprob_rows = np.array(asking, dtype=np.int64)
        out.num_logprobs = max(params[r].logprobs for r in asking)
    where = [r for r, i in enumerate(rows) if penalty_rows and i in penalty_rows]
    if where:
        out.penalty_where = np.array(where, dtype=np.int64)
        out.penalty_rows = np.array([penalty_rows[rows[r]] for r in where], dtype=np.int64)
        out.penalties = np.array([(params[r].presence_penalty, params[r].frequency_penalty,
                                   params[r].repetition_penalty) for r in where],
                                 dtype=np.float32)
    return out


def penalty_inputs(seqs: list[ScheduledSeq], penalized: list[int], penalty_rows: PenaltyRows
                   ) -> tuple[dict[int, int], PenaltyInit | None]:
    """Each penalized sequence's PenaltyState row, and the rows to build (new requests'), from
    the prompt and output tokens the host knows."""
    reqs = [seqs[i].request for i in penalized]
    rows, new = penalty_rows(reqs)
    init = None
    if new:
        pr, pt, orow, ot = [], [], [], []
        for n in new:
            req, row = reqs[n], rows[n]
            if req.num_output_placeholders > seqs[penalized[n]].num_placeholders:
                raise RuntimeError(f"request {req.request_id}: its penalty row is built while "
                                   "tokens of an earlier window are in flight")
            pt += req.prompt_token_ids
            pr += [row] * req.prompt_len
            ot += req.output_token_ids
            orow += [row] * len(req.output_token_ids)
        init = PenaltyInit(np.array([rows[n] for n in new], dtype=np.int64), max(rows) + 1,
                           (np.array(pr, dtype=np.int64), np.array(pt, dtype=np.int64)),
                           (np.array(orow, dtype=np.int64), np.array(ot, dtype=np.int64)))
    return dict(zip(penalized, rows, strict=True)), init


def _prompt_span(s: ScheduledSeq) -> tuple[int, int] | None:
    """The prompt positions whose logprobs ``s``'s chunk gives, (first, count), if its request
    asks for them: each chunk token before the prompt's last gives the next one's."""
    p = s.request.sampling
    if p is None or p.prompt_logprobs is None:
        return None
    first = s.num_cached_tokens + 1
    last = min(s.num_cached_tokens + s.num_query_tokens, s.request.prompt_len - 1)
    return (first, last - first + 1) if last >= first else None


def prompt_logprobs(seqs: list[ScheduledSeq], multi: list[int],
                    spans: dict[int, tuple[int, int]], flat: FlatInputs) -> PromptLogprobs:
    """The flat batch's tokens whose logits give the prompt logprobs of ``spans``."""
    indices, targets, out = [], [], []
    start = 0
    for i in multi:
        s = seqs[i]
        if i in spans:
            first, count = spans[i]
            offset = start + first - 1 - s.num_cached_tokens
            indices.append(np.arange(offset, offset + count, dtype=np.int64))
            targets.append(np.asarray(s.request.token_ids(first, first + count),
                                      dtype=np.int64))
            out.append((i, first, count))
        start += s.num_query_tokens
    num = max(seqs[i].request.sampling.prompt_logprobs for i in spans)
    return PromptLogprobs(np.concatenate(indices), np.concatenate(targets), num, out)


def decode_inputs(seqs: list[ScheduledSeq], rows: list[int], step: int, sizes: PlanSizes,
                  map_rows: list[int] | None = None) -> DecodeInputs:
    n = len(rows)
    padded = sizes.decode_padded(n)
    rs = [seqs[i] for i in rows]
    width = max((len(s.request.block_table) for s in rs), default=1)
    seq_lens = np.zeros(padded, dtype=np.int32)
    seq_lens[:n] = [_computed_by(s, step - 1) for s in rs]
    out = DecodeInputs(step, n, padded, table_rows(rs, width), seq_lens)
    if step == 0:
        seq_lens[:n] += 1
        out.tokens = np.zeros(padded, dtype=np.int64)
        ids, out.fetch = host_tokens(rs, [map_rows[i] for i in rows] if map_rows else None)
        out.tokens[:n] = ids
        out.positions = np.zeros(padded, dtype=np.int64)
        out.positions[:n] = [s.num_cached_tokens for s in rs]
        out.slots = np.full(padded, PAD_SLOT_ID, dtype=np.int64)
        bs = sizes.block_size
        out.slots[:n] = [s.request.block_table[s.num_cached_tokens // bs] * bs
                         + s.num_cached_tokens % bs for s in rs]
    return out


def _computed_by(s: ScheduledSeq, step: int) -> int:
    """``s``'s tokens in the KV cache once step ``step`` (0-based) of its window has run."""
    return s.num_cached_tokens + s.num_query_tokens + step * s.num_decode_tokens


def flat_inputs(seqs: list[ScheduledSeq], multi: list[int], single: list[int], block_size: int,
                map_rows: list[int] | None = None) -> FlatInputs:
    pre = [seqs[i] for i in multi]
    dec = [seqs[i] for i in single]
    every = pre + dec
    # prefill chunks' tokens are all known (a request is re-admitted only once its tokens
    # are); a decode's may be in flight
    ids, fetch = host_tokens(dec, [map_rows[i] for i in single] if map_rows else None)
    tokens = np.concatenate([np.asarray(s.request.token_ids(
        s.num_cached_tokens, s.num_cached_tokens + s.num_query_tokens), dtype=np.int64)
        for s in pre] + [np.asarray(ids, dtype=np.int64)])
    positions = np.concatenate([np.arange(s.num_cached_tokens,
                                          s.num_cached_tokens + s.num_query_tokens)
                                for s in every])
    slots = np.concatenate([_slots(s.request, s.num_cached_tokens,
                                   s.num_cached_tokens + s.num_query_tokens, block_size)
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
        table_rows(pre, width),
        np.array([s.num_cached_tokens + s.num_query_tokens for s in dec], dtype=np.int32),
        table_rows(dec, width), logits_indices, int(ends[len(pre) - 1]),
        int(q_lens[:len(pre)].max()),
        None if fetch is None else (fetch[0] + int(ends[len(pre) - 1]), fetch[1]))


def host_tokens(rs: Sequence[ScheduledSeq], map_rows: list[int] | None
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


def _slots(req: Request, start: int, end: int, block_size: int) -> np.ndarray:
    pos = np.arange(start, end)
    table = np.asarray(req.block_table, dtype=np.int64)
    return table[pos // block_size] * block_size + pos % block_size


def table_rows(seqs: list[ScheduledSeq], width: int) -> np.ndarray:
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
