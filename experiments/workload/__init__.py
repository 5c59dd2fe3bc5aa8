"""Workloads: the requests of a run (RequestSpecs) from the ``workload`` config section.

A workload is a request source (``sharegpt``, ``synthetic``, ``trace``: lengths and, for the
real backend, prompt token ids) and an arrival process (``arrivals``; a trace brings its own
times). ``build_workload`` checks the section, refuses a run that would not fit in memory
(``footprint``) and puts the two together.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from experiments.workload.arrivals import ARRIVAL_KEYS, arrival_times, trace_arrival_times
from experiments.workload.classes import assign_classes, read_classes
from experiments.workload.footprint import check_run_fits
from experiments.workload.jsonstream import iter_json_array, read_record_at
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
from experiments.workload.spec import RequestSpec, to_request
from experiments.workload.synthetic import SYNTHETIC_KEYS, random_token_ids, synthetic_lengths
from experiments.workload.trace import TRACE_KEYS, TraceRequest, read_trace, read_trace_section
from experiments.workload.trace_formats import FORMATS as TRACE_FORMATS

__all__ = [
    "CACHE_FORMAT_VERSION", "DEFAULT_TOKENIZER", "KINDS", "MIN_SHAREGPT_LEN", "RequestSpec",
    "arrival_times", "build_workload", "bundled_sharegpt_path", "cache_dir", "iter_json_array",
    "load_tokenizer", "read_record_at", "read_trace", "sample_sharegpt",
    "sharegpt_prompt_token_ids", "sharegpt_token_counts", "synthetic_lengths", "to_request",
    "trace_arrival_times", "max_concurrency", "TraceRequest", "TRACE_FORMATS",
]

KINDS = ("sharegpt", "synthetic", "trace")

# Keys each kind reads; anything else in the section is a typo or a leftover and is refused,
# because a silently ignored knob gives a silently wrong experiment.
_COMMON_KEYS = frozenset({"kind", "num_prompts", "seed", "max_concurrency", "classes"})
_KEYS_BY_KIND = {
    "sharegpt": _COMMON_KEYS | ARRIVAL_KEYS | SHAREGPT_KEYS,
    "synthetic": _COMMON_KEYS | ARRIVAL_KEYS | SYNTHETIC_KEYS,
    "trace": _COMMON_KEYS | TRACE_KEYS,
}
# np.random.RandomState, which draws the arrival gaps as benchmark_serving does, takes 32 bits.
_MAX_SEED = 2**32 - 1


def max_concurrency(cfg: Mapping[str, Any]) -> int | None:
    """``workload.max_concurrency``: at most this many requests in flight (vLLM
    benchmark_serving's ``--max-concurrency`` semaphore: a request due while that many are
    unfinished waits for one to finish), or None for no limit."""
    if cfg.get("max_concurrency") is None:
        return None
    return get_int(cfg, "max_concurrency", None, 1)


def build_workload(cfg: Mapping[str, Any], *, vocab_size: int | None = None,
                   max_model_len: int | None = None) -> list[RequestSpec]:
    """The requests of a run from the ``workload`` config section, sorted by arrival time.

    With ``vocab_size`` every spec also carries prompt token ids below it (the real backend
    needs them): the tokenizer's ids for ShareGPT (folded modulo a smaller vocabulary), seeded
    random ids otherwise. With ``max_model_len`` a request that would not fit is an error.
    A workload whose run would not fit in memory is refused before it is drawn, and again
    once its lengths are known. The same cfg gives the same list every time.
    """
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
    with_ids = vocab_size is not None
    seed = get_int(cfg, "seed", 0, 0)
    max_concurrency(cfg)
    if seed > _MAX_SEED:
        raise ValueError(f"workload.seed must be <= {_MAX_SEED}, got {seed}")
    num_prompts = None if kind == "trace" and cfg.get("num_prompts") is None \
        else get_int(cfg, "num_prompts", 1000, 1)
    if num_prompts is not None:
        check_run_fits(num_prompts, None, None, with_token_ids=with_ids)

    classes = read_classes(cfg.get("classes"))
    sample = None
    hash_ids: list[tuple[int, ...] | None] | None = None
    named = where = None  # a trace's slo_class column
    if kind == "trace":
        trace = read_trace_section(cfg, num_prompts, with_token_ids=with_ids)
        arrivals = [r.arrival_time for r in trace]
        prompt_lens = [r.prompt_len for r in trace]
        output_lens = [r.output_len for r in trace]
        if any(r.hash_ids is not None for r in trace):
            hash_ids = [r.hash_ids for r in trace]
        if any(r.slo_class is not None for r in trace):
            if classes is None:
                first = next(r for r in trace if r.slo_class is not None)
                raise ValueError(f"{cfg.get('trace_path')}:{first.line}: the trace names SLO "
                                 "classes (slo_class) but workload.classes defines none")
            named = [r.slo_class for r in trace]
            where = [f"{cfg.get('trace_path')}:{r.line}" for r in trace]
        del trace
    else:
        assert num_prompts is not None
        rate = get_float(cfg, "request_rate", math.inf)
        if math.isnan(rate) or rate <= 0:
            raise ValueError(f"workload.request_rate must be > 0 (or inf), got {rate}")
        burstiness = get_float(cfg, "burstiness", 1.0)
        if not (burstiness > 0 and math.isfinite(burstiness)):
            raise ValueError(f"workload.burstiness must be > 0, got {burstiness}")
        if kind == "synthetic":
            p, o = synthetic_lengths(cfg.get("lengths"), num_prompts, seed)
            # Before the lengths become Python objects, the arrays being 8 bytes a request.
            check_run_fits(num_prompts, int(p.sum()), int(o.sum()), with_token_ids=with_ids)
            prompt_lens, output_lens = p.tolist(), o.tolist()
        else:
            sample = sample_sharegpt_section(cfg, num_prompts, seed)
            prompt_lens, output_lens = sample.prompt_lens, sample.output_lens
        arrivals = arrival_times(num_prompts, rate, burstiness, seed).tolist()
    check_run_fits(len(prompt_lens), sum(prompt_lens), sum(output_lens),
                   with_token_ids=with_ids,
                   hash_ids=0 if hash_ids is None else sum(len(h) for h in hash_ids if h))

    if max_model_len is not None:
        for i, (plen, olen) in enumerate(zip(prompt_lens, output_lens, strict=True)):
            if plen + olen > max_model_len:
                raise ValueError(
                    f"workload: request {i} needs prompt_len + output_len = {plen + olen} "
                    f"tokens > model.max_model_len = {max_model_len}")

    token_ids: list[tuple[int, ...]] | None = None
    if vocab_size is not None:
        token_ids = sample.prompt_token_ids(vocab_size) if sample is not None \
            else random_token_ids(prompt_lens, vocab_size, seed)
    slo = None if classes is None else assign_classes(classes, len(arrivals), seed, named, where)
    return [RequestSpec(float(a), int(p), int(o), None if token_ids is None else token_ids[i],
                        None if hash_ids is None else hash_ids[i],
                        None if slo is None else slo[i])
            for i, (a, p, o) in enumerate(zip(arrivals, prompt_lens, output_lens, strict=True))]
