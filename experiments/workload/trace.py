"""Trace replay: a trace file's requests in arrival order, filtered, cut and time-scaled."""

from __future__ import annotations

import heapq
import logging
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from experiments.workload import footprint
from experiments.workload.arrivals import trace_arrival_times
from experiments.workload.settings import get_float, get_path
from experiments.workload.synthetic import content_key, request_prompt_key
from experiments.workload.trace_formats import FORMATS, RowCounts, RowFilter, TraceRow

# The settings kind=trace reads besides the common ones.
TRACE_KEYS = frozenset({"trace_path", "format", "time_scale", "model_filter", "log_type",
                        "keep_failed"})
# Settings that only some formats have: set for another format, they would be ignored.
_FORMAT_SETTINGS = {"model_filter": ("burstgpt",), "log_type": ("burstgpt",),
                    "keep_failed": ("azure", "burstgpt")}

NO_FILTER = RowFilter()

log = logging.getLogger(__name__)


class TraceRequest(NamedTuple):
    """A request of a trace: seconds after the first arrival (scaled), lengths, block hashes and
    the prompt segments made of them."""

    arrival_time: float
    prompt_len: int
    output_len: int
    hash_ids: tuple[int, ...] | None = None
    slo_class: str | None = None
    line: int = 0
    segments: tuple[tuple[int, int], ...] | None = None


def read_trace(path: str | os.PathLike[str], *, format: str = "csv",
               num_prompts: int | None = None, time_scale: float = 1.0,
               row_filter: RowFilter = NO_FILTER, max_bytes: int | None = None,
               with_token_ids: bool = False) -> list[TraceRequest]:
    """The requests of a trace file sorted by arrival time (ties in file order), the times in
    seconds after the first arrival times ``time_scale`` (trace_arrival_times).

    ``num_prompts``: only the first that many by arrival time, the file streamed and no more
    rows held. Without it, a file whose rows and their run (footprint.trace_row_bytes, prompt
    token ids counted ``with_token_ids``) would take more than ``max_bytes`` is refused at
    the first row past it, not after the whole file is read. A row with block hashes, in a
    format that says their block size, gets the prompt segments made of them
    (hash_id_segments).
    """
    path_s = os.fspath(path)
    fmt = FORMATS[format]
    counts = RowCounts()
    rows = fmt.read(path_s, row_filter, counts)
    kept = _all(rows, path_s, max_bytes, with_token_ids) if num_prompts is None \
        else _earliest(rows, num_prompts)
    if not kept:
        raise _nothing_left(path_s, format, row_filter, counts)
    dropped = [f"{n} {what}" for n, what in (
        (counts.failed, "failed (no output tokens; workload.keep_failed=true keeps them)"),
        (counts.filtered, "of other models or log types")) if n]
    if dropped:
        log.info("%s: %d of its %d requests pass the filters; dropped: %s", path_s,
                 counts.rows - counts.failed - counts.filtered, counts.rows, ", ".join(dropped))
    times = trace_arrival_times([r.time for r in kept], [r.line for r in kept], path_s,
                                column=fmt.time_column, unit=fmt.unit, time_scale=time_scale)
    # In place: a large trace is not held twice.
    out: list[Any] = kept
    pairs: dict[int, tuple[int, int]] = {}  # requests that share a block share its segment
    for i, (t, r) in enumerate(zip(times, kept, strict=True)):
        segments = None if r.hash_ids is None or fmt.block_size is None else \
            hash_id_segments(r.hash_ids, r.prompt_len, fmt.block_size, i, pairs)
        out[i] = TraceRequest(t, r.prompt_len, r.output_len, r.hash_ids, r.slo_class, r.line,
                              segments)
    return out


def hash_id_segments(hash_ids: tuple[int, ...], prompt_len: int, block_size: int, index: int,
                     pairs: dict[int, tuple[int, int]] | None = None
                     ) -> tuple[tuple[int, int], ...]:
    """A prompt's segments from its block hashes: each hash id is a ``block_size``-token block
    (the last one the rest of ``prompt_len``). Ids past the prompt's blocks go unused; with
    fewer ids than blocks the rest of the prompt is one segment of the ``index``-th request's
    own. ``pairs`` keeps each full block's segment, shared by every request that has it."""
    blocks = -(-prompt_len // block_size)
    segments = []
    for j, h in enumerate(hash_ids[:blocks]):
        tokens = min(block_size, prompt_len - j * block_size)
        pair = None if pairs is None or tokens < block_size else pairs.get(h)
        if pair is None:
            pair = (content_key("trace block", h), tokens)
            if pairs is not None and tokens == block_size:
                pairs[h] = pair
        segments.append(pair)
    covered = min(len(hash_ids) * block_size, prompt_len)
    if covered < prompt_len:
        segments.append((request_prompt_key(index), prompt_len - covered))
    return tuple(segments)


def _all(rows: Iterable[TraceRow], path: str, budget: int | None, with_token_ids: bool
         ) -> list[TraceRow]:
    kept: list[TraceRow] = []
    held = 0
    for r in rows:
        held += footprint.trace_row_bytes(r.prompt_len, r.output_len, len(r.hash_ids or ()),
                                with_token_ids=with_token_ids)
        if budget is not None and held > budget:
            raise ValueError(f"{path}:{r.line}: the trace has more than {len(kept)} requests, "
                             f"the most whose replay fits in the memory available")
        kept.append(r)
    kept.sort(key=lambda r: r.time)  # stable: ties keep file order
    return kept


def _earliest(rows: Iterable[TraceRow], n: int) -> list[TraceRow]:
    """The ``n`` earliest rows, ties in file order, holding no more than ``n`` at a time."""
    heap: list[tuple[float, int, TraceRow]] = []  # (-time, -position): the latest on top
    for i, r in enumerate(rows):
        if len(heap) < n:
            heapq.heappush(heap, (-r.time, -i, r))
        elif r.time < -heap[0][0]:  # a tie loses: it comes later in the file
            heapq.heapreplace(heap, (-r.time, -i, r))
    heap.sort(reverse=True)
    return [r for _, _, r in heap]


def _nothing_left(path: str, fmt: str, flt: RowFilter, counts: RowCounts) -> ValueError:
    if counts.rows == 0:
        what = "no JSON lines" if fmt in ("mooncake", "timed_trace") else \
            "a header but no requests"
        return ValueError(f"{path}: trace has {what}")
    for setting, wanted, seen in (("model_filter", flt.models, counts.models),
                                  ("log_type", flt.log_types, counts.log_types)):
        if wanted is not None and not wanted & seen:
            return ValueError(f"workload.{setting}: no request of {path} has "
                              f"{' or '.join(map(repr, sorted(wanted)))}; it has "
                              f"{', '.join(map(repr, sorted(seen)))}")
    return ValueError(f"{path}: none of its {counts.rows} requests is left: {counts.filtered} "
                      f"of other models or log types, {counts.failed} failed (no output "
                      f"tokens; workload.keep_failed=true keeps them)")


def read_trace_section(cfg: Mapping[str, Any], num_prompts: int | None, *,
                       with_token_ids: bool = False) -> list[TraceRequest]:
    """The requests of a kind=trace ``workload`` section, its settings checked; a trace whose
    run would not fit in memory is refused while it is read."""
    path = get_path(cfg, "trace_path")
    if path is None:
        raise ValueError("workload.trace_path must be set to a trace file")
    fmt = cfg.get("format", "csv")
    if fmt not in FORMATS:
        raise ValueError(f"workload.format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    time_scale = get_float(cfg, "time_scale", 1.0)
    if not (time_scale > 0 and math.isfinite(time_scale)):
        raise ValueError(f"workload.time_scale must be a number > 0 (2: arrivals twice as far "
                         f"apart), got {time_scale!r}")
    keep_failed = cfg.get("keep_failed", False)
    if not isinstance(keep_failed, bool):
        raise ValueError(f"workload.keep_failed must be true or false, got {keep_failed!r}")
    for key, formats in _FORMAT_SETTINGS.items():
        if cfg.get(key) not in (None, False) and fmt not in formats:
            raise ValueError(f"workload.{key} applies to workload.format="
                             f"{' or '.join(formats)} only, not {fmt}")
    row_filter = RowFilter(_names(cfg, "model_filter"), _names(cfg, "log_type"), keep_failed)
    requests = read_trace(path, format=fmt, num_prompts=num_prompts, time_scale=time_scale,
                          row_filter=row_filter, max_bytes=footprint.available_memory(),
                          with_token_ids=with_token_ids)
    if num_prompts is not None and len(requests) < num_prompts:
        filtered = " that pass the filters" if row_filter != NO_FILTER else ""
        raise ValueError(f"workload.num_prompts = {num_prompts}, but {path} has only "
                         f"{len(requests)} requests{filtered}")
    return requests


def _names(cfg: Mapping[str, Any], key: str) -> frozenset[str] | None:
    """A filter setting: null (no filter), a name, or a list of names."""
    v = cfg.get(key)
    if v is None:
        return None
    names = [v] if isinstance(v, str) else v
    if not isinstance(names, (list, tuple)) or not names or \
            not all(isinstance(n, str) and n.strip() for n in names):
        raise ValueError(f"workload.{key} must be null, a name or a list of names, got {v!r}")
    return frozenset(n.strip() for n in names)
