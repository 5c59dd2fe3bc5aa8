"""The GPU cost model: the time of each forward step of a window, from the batch's composition.

A step's time on one GPU of a ``tp``-way group is a sum of terms, each a hardware
coefficient times a feature of the step (``StepShape``), so that a calibrated profile can set
the coefficients by least squares (the two rooflines by choosing each step's binding side):

    t_step = R(F_lin / (P * eta_mm), B_w / (W * eta_mem))            linear layers
           + F_attn / (P * eta_attn_prefill)                          prefill attention
           + max(N_kv * b_kv / (W * eta_attn_decode),                 KV-cache reads, or the
                 C_max * b_kv / (S * B_seq))                           longest sequence's
           + R(F_lm / (P * eta_mm), B_lm / (W * eta_mem))             LM head (sampled rows only)
           + t_sampler + N_s * V * b_logit / (W * eta_mem)            sampler
         + t_replay + N_k * t_graph_kernel                            (CUDA graph), or for
                                  eager steps the whole sum so far is max(sum, N_k * t_launch),
                                  or for piecewise graphs (L + 1) t_replay + N_k t_graph_kernel
                                  and at least (L + 1 + L n_e) t_launch (n_e: eager kernels
                                  a layer launches between pieces, ``piecewise_eager_kernels``);
                                  eager and piecewise steps whose decode attention splits its
                                  keys launch its merge besides in every layer
           + t_advance_step            (steps 2..k of a multi-step window)
           + (2L+1) (t_ar + 2 (tp-1)/tp * T h d / (N * eta_ar))       TP all-reduces (tp > 1)
           + t_ar + (tp-1)/tp * N_s V d / (N * eta_ar)                logits gather (tp > 1)

with C_max the longest decoding context, S its key splits and B_seq the rate one sequence's
context is read at (attn_seq_gbps; 0 turns the term off); R(c, m) = (c^p + m^p)^(1/p) a
matmul's roofline (p: roofline_exponent; 0 by default, the plain max(c, m); the calibration
fits it, as batches near the knee, where neither bound hides the other, take longer than
either, while far from it the larger bound alone sets the time);
P the dense bf16 peak (FLOP/s), W the HBM bandwidth, N the NVLink bandwidth per direction,
L layers, h hidden size, V vocabulary, d bytes per element, and per step:

    F_lin  = 2 T L p_mm / tp         (p_mm: matmul parameters per layer; T: query tokens,
                                      padded to the CUDA-graph batch size in graph steps)
    B_w    = L p_layer d / tp        (every weight is read once per step)
    F_attn = 4 head_dim n_heads L / tp * sum_prefill q (q + 1) / 2 + q c
                                     (causal pairs of a q-token chunk over c cached tokens)
    N_kv   = sum over sequences of the KV tokens the step touches (c + q at step 1, the
             context at later steps); b_kv: KV bytes of one token on one GPU
    F_lm   = 2 N_s h V / tp,  B_lm = h V d / tp      (N_s: sequences that sample)
    N_k    = kernels_per_layer * L

With tp > 1 every layer all-reduces its attention output (o_proj) and its MLP output
(down_proj), and the vocabulary-parallel embedding one more (2L + 1 ring all-reduces of the
T x h activations: 2 (tp-1)/tp of the bytes cross each link); the vocabulary-parallel LM
head's logits are gathered (real_backend/parallel.py; docs/parallel.md).

A pipeline stage (``pp`` > 1) costs t_step / pp plus the send of the hidden states and the
residual to the next stage (t_p2p + 2 T h d / N). Activations are not counted as HBM
traffic: at decode sizes they stay in L2, and at prefill sizes the compute term binds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from common.model_spec import ModelSpec
from common.parallel import kv_heads_per_rank
from common.step_sizes import (
    decode_splits,
)
from policies.base import StepTimeFn
from policies.batch import Batch
from policies.request import Request
from policies.speculation import draft_steps_time
from simulator.hardware import HardwareSpec
from simulator.step_shape import StepShape, graph_tokens, piecewise_tokens, window_shapes  # noqa: F401

_US = 1e-6


def _roofline(compute_s: float, memory_s: float, hw: HardwareSpec) -> float:
    """A matmul's time from its two bounds: their p-norm, smooth at the knee where neither side
    hides the other (p = roofline_exponent; 0: the plain max)."""
    p = hw.roofline_exponent
    if not p:
        return max(compute_s, memory_s)
    hi = max(compute_s, memory_s)
    if hi <= 0:
        return 0.0
    return hi * (1.0 + (min(compute_s, memory_s) / hi) ** p) ** (1.0 / p)


def step_time(shape: StepShape, model: ModelSpec, hw: HardwareSpec, slow: float = 1.0) -> float:
    """Seconds of one forward step over the whole model on a ``tp``-way group (see module doc);
    ``slow``: how many times slower than at full clock the compute-bound terms run
    (``simulator.clock``: the power-limited SM clock)."""
    return step_cost(shape, model, hw, slow)[0]


def step_cost(shape: StepShape, model: ModelSpec, hw: HardwareSpec,
              slow: float = 1.0) -> tuple[float, float]:
    """(step seconds, tensor-core seconds): the step's time and how much of it the compute-
    bound terms (matmul compute sides, prefill attention) take, both at clock slowdown ``slow``."""
    if shape.num_seqs == 0:
        return 0.0, 0.0  # a step nobody takes part in launches nothing
    if hw.op_tables:  # priced from operator tables (simulator.op_cost) rather than rooflines
        from simulator.op_cost import op_step_cost

        return op_step_cost(shape, model, hw, slow)
    if shape.num_prefill_tokens or slow != 1.0:
        return _with_context(shape, _step_terms(shape, model, hw, slow))
    return _with_context(shape, _decode_terms(shape, model, hw))


# A decode step's terms by (model, hardware, tokens, sequences, sampled, first step)
_DECODE_TERMS: dict[tuple, tuple] = {}


def _decode_terms(shape: StepShape, model: ModelSpec, hw: HardwareSpec) -> tuple:
    """A decode step's terms at full clock (``_step_terms``): all but its KV reads depend on
    its batch size alone, so they are worked out once per size."""
    key = (id(model), id(hw), shape.num_tokens, shape.num_seqs, shape.num_sampled,
           shape.is_first)
    terms = _DECODE_TERMS.get(key)
    if terms is None:  # (the specs are kept with their terms: their ids stay theirs)
        terms = _DECODE_TERMS[key] = (_step_terms(shape, model, hw, 1.0), model, hw)
    return terms[0]


def _with_context(shape: StepShape, terms: tuple) -> tuple[float, float]:
    """step_cost from the step's terms (``_step_terms``): those before its KV reads summed
    (``t``), the KV reads (bytes a token, the rate the batch's and the longest sequence's are
    read at), and those after, in order (added, or for False the step's time at least that)."""
    t, busy, kv_bytes, kv_rate, seq_rate, then = terms
    t_kv = shape.kv_tokens * kv_bytes / kv_rate
    if seq_rate and shape.max_kv_tokens:
        # A ragged batch waits for its longest sequence, read by (splits x kv heads) programs.
        t_kv = max(t_kv, shape.max_kv_tokens * kv_bytes / seq_rate)
    t += t_kv
    for add, term in then:
        t = t + term if add else max(t, term)
    return t, min(busy, t)


def _step_terms(shape: StepShape, model: ModelSpec, hw: HardwareSpec, slow: float
                ) -> tuple[float, float, float, float, float, tuple[tuple[bool, float], ...]]:
    """step_cost's terms but the step's context (``_with_context``), in its order of sums."""
    tp, L = hw.tp, model.num_layers
    h, V, d = model.hidden_size, model.vocab_size, model.dtype_bytes
    flops = hw.peak_flops
    bw = hw.hbm_bytes_per_s
    mm_rate = flops * hw.matmul_efficiency
    mem_rate = bw * hw.mem_bw_efficiency
    padded = graph_tokens(shape, hw)
    graph = padded is not None
    pieces = None if graph else piecewise_tokens(shape, hw)
    T = padded if graph else pieces or shape.num_tokens
    p_layer = model.params_per_layer
    p_mm = p_layer - 2 * h  # the RMSNorm weights are not matmuls

    mm_rate /= slow
    busy = 2.0 * T * L * p_mm / tp / mm_rate
    t = _roofline(busy, L * p_layer * d / tp / mem_rate, hw)
    attn = 4.0 * model.head_dim * model.num_heads * L / tp * shape.attn_pairs / (
        flops * hw.attn_prefill_efficiency) * slow
    busy += attn
    t += attn
    kv_bytes = 2 * L * kv_heads_per_rank(model, tp) * model.head_dim * d
    seq_rate = 0.0
    if hw.attn_seq_gbps:
        splits = decode_attention_splits(shape, model, hw, padded)
        seq_rate = splits * hw.attn_seq_gbps * 1e9
    then: list[tuple[bool, float]] = []
    n_s = shape.num_sampled
    if n_s:
        lm = 2.0 * n_s * h * V / tp / mm_rate
        busy += lm
        then.append((True, _roofline(lm, h * V * d / tp / mem_rate, hw)))
        then.append((True, hw.sampler_us * _US + n_s * V * hw.sampler_bytes_per_logit / mem_rate))
    n_kernels = hw.kernels_per_layer * L
    if graph:
        then.append((True, (hw.cuda_graph_replay_us + n_kernels * hw.graph_kernel_us) * _US))
    elif pieces:
        # The CPU replays L + 1 pieces and launches each layer's attention between them.
        eager = piecewise_eager_kernels(shape, model, hw) * L
        then.append((True, ((L + 1) * hw.cuda_graph_replay_us
                            + (n_kernels + eager) * hw.graph_kernel_us) * _US))
        then.append((False, (L + 1 + eager) * hw.kernel_launch_us * _US))
    else:
        # Eager kernels are launched by the CPU while earlier ones run: the GPU waits only
        # when launching is the slower of the two (small prefills are launch-bound).
        if shape.is_mixed:  # both attention paths
            n_kernels += hw.mixed_kernels_per_layer * L
        n_kernels += split_merge_kernels(shape, model, hw) * L
        then.append((False, n_kernels * hw.kernel_launch_us * _US))
    if not shape.is_first:
        then.append((True, hw.advance_step_us * _US))
    if tp > 1:
        link = hw.link_bytes_per_s * hw.allreduce_efficiency
        lat = hw.allreduce_latency_us * _US
        then.append((True, (2 * L + 1) * (lat + 2.0 * (tp - 1) / tp * T * h * d / link)))
        if n_s:
            then.append((True, lat + (tp - 1) / tp * n_s * V * d / link))
    return t, busy, kv_bytes, bw * hw.attn_decode_efficiency, seq_rate, tuple(then)


def split_merge_kernels(shape: StepShape, model: ModelSpec, hw: HardwareSpec) -> float:
    """In an eager or piecewise step: the kernels each layer adds to merge the key splits of its
    decode attention, ``decode_split_kernels_per_layer`` when the decoding sequences split
    (``decode_splits`` > 1), else 0. (A CUDA-graph step launches none of its own.)"""
    if not hw.decode_split_kernels_per_layer or shape.num_tokens <= shape.num_prefill_tokens:
        return 0.0
    split = decode_attention_splits(shape, model, hw) > 1
    return hw.decode_split_kernels_per_layer if split else 0.0


def decode_attention_splits(shape: StepShape, model: ModelSpec, hw: HardwareSpec,
                            padded: int | None = None) -> int:
    """The key splits the engine's decode attention picks for the step (``decode_splits``) over
    the rows it sees: a decode CUDA graph's padded batch (``padded``), else the decoding
    sequences, one token each (a mixed step's prefill rows go to the prefill kernel)."""
    if padded is not None and shape.num_tokens == shape.num_seqs:
        rows = padded
    else:
        rows = max(shape.num_tokens - shape.num_prefill_tokens, 1)
    return decode_splits(rows, kv_heads_per_rank(model, hw.tp), hw.num_sms)


def piecewise_eager_kernels(shape: StepShape, model: ModelSpec, hw: HardwareSpec) -> float:
    """The eager kernels a piecewise step launches per layer between its graph pieces, as the
    engine does (real_backend/attention.py): the KV write, attention and the copy into the
    pieces' buffer; both attentions and their concatenation in a step with prefill and decode
    rows; and the merge of split decode attention."""
    return (hw.piecewise_eager_kernels_per_layer
            + (hw.piecewise_mixed_kernels_per_layer if shape.is_mixed else 0.0)
            + split_merge_kernels(shape, model, hw))


def stage_time(shape: StepShape, model: ModelSpec, hw: HardwareSpec, slow: float = 1.0) -> float:
    """Seconds one pipeline stage spends on the step; the step time itself when ``pp`` == 1."""
    t = step_time(shape, model, hw, slow)
    if hw.pp == 1 or t == 0.0:
        return t
    send = hw.p2p_latency_us * _US + 2.0 * shape.num_tokens * model.hidden_size * (
        model.dtype_bytes / hw.link_bytes_per_s)
    return t / hw.pp + send


def window_stage_times(shapes: Sequence[StepShape], model: ModelSpec, hw: HardwareSpec,
                       scale: float = 1.0) -> list[float]:
    """``stage_time`` of each of a window's steps at full clock, times ``scale``: the same
    numbers, with the terms of a run of decode steps of one batch size (a multi-step window's
    steps after the first) looked up once."""
    if hw.op_tables or hw.pp != 1:
        return [stage_time(s, model, hw) * scale for s in shapes]
    times = []
    prev = terms = None
    for s in shapes:
        if s.num_prefill_tokens or not s.num_seqs:
            times.append(step_cost(s, model, hw)[0] * scale)
            continue
        size = (s.num_tokens, s.num_seqs, s.num_sampled, s.is_first)
        if size != prev:
            terms, prev = _decode_terms(s, model, hw), size
        times.append(_with_context(s, terms)[0] * scale)
    return times


def window_gpu_times(batch: Batch, model: ModelSpec, hw: HardwareSpec) -> list[float]:
    """Per-stage seconds of each of the window's k steps (full step times when ``pp`` == 1)."""
    return window_stage_times(window_shapes(batch), model, hw)


class DraftKV:
    """How far each request's draft-model KV is computed, as the engine keeps it
    (real_backend/speculative.py): a request's draft KV is whole through its accepted tokens
    after a window in which it drafted, and nothing of it is valid after a preemption; the
    positions in between (its prompt, tokens decoded without drafting) are caught up by one
    draft forward when a window next drafts for it."""

    __slots__ = ("lengths",)

    def __init__(self) -> None:
        self.lengths: dict[int, tuple[int, int]] = {}  # request id -> (preemptions, valid)

    def catch_up(self, batch: Batch) -> list[tuple[int, int, bool]]:
        """The window's catch-up chunks, (tokens, cached tokens, samples) per drafting decode
        whose draft KV lacks positions before its newest token; records each one's draft KV as
        whole through the tokens the window accepts."""
        chunks = []
        lengths = self.lengths
        for s in batch.seqs:
            w = s.num_decode_tokens
            if w == 1 or s.is_prefill:
                continue
            req = s.request
            p = s.num_cached_tokens  # the newest token's position
            known = lengths.get(req.request_id)
            valid = known[1] if known is not None and known[0] == req.num_preemptions else 0
            if valid < p:
                chunks.append((p - valid, valid, False))
            acc = s.num_accepted
            grown = s.num_steps * w if acc is None else sum(acc) + s.num_steps
            lengths[req.request_id] = (req.num_preemptions, p + grown)
        return chunks

    def forget(self, finished: Sequence[Request]) -> None:
        """Drop finished requests."""
        lengths = self.lengths
        for req in finished:
            lengths.pop(req.request_id, None)


def window_draft_times(batch: Batch, draft_step: StepTimeFn, num_tokens: int,
                       draft_kv: DraftKV) -> list[float]:
    """Seconds the draft model (``draft_step``: its step time on this GPU) runs before each of
    the window's verify steps, as the engine runs it: before step 1, one prefill-like forward
    over the positions the drafting decodes' draft KV lacks (``DraftKV.catch_up``: a chunk per
    request over its cached context; no logits); before each step, ``num_tokens`` + 1
    one-token steps over the decodes drafting at it (``policies.speculation.draft_steps_time``).
    A window in which nothing drafts runs no draft at all. The verify step itself is the
    target's k + 1-token step (``window_shapes``)."""
    k = batch.num_steps
    # per step, per draft length k: [drafting decodes, their contexts summed, the longest]
    steps: list[dict[int, list[int]]] = [{} for _ in range(k)]
    for s in batch.seqs:
        w = s.num_decode_tokens
        if w == 1 or s.is_prefill:
            continue
        acc = s.num_accepted
        ctx = s.num_cached_tokens + 1
        for j in range(min(s.num_steps, k)):
            group = steps[j].get(w - 1)
            if group is None:
                steps[j][w - 1] = [1, ctx, ctx]
            else:
                group[0] += 1
                group[1] += ctx
                if ctx > group[2]:
                    group[2] = ctx
            ctx += w if acc is None else acc[j] + 1
    if not steps[0]:
        return [0.0] * k
    chunks = draft_kv.catch_up(batch)
    first = draft_step(0, 0, 0, chunks) if chunks else 0.0
    out = [draft_steps_time(draft_step, num_tokens, groups) if groups else 0.0
           for groups in steps]
    out[0] += first
    return out


def step_time_fn(model: ModelSpec, hw: HardwareSpec) -> StepTimeFn:
    """The policies' view of this cost model (``policies.base.StepTimeFn``): the first step of a
    window from its decodes and prefill chunks, the shape ``window_shapes`` would build."""

    def first_step_time(decodes: int, decode_kv: int, longest: int,
                        chunks: Sequence[tuple[int, int, bool]],
                        decode_tokens: int | None = None) -> float:
        tokens = pairs = prefill_kv = sampled = 0
        for q, c, samples in chunks:
            tokens += q
            pairs += q * (q + 1) // 2 + q * c
            prefill_kv += c + q
            sampled += samples
        # each decode computes and samples its tokens (one, unless said otherwise)
        d = decodes if decode_tokens is None else decode_tokens
        shape = StepShape(d + tokens, decodes + len(chunks), tokens, d + sampled,
                          float(pairs), decode_kv + prefill_kv, True, longest, len(chunks),
                          prefill_kv)
        return step_time(shape, model, hw)

    return first_step_time


def service_time_fn(model: ModelSpec, hw: HardwareSpec):
    """GPU seconds of requests served alone on an idle engine, from their prompt lengths and
    max tokens (arrays): the prompt in one prefill step, then one decode step per further token
    at batch 1 (priced at the middle context; a decode step's time is close to linear in its
    context). Slowdown's denominator."""
    first = step_time_fn(model, hw)

    def alone(prompt_len: np.ndarray, max_tokens: np.ndarray) -> np.ndarray:
        prefill = _priced(prompt_len, lambda p: first(0, 0, 0, [(p, 0, True)]))
        decode = _priced(prompt_len + max_tokens // 2, lambda m: first(1, m, m, ()))
        return prefill + (max_tokens - 1) * decode

    return alone


def _priced(values: np.ndarray, price: Callable[[int], float]) -> np.ndarray:
    """``price`` of each of these token counts (ints >= 0), each distinct one priced once: a
    step's price depends on the prompt or the context alone, and a run of 1M requests has a
    few thousand of each."""
    seen = np.flatnonzero(np.bincount(values))
    table = np.zeros(int(seen[-1]) + 1 if len(seen) else 0)
    table[seen] = [price(v) for v in seen.tolist()]
    return table[values]
