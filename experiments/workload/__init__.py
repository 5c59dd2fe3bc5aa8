"""Workloads: the requests of a run (RequestSpecs) from the ``workload`` config section.

A workload is a request source (``sharegpt``, ``sharegpt_multiturn``, ``synthetic``,
``trace``: lengths, prompt segments and, for the real backend, prompt token ids) and an arrival
process (``arrivals``; a trace brings its own times). ``build_workload`` checks the section,
refuses a run that would not fit in memory (``footprint``), puts the two together and adds what
applies to every kind: a shared system prompt (``shared_prefix_len``) and the dropping of
requests longer than the model, or than every replica admits (``drop_too_long``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
from collections.abc import Mapping
from typing import Any

from common.checks import check_bool
from experiments.workload.arrivals import ARRIVAL_KEYS, arrival_times, trace_arrival_times
from experiments.workload.classes import assign_classes, check_shares, read_classes
from experiments.workload.footprint import check_run_fits
from experiments.workload.jsonstream import iter_json_array, read_record_at
from experiments.workload.multiturn import MULTITURN_KEYS, sample_conversations_section, think_time
from experiments.workload.settings import get_float, get_int
from experiments.workload.sharegpt import (
    CACHE_FORMAT_VERSION,
    DEFAULT_TOKENIZER,
    MIN_SHAREGPT_LEN,
    SHAREGPT_KEYS,
    bundled_sharegpt_path,
    cache_dir,
    load_tokenizer,
    sample_sharegpt,
    sample_sharegpt_section,
    sharegpt_prompt_token_ids,
    sharegpt_token_counts,
)
from experiments.workload.spec import RequestSpec, plain_requests, to_request
from experiments.workload.synthetic import (
    SYNTHETIC_KEYS,
    SYSTEM_PROMPT_KEY,
    random_token_ids,
    request_prompt_key,
    segment_token_ids,
    synthetic_lengths,
    system_prompt_ids,
)
from experiments.workload.trace import TRACE_KEYS, TraceRequest, read_trace, read_trace_section
from experiments.workload.trace_formats import FORMATS as TRACE_FORMATS
from policies.request import Request

__all__ = [
    "CACHE_FORMAT_VERSION", "DEFAULT_TOKENIZER", "KINDS", "MIN_SHAREGPT_LEN", "RequestSpec",
    "Workload", "arrival_times", "build_requests", "build_workload", "bundled_sharegpt_path",
    "cache_dir", "iter_json_array", "load_tokenizer", "read_record_at", "read_trace",
    "sample_sharegpt",
    "sharegpt_prompt_token_ids", "sharegpt_token_counts", "synthetic_lengths", "to_request",
    "trace_arrival_times", "max_concurrency", "TraceRequest", "TRACE_FORMATS",
]

KINDS = ("sharegpt", "synthetic", "trace", "sharegpt_multiturn")

# Keys each kind reads; anything else in the section is a typo or a leftover and is refused,
# because a silently ignored knob gives a silently wrong experiment.
_COMMON_KEYS = frozenset({"kind", "seed", "max_concurrency", "classes", "shared_prefix_len",
                          "drop_too_long", "acceptance"})
_KEYS_BY_KIND = {
    "sharegpt": _COMMON_KEYS | {"num_prompts"} | ARRIVAL_KEYS | SHAREGPT_KEYS,
    "sharegpt_multiturn": _COMMON_KEYS | ARRIVAL_KEYS | MULTITURN_KEYS,
    "synthetic": _COMMON_KEYS | {"num_prompts"} | ARRIVAL_KEYS | SYNTHETIC_KEYS,
    "trace": _COMMON_KEYS | {"num_prompts"} | TRACE_KEYS,
}
# np.random.RandomState, which draws the arrival gaps as benchmark_serving does, takes 32 bits.
_MAX_SEED = 2**32 - 1

log = logging.getLogger(__name__)


class Workload(list[RequestSpec]):
    """build_workload's requests, and ``num_dropped``: how many ``workload.drop_too_long``
    dropped for not fitting in ``model.max_model_len`` (0 when none were)."""

    num_dropped: int = 0


def max_concurrency(cfg: Mapping[str, Any]) -> int | None:
    """``workload.max_concurrency``: at most this many requests in flight (vLLM
    benchmark_serving's ``--max-concurrency`` semaphore: a request due while that many are
    unfinished waits for one to finish), or None for no limit."""
    if cfg.get("max_concurrency") is None:
        return None
    return get_int(cfg, "max_concurrency", None, 1)


def build_workload(cfg: Mapping[str, Any], *, vocab_size: int | None = None,
                   max_model_len: int | None = None, limit: str | None = None) -> Workload:
    """The requests of a run from the ``workload`` config section, sorted by arrival time (a
    conversation's turns in order: a later turn's previous_turn is an earlier index).

    With ``vocab_size`` every spec also carries prompt token ids below it (the real backend
    needs them): the tokenizer's ids for ShareGPT (folded modulo a smaller vocabulary), seeded
    random ids otherwise. With ``max_model_len`` a request that would not fit is an error, or
    with ``workload.drop_too_long`` is dropped (a conversation's later turns with it), the
    returned Workload's ``num_dropped`` counting them (``limit``: what sets max_model_len, for the
    messages; the model's by default). A workload whose run would not fit in
    memory is refused before it is drawn, and again once its lengths are known. The same cfg
    gives the same list every time.
    """
    return _draw(cfg, vocab_size, max_model_len, limit).specs()


def build_requests(cfg: Mapping[str, Any], *, vocab_size: int | None = None,
                   max_model_len: int | None = None,
                   limit: str | None = None) -> tuple[list[Request], int]:
    """The run's Requests, ``to_request`` of each of build_workload's specs (with their prompt
    token ids given ``vocab_size``), and how many ``workload.drop_too_long`` dropped. A
    workload of lengths and send times alone (no token ids, shared prefix, classes, turns or
    block hashes) becomes its Requests directly: a spec each would take longer to make than
    the requests themselves."""
    drawn = _draw(cfg, vocab_size, max_model_len, limit)
    with_ids = vocab_size is not None
    if drawn.plain():
        return plain_requests(drawn.arrivals, drawn.prompt_lens, drawn.output_lens), 0
    specs = drawn.specs()
    return ([to_request(spec, i, with_token_ids=with_ids) for i, spec in enumerate(specs)],
            specs.num_dropped)


@dataclasses.dataclass(slots=True)
class _Drawn:
    """A workload's columns as drawn and checked, before its requests are made."""

    arrivals: list[float]
    prompt_lens: list[int]
    output_lens: list[int]
    keep: list[bool] | None  # None: every request (drop_too_long dropped none)
    token_ids: list[tuple[int, ...]] | None
    system_ids: tuple[int, ...]
    prefix_len: int
    segments: list[tuple[tuple[int, int], ...] | None] | None
    hash_ids: list[tuple[int, ...] | None] | None
    slo: list[Any] | None
    conversations: list[int] | None
    previous: list[int | None] | None
    think: float
    multiturn: bool
    limit: str  # what sets the longest request kept (model.max_model_len = N)

    def plain(self) -> bool:
        """Lengths and send times alone, each as a RequestSpec holds it (ints >= 1, floats
        >= 0)."""
        return (self.keep is None and self.token_ids is None and not self.prefix_len
                and self.segments is None and self.hash_ids is None and self.slo is None
                and self.conversations is None and self.previous is None
                and all(type(x) is int and x >= 1
                        for x in {*self.prompt_lens, *self.output_lens})
                and all(type(a) is float and a >= 0 for a in set(self.arrivals)))

    def specs(self) -> Workload:
        """The RequestSpecs, those drop_too_long keeps (their previous turns renumbered)."""
        arrivals, prompt_lens, output_lens = self.arrivals, self.prompt_lens, self.output_lens
        keep, token_ids, segments, prefix_len = self.keep, self.token_ids, self.segments, \
            self.prefix_len
        system_ids, hash_ids, slo, conversations = self.system_ids, self.hash_ids, self.slo, \
            self.conversations
        previous, think = self.previous, self.think
        n = len(prompt_lens)
        out = Workload()
        system = (SYSTEM_PROMPT_KEY, prefix_len)
        index = [-1] * n if previous is not None else None  # a kept request's index in ``out``
        for i in range(n):
            if keep is not None and not keep[i]:
                continue
            prompt_len = prompt_lens[i]
            ids = None if token_ids is None else token_ids[i]
            seg = None if segments is None else segments[i]
            if prefix_len:
                seg = (system, *(seg or ((request_prompt_key(i), prompt_len),)))
                prompt_len += prefix_len
                ids = None if ids is None else system_ids + ids
            prev = None
            if previous is not None and index is not None:
                index[i] = len(out)
                prev = None if previous[i] is None else index[previous[i]]
            out.append(RequestSpec(
                float(arrivals[i]), int(prompt_len), int(output_lens[i]), ids,
                None if hash_ids is None else hash_ids[i], None if slo is None else slo[i],
                segments=seg,
                conversation_id=None if conversations is None else conversations[i],
                previous_turn=prev, think_time=think if prev is not None else 0.0))
        out.num_dropped = n - len(out)
        if out.num_dropped:
            turns = " (with the later turns of their conversations)" if self.multiturn else ""
            log.warning("workload.drop_too_long: dropped %d of %d requests whose prompt_len + "
                        "output_len exceeds %s%s", out.num_dropped, n, self.limit, turns)
        return out


@dataclasses.dataclass
class _Source:
    """What a workload's kind gives before the requests are made: each request's send time and
    lengths, and as the kind has them its text (``sample``: the sharegpt kinds), block hashes
    and segments, conversation, earlier turn and think time, and a trace's SLO class names
    (``named``, with ``where`` each is for the messages)."""

    arrivals: list[float]
    prompt_lens: list[int]
    output_lens: list[int]
    sample: Any = None
    hash_ids: list[tuple[int, ...] | None] | None = None
    segments: list[tuple[tuple[int, int], ...] | None] | None = None
    conversations: list[int] | None = None
    previous: list[int | None] | None = None
    think: float = 0.0
    named: list[str | None] | None = None
    where: list[str] | None = None


def _draw(cfg: Mapping[str, Any], vocab_size: int | None, max_model_len: int | None,
          limit: str | None) -> _Drawn:
    """build_workload's columns: the section checked, the requests drawn."""
    kind = _check_kind(cfg, vocab_size)
    with_ids = vocab_size is not None
    seed = get_int(cfg, "seed", 0, 0)
    max_concurrency(cfg)
    if seed > _MAX_SEED:
        raise ValueError(f"workload.seed must be <= {_MAX_SEED}, got {seed}")
    prefix_len = get_int(cfg, "shared_prefix_len", 0, 0)
    drop = check_bool("workload.drop_too_long", cfg.get("drop_too_long", False))
    multiturn = kind == "sharegpt_multiturn"
    count_setting = "num_conversations" if multiturn else "num_prompts"
    if multiturn:
        num_prompts: int | None = get_int(cfg, "num_conversations", 100, 1)
    else:
        num_prompts = None if kind == "trace" and cfg.get("num_prompts") is None \
            else get_int(cfg, "num_prompts", 1000, 1)
    if num_prompts is not None:
        check_run_fits(num_prompts, None, None, with_token_ids=with_ids, setting=count_setting)

    classes = read_classes(cfg.get("classes"))
    if classes is not None and kind != "trace":  # drawn by share: refused before the draw
        check_shares(classes)
    if kind == "trace":
        src = _from_trace(cfg, num_prompts, with_ids, classes is not None)
    else:
        assert num_prompts is not None
        src = _generated(cfg, kind, num_prompts, seed, prefix_len, with_ids)
    n = len(src.prompt_lens)
    # a few thousand distinct lengths: one int object each, held by every request of that
    # length (far less memory in a long run than an object a request)
    prompt_lens, output_lens = _one_object_per_value(src.prompt_lens), \
        _one_object_per_value(src.output_lens)
    hash_ids, segments = src.hash_ids, src.segments
    # a trace's segments are counted with its hash ids; the system prompt adds two a request
    check_run_fits(n, sum(prompt_lens) + n * prefix_len, sum(output_lens),
                   with_token_ids=with_ids,
                   hash_ids=0 if hash_ids is None else sum(len(h) for h in hash_ids if h),
                   segments=(0 if segments is None or hash_ids is not None
                             else sum(len(s) for s in segments if s)) + 2 * n * bool(prefix_len),
                   setting=count_setting)

    limit = limit or f"model.max_model_len = {max_model_len}"
    keep = None if max_model_len is None else \
        _fitting(prompt_lens, output_lens, prefix_len, max_model_len, src.previous, drop, limit)

    token_ids: list[tuple[int, ...]] | None = None
    if vocab_size is not None:
        if src.sample is not None:  # ShareGPT: the tokenizer's ids
            token_ids = src.sample.prompt_token_ids(vocab_size)
        elif segments is not None:  # a trace's block hashes: equal hashes, equal tokens
            token_ids = segment_token_ids(segments, vocab_size)
        else:
            token_ids = random_token_ids(prompt_lens, vocab_size, seed)
    slo = None if classes is None else assign_classes(classes, n, seed, src.named, src.where)
    system_ids = () if vocab_size is None else system_prompt_ids(prefix_len, vocab_size, seed)
    return _Drawn(src.arrivals, prompt_lens, output_lens, keep, token_ids, system_ids,
                  prefix_len, segments, hash_ids, slo, src.conversations, src.previous,
                  src.think, multiturn, limit)


def _check_kind(cfg: Mapping[str, Any], vocab_size: int | None) -> str:
    """The section's kind, its settings those of that kind, and the vocabulary's size >= 1."""
    if not isinstance(cfg, Mapping):
        raise ValueError(f"workload config must be a mapping, got {type(cfg).__name__}")
    kind = cfg.get("kind")
    if kind not in KINDS:
        raise ValueError(f"workload.kind must be one of {', '.join(KINDS)}, got {kind!r}")
    unknown = sorted(set(cfg) - _KEYS_BY_KIND[kind])
    if unknown:
        raise ValueError(f"workload.{unknown[0]} is not a setting of kind={kind} "
                         f"(settings: {', '.join(sorted(_KEYS_BY_KIND[kind]))})")
    if vocab_size is not None and (isinstance(vocab_size, bool) or vocab_size < 1):
        raise ValueError(f"model.vocab_size must be >= 1, got {vocab_size}")
    return kind


def _from_trace(cfg: Mapping[str, Any], num_prompts: int | None, with_ids: bool,
                has_classes: bool) -> _Source:
    """A trace's requests as its file gives them (its first ``num_prompts``, None: all)."""
    trace = read_trace_section(cfg, num_prompts, with_token_ids=with_ids)
    src = _Source([r.arrival_time for r in trace], [r.prompt_len for r in trace],
                  [r.output_len for r in trace])
    if any(r.hash_ids is not None for r in trace):
        src.hash_ids = [r.hash_ids for r in trace]
    if any(r.segments is not None for r in trace):
        src.segments = [r.segments for r in trace]
    if any(r.slo_class is not None for r in trace):
        if not has_classes:
            first = next(r for r in trace if r.slo_class is not None)
            raise ValueError(f"{cfg.get('trace_path')}:{first.line}: the trace names SLO "
                             "classes (slo_class) but workload.classes defines none")
        src.named = [r.slo_class for r in trace]
        src.where = [f"{cfg.get('trace_path')}:{r.line}" for r in trace]
    return src


def _generated(cfg: Mapping[str, Any], kind: str, num_prompts: int, seed: int,
               prefix_len: int, with_ids: bool) -> _Source:
    """A synthetic or ShareGPT workload's requests: lengths drawn or sampled, sent at
    request_rate with the burstiness given (a conversation's later turns after its think
    time)."""
    rate = get_float(cfg, "request_rate", math.inf)
    if math.isnan(rate) or rate <= 0:
        raise ValueError(f"workload.request_rate must be > 0 (or inf), got {rate}")
    burstiness = get_float(cfg, "burstiness", 1.0)
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"workload.burstiness must be > 0, got {burstiness}")
    src = _Source([], [], [])
    if kind == "synthetic":
        p, o = synthetic_lengths(cfg.get("lengths"), num_prompts, seed)
        # Before the lengths become Python objects, the arrays being 8 bytes a request.
        check_run_fits(num_prompts, int(p.sum()) + num_prompts * prefix_len, int(o.sum()),
                       with_token_ids=with_ids, segments=2 * num_prompts * bool(prefix_len))
        src.prompt_lens, src.output_lens = p.tolist(), o.tolist()
    elif kind == "sharegpt":
        src.sample = sample = sample_sharegpt_section(cfg, num_prompts, seed)
        src.prompt_lens, src.output_lens = sample.prompt_lens, sample.output_lens
    else:
        src.think = think_time(cfg)
        src.sample = sample = sample_conversations_section(cfg, num_prompts, seed)
        src.prompt_lens, src.output_lens = sample.prompt_lens, sample.output_lens
        src.segments, src.conversations = sample.segments, sample.conversation_ids
        src.previous = sample.previous_turns
    # a conversation's start for each of its turns; a request's send time otherwise
    # (all at t = 0: one float object, not one a request)
    src.arrivals = ([0.0] * num_prompts if math.isinf(rate)
                    else arrival_times(num_prompts, rate, burstiness, seed).tolist())
    if kind == "sharegpt_multiturn":
        src.sample.check_waits(src.arrivals, src.think)
        src.arrivals = src.sample.arrival_times(src.arrivals)
    return src


def _fitting(prompt_lens: list[int], output_lens: list[int], prefix_len: int,
             max_model_len: int, previous: list[int | None] | None, drop: bool,
             limit: str | None = None) -> list[bool] | None:
    """Which requests fit in ``max_model_len`` (None: all of them; ``limit``: what sets it,
    for the messages, the model's by default). One that does not is an error, unless ``drop``:
    then it is dropped, and so is every later turn of its conversation."""
    if limit is None:
        limit = f"model.max_model_len = {max_model_len}"
    if len(prompt_lens) == len(output_lens) and max(map(operator.add, prompt_lens, output_lens),
                                                    default=0) + prefix_len <= max_model_len:
        return None  # (every one fits: found in one pass in C)
    keep = None
    for i, (plen, olen) in enumerate(zip(prompt_lens, output_lens, strict=True)):
        if plen + prefix_len + olen > max_model_len:
            if not drop:
                raise ValueError(
                    f"workload: request {i} needs prompt_len + output_len = "
                    f"{plen + prefix_len + olen} tokens > {limit} "
                    f"(workload.drop_too_long=true drops such requests)")
            if keep is None:
                keep = [True] * len(prompt_lens)
            keep[i] = False
    if keep is not None and previous is not None:
        for i, prev in enumerate(previous):  # a turn's previous turn comes before it
            if prev is not None and not keep[prev]:
                keep[i] = False
    if keep is not None and not any(keep):
        raise ValueError(f"workload.drop_too_long: every request needs more tokens than "
                         f"{limit}")
    return keep


def _one_object_per_value(values: list[int]) -> list[int]:
    """``values`` with equal numbers the same object."""
    seen: dict[int, int] = {}
    return list(map(seen.setdefault, values, values))
