"""A run's result files: result.json (vLLM's ``--save-result`` format plus schedlab's section),
requests.csv, steps.csv and summary.txt, written as one unit; a run's per-request lists and rows
are written a chunk at a time, never held as one text or as lists of every value."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import enum
import functools
import io
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from experiments.files import atomic_path, write_text_atomic
from experiments.request_times import TimesTable, chunk_bounds, times_for
from policies.request import Request

REQUEST_CSV_COLUMNS = ("request_id", "arrival_time", "prompt_len", "output_len",
                       "first_scheduled_time", "ttft", "e2el", "tpot", "num_chunks",
                       "num_preemptions", "finish_time", "replica", "num_cached_tokens")


def _jsonable(x: Any) -> Any:
    """A JSON-safe copy: numpy scalars to Python, paths to str, inf/nan to "inf"/"nan"
    (benchmark_serving writes request_rate inf as "inf"; bare Infinity is not JSON)."""
    if isinstance(x, float | np.floating):
        x = float(x)
        return x if math.isfinite(x) else ("nan" if math.isnan(x) else ("inf" if x > 0 else "-inf"))
    if isinstance(x, bool | np.bool_):
        return bool(x)
    if isinstance(x, int | np.integer):
        return int(x)
    if x is None or isinstance(x, str):
        return x
    if isinstance(x, enum.Enum):
        return _jsonable(x.value)
    if isinstance(x, os.PathLike):
        return os.fspath(x)
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _jsonable(dataclasses.asdict(x))
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, Sequence | set | frozenset):
        return [_jsonable(v) for v in x]
    raise ValueError(f"result value {x!r} of type {type(x).__name__} cannot be written as JSON")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not supported everywhere; the renames are already atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _csv_text(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(rows)
    return buf.getvalue()


def _cell(x: Any) -> Any:
    return "" if x is None else x


class PerRequest(Sequence):
    """One of result.json's per-request lists, made a chunk of requests at a time from the run's
    columns (``chunk(start, end)``: the JSON-ready values of requests start..end-1), so that a
    1M-request run's lists never exist whole: result.json gets them streamed."""

    def __init__(self, n: int, chunk: Callable[[int, int], list[Any]]) -> None:
        self._n, self._chunk = n, chunk  # chunk: picklable (a run's result may be pickled)

    @classmethod
    def of(cls, column: np.ndarray) -> PerRequest:
        """The list of one column's values."""
        return cls(len(column), functools.partial(_column_values, column))

    @classmethod
    def itls(cls, times: TimesTable) -> PerRequest:
        """Each request's ITLs, a list a request."""
        return cls(len(times), functools.partial(_itl_values, times))

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        if not -self._n <= i < self._n:
            raise IndexError(i)
        i %= self._n
        return self._chunk(i, i + 1)[0]

    def __iter__(self) -> Iterator[Any]:
        for values in self.chunks():
            yield from values

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, list | PerRequest):
            return NotImplemented
        return list(self) == list(other)

    def chunks(self) -> Iterator[list[Any]]:
        """The values, a chunk of requests at a time (request_times.chunk_bounds)."""
        for start, end in chunk_bounds(self._n):
            yield self._chunk(start, end)

    def write_json(self, f: IO[str]) -> None:
        """``json.dumps(list(self))``, a chunk at a time."""
        f.write("[")
        sep = ""
        for values in self.chunks():
            if values:
                f.write(sep + json.dumps(values, allow_nan=False)[1:-1])
                sep = ", "
        f.write("]")


def _column_values(column: np.ndarray, start: int, end: int) -> list[Any]:
    """column[start:end] as JSON-ready values (a non-finite one as _jsonable writes it)."""
    part = column[start:end]
    values = part.tolist()
    return _jsonable(values) if part.dtype.kind == "f" and not np.isfinite(part).all() else values


def _itl_values(times: TimesTable, start: int, end: int) -> list[Any]:
    """Requests start..end-1's ITL lists, JSON-ready."""
    lists = times.itl_lists(start, end)
    bounds = times.itl_start[[start, end]] if end > start else (0, 0)
    return _jsonable(lists) if not np.isfinite(times.itls[bounds[0]:bounds[1]]).all() else lists


def _json_pieces(obj: Mapping[str, Any]) -> list[str | PerRequest]:
    """``json.dumps(_jsonable(obj), allow_nan=False)`` of a mapping, every value but the
    PerRequest lists rendered now (a bad value is an error before anything is written)."""
    pieces: list[str | PerRequest] = ["{"]
    for i, (k, v) in enumerate(obj.items()):
        head = f"{', ' if i else ''}{json.dumps(str(k))}: "
        if isinstance(v, PerRequest):
            pieces += [head, v]
        else:
            pieces.append(head + json.dumps(_jsonable(v), allow_nan=False))
    pieces.append("}")
    return pieces


def _write_requests_csv(f: Any, requests: Sequence[Request], replicas: Sequence[int] | None,
                        times: TimesTable | None) -> None:
    """requests.csv, a chunk of requests at a time, each column made as text at once (the
    csv module's cells: a number's str, "" for none), which is the cost of a 1M-request
    run's file."""
    t = times_for(requests, times)
    f.write(",".join(REQUEST_CSV_COLUMNS) + "\n")
    for start, end in chunk_bounds(len(requests)):
        reqs = requests[start:end]
        done = t.completed[start:end].tolist()
        cols = [
            [str(r.request_id) for r in reqs],
            [str(r.arrival_time) for r in reqs],
            [str(r.prompt_len) for r in reqs],
            [str(r.num_output_tokens) for r in reqs],
            ["" if r.first_scheduled_time is None else str(r.first_scheduled_time)
             for r in reqs],
            [str(x) if ok else "" for x, ok in zip(t.ttft[start:end].tolist(), done)],
            [str(x) if ok else "" for x, ok in zip(t.e2el[start:end].tolist(), done)],
            ["" if x != x else str(x) for x in t.tpot[start:end].tolist()],  # NaN: none
            list(map(str, t.num_chunks[start:end].tolist())),
            [str(r.num_preemptions) for r in reqs],
            ["" if r.finish_time is None else str(r.finish_time) for r in reqs],
            list(map(str, replicas[start:end])) if replicas is not None else ["0"] * len(reqs),
            [str(r.num_cached_prompt_tokens) for r in reqs],
        ]
        f.write("\n".join(map(",".join, zip(*cols))) + "\n")


def steps_csv(steps: Any) -> str:
    """Per-step records (mappings, dataclasses or a DataFrame) as CSV."""
    if hasattr(steps, "to_csv"):
        return steps.to_csv(index=False, lineterminator="\n")
    rows = []
    for s in steps:
        if dataclasses.is_dataclass(s) and not isinstance(s, type):
            rows.append(dataclasses.asdict(s))
        elif isinstance(s, Mapping):
            rows.append(dict(s))
        else:
            raise ValueError(f"steps rows must be mappings or dataclasses, got {type(s).__name__}")
    header: list[str] = []
    for row in rows:  # union of keys, first-seen order
        header += [k for k in row if k not in header]
    return _csv_text(header, [[_cell(row.get(k)) for k in header] for row in rows])


# A run's result files, result.json first: it is removed first and written last, so its presence
# means every other file beside it comes from the same run (resumable sweeps skip on it).
RESULT_FILES = ("result.json", "requests.csv", "steps.csv", "summary.txt")


def clear_results(run_dir: str | os.PathLike[str]) -> None:
    """Remove a previous run's result files from run_dir (result.json first)."""
    run_dir = Path(run_dir)
    for name in RESULT_FILES:
        (run_dir / name).unlink(missing_ok=True)
    _fsync_dir(run_dir)


def write_results(run_dir: str | os.PathLike[str], summary: Mapping[str, Any],
                  requests: Sequence[Request], extra: Mapping[str, Any], *,
                  steps: Any = None, summary_text: str | None = None,
                  replicas: Sequence[int] | None = None, times: TimesTable | None = None
                  ) -> Path:
    """Write run_dir/result.json (summary + {"schedlab": extra}), requests.csv and, given
    per-step records, steps.csv, given the printout, summary.txt, as one unit: a previous run's
    files are removed first, each file is written atomically, result.json last, and if any write
    fails (or is interrupted) none of them is left. Returns result.json's path. ``times``: the
    requests' TimesTable, when the caller has it already."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # Everything else is rendered before anything is written: a bad value leaves no new file
    # (requests.csv is written first, and removed with the rest if a row fails); result.json's
    # per-request lists (PerRequest) come from the run's columns as it is written.
    result = _json_pieces({**summary, "schedlab": dict(extra)})
    texts = []
    if steps is not None:
        texts.append(("steps.csv", steps_csv(steps)))
    if summary_text is not None:
        texts.append(("summary.txt", summary_text + "\n"))
    clear_results(run_dir)
    try:
        # requests.csv in chunks, straight to its file: a 1M-request run's rows never sit in
        # memory as one text
        with atomic_path(run_dir / "requests.csv") as tmp, \
                open(tmp, "w", encoding="utf-8", newline="") as f:
            _write_requests_csv(f, requests, replicas, times)
            f.flush()
            os.fsync(f.fileno())
        for name, text in texts:
            write_text_atomic(run_dir / name, text)
        with atomic_path(run_dir / "result.json") as tmp, open(tmp, "w", encoding="utf-8") as f:
            for piece in result:
                if isinstance(piece, str):
                    f.write(piece)
                else:
                    piece.write_json(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):  # the write's own error is the one to report
            clear_results(run_dir)
        raise
    _fsync_dir(run_dir)
    return run_dir / "result.json"
