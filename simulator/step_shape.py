"""What one forward step computes (``StepShape``), from a window's composition, and the padded
sizes it runs at (the CUDA-graph or piecewise-graph token count): the features both GPU cost
models price (cost_model.py's rooflines, op_cost.py's operator tables)."""

from __future__ import annotations

from dataclasses import dataclass

from common.step_sizes import (
    decode_graph_size,
    piecewise_graph_size,
    prefill_graph_key,
)
from policies.batch import Batch
from policies.decode_group import DecodeWindow
from simulator.hardware import HardwareSpec


@dataclass(slots=True)
class StepShape:
    """What one forward step computes, summed over the batch: the cost model's features."""

    num_tokens: int  # query tokens: prefill chunks plus each decoding sequence's tokens
    num_seqs: int  # sequences taking part
    num_prefill_tokens: int
    num_sampled: int  # tokens sampled (rows of the LM head): a decode's each, a last chunk's one
    attn_pairs: float  # sum over prefill chunks of q (q + 1) / 2 + q c
    kv_tokens: int  # KV-cache tokens the step's attention touches
    is_first: bool  # step 1 of its window (later steps follow an advance_step)
    max_kv_tokens: int = 0  # the longest decoding sequence's context (0: not known)
    num_prefill_seqs: int = 0  # sequences with a prefill chunk (0 with prefill tokens: not known)
    prefill_kv_tokens: int = 0  # of kv_tokens, those of the prefill chunks (c + q each)

    @property
    def is_mixed(self) -> bool:
        """Prefill and decode rows both: the step runs both attention kernels."""
        return 0 < self.num_prefill_tokens < self.num_tokens


def window_shapes(batch: Batch, ending: list[int] | None = None,
                  surplus: list[int] | None = None) -> list[StepShape]:
    """The shape of every step of ``batch``: one pass over the sequences, then O(k).
    ``ending`` (k + 1 zeros, for a window of k > 1 steps), in the same pass: how many sampling
    sequences take their last token at each step, ``ending[m]`` those that take m (their steps
    capped by the steps their owed tokens take; the simulator's deliveries per step). Each
    sequence computes ``num_query_tokens`` in step 1 and ``num_decode_tokens`` a step after.
    ``surplus`` (an empty list), filled with k + 1 counts where a sequence emits several tokens
    a step (left empty otherwise, at no cost to the common window): the tokens beyond one such
    sequences emit at step j (``surplus[j]``, j < k; capped by the tokens each owes, or its
    placeholders under overlap), and step 1's sampled rows beyond one a sampling sequence
    (``surplus[k]``): the simulator's deliveries count tokens, its SSE chunks sequences."""
    k = batch.num_steps
    if batch.decodes is not None:
        return _group_shapes(batch.decodes, k, ending)
    seqs = batch.seqs
    leaving = [0] * (k + 1)  # leaving[m]: sequences taking part in exactly m steps
    leaving_ctx = [0] * (k + 1)  # their tokens in the cache after step 1 (c + q)
    leaving_max = [0] * (k + 1)  # the longest of them
    tokens = prefill_tokens = sampled = kv = pairs = longest = prefill_seqs = prefill_kv = 0
    wide = False  # a sequence decodes more than one token a step
    for s in seqs:
        q = s.num_query_tokens
        c = s.num_cached_tokens
        cq = c + q
        tokens += q
        kv += cq
        if s.is_prefill:
            prefill_tokens += q
            prefill_seqs += 1
            prefill_kv += cq
            pairs += q * (q + 1) // 2 + q * c
        elif cq > longest:
            longest = cq
        if k > 1:
            m = s.num_steps if s.num_steps <= k else k
            leaving[m] += 1
            leaving_ctx[m] += cq
            if cq > leaving_max[m]:
                leaving_max[m] = cq
        w = s.num_decode_tokens
        if w != 1:
            wide = True
            if surplus is not None and s.num_sampled_tokens:
                if not surplus:
                    surplus += [0] * (k + 1)
                req = s.request
                owed = s.num_placeholders or req.max_tokens - req.num_output_tokens
                for j, n in enumerate(s.step_tokens(owed)[:k]):
                    surplus[j] += n - 1
                surplus[k] += s.num_sampled_tokens - 1
        if s.num_sampled_tokens:  # the chunk completes the sequence, or a decode
            sampled += s.num_sampled_tokens
            if ending is not None:
                req = s.request
                owed = req.max_tokens - req.num_output_tokens  # tokens; one a step if w is 1
                if w != 1:
                    owed = s.steps_for(owed)
                ending[m if m <= owed else owed] += 1
    shapes = [StepShape(tokens, len(seqs), prefill_tokens, sampled, float(pairs), kv, True,
                        longest, prefill_seqs, prefill_kv)]
    if k == 1:
        return shapes
    if wide:
        return shapes + _later_steps(seqs, k)
    for m in range(k - 1, -1, -1):  # leaving_max[m]: the longest sequence taking >= m steps
        leaving_max[m] = max(leaving_max[m], leaving_max[m + 1])
    # Step j (0-based, j >= 1): the sequences with more than j steps each decode one token
    # over a context of c + q + j, so the step's KV tokens are sum(c + q) + j * alive.
    alive = len(seqs) - leaving[1] - leaving[0]
    alive_ctx = kv - leaving_ctx[1] - leaving_ctx[0]
    for j in range(1, k):
        shapes.append(StepShape(alive, alive, 0, alive, 0.0, alive_ctx + j * alive, False,
                                leaving_max[j + 1] + j if alive else 0))
        alive -= leaving[j + 1]
        alive_ctx -= leaving_ctx[j + 1]
    return shapes


def _later_steps(seqs: list, k: int) -> list[StepShape]:
    """Steps 2..k of a window whose sequences decode ``num_decode_tokens`` tokens a step
    (several for some): each sequence with more than j steps computes its tokens over a
    context of c + q + the tokens its steps before kept (j times its tokens a step, or its
    accepted draft tokens plus one a step where speculation drew them)."""
    shapes = []
    for j in range(1, k):
        tokens = kv = longest = n = 0
        for s in seqs:
            if s.num_steps > j:
                w = s.num_decode_tokens
                acc = s.num_accepted  # a speculative decode grows by its accepted tokens + 1
                ctx = s.num_cached_tokens + s.num_query_tokens + (
                    j * w if acc is None else sum(acc[:j]) + j)
                n += 1
                tokens += w
                kv += ctx
                if ctx > longest:
                    longest = ctx
        shapes.append(StepShape(tokens, n, 0, tokens, 0.0, kv, False, longest))
    return shapes


def _group_shapes(win: DecodeWindow, k: int, ending: list[int] | None) -> list[StepShape]:
    """window_shapes of a decode group's window: n members, each in all k steps at one token a
    step (so step j's context is step 1's plus j a member); only the finishing ones end early."""
    n, kv, longest = win.num_seqs, win.kv_tokens, win.max_kv_tokens
    if ending is not None:
        owed = win.owed()
        ending[k] += n - len(owed)
        for m in owed:
            ending[m] += 1
    return [StepShape(n, n, 0, n, 0.0, kv + j * n, j == 0, longest + j) for j in range(k)]


def graph_tokens(shape: StepShape, hw: HardwareSpec) -> int | None:
    """The padded token count of the whole-step CUDA graph the step replays, or None: steps of
    one token a row up to ``cuda_graph_max_batch`` rows, and prefill-only steps of at most 8
    prompts up to ``prefill_graph_max_tokens`` tokens (``common.step_sizes``, the engine's
    sizes). ``cuda_graph_max_batch`` 0 turns every graph off, as the engine's setting does."""
    if shape.num_seqs == 0 or hw.cuda_graph_max_batch == 0:
        return None
    if shape.num_tokens == shape.num_seqs:  # one token a row (1-token prefill chunks too): decode
        return decode_graph_size(shape.num_tokens) if shape.num_seqs <= hw.cuda_graph_max_batch \
            else None
    if shape.num_prefill_tokens < shape.num_tokens:  # mixed prefill + decode: eager
        return None
    key = prefill_graph_key(shape.num_tokens, shape.num_seqs, hw.prefill_graph_max_tokens)
    return key[0] if key else None


def piecewise_tokens(shape: StepShape, hw: HardwareSpec) -> int | None:
    """The padded token count of the piecewise graphs a step replays (one that no whole-step
    graph covers, up to ``piecewise_graph_max_tokens`` tokens), or None: it runs eagerly."""
    if (shape.num_seqs == 0 or hw.cuda_graph_max_batch == 0 or graph_tokens(shape, hw)
            or shape.num_tokens == shape.num_seqs):  # decode steps above the graphs: eager
        return None
    return piecewise_graph_size(shape.num_tokens, hw.piecewise_graph_max_tokens)
