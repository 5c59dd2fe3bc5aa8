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
import itertools
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from experiments.files import AtomicText, atomic_text_file, write_text_atomic
from experiments.parallel_text import Job, Texts, workers_for
from experiments.request_rows import (  # noqa: F401  (requests.csv's columns: the run's files' names)
    REQUEST_CSV_COLUMNS,
    REQUEST_CSV_HEADER,
    RequestRows,
)
from experiments.request_times import TimesTable, chunk_bounds, runs_as_lists
from policies.request import Request

if TYPE_CHECKING:
    from experiments.streamed_files import StreamedRows

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
    columns, so that a 1M-request run's lists never exist whole: result.json gets them streamed.
    ``job(start, end)``: a function and its data (slices of the columns: picklable, as a run's
    result may be) whose call gives requests start..end-1's JSON-ready values."""

    def __init__(self, n: int, job: Callable[[int, int], tuple[Callable[..., list], tuple]]
                 ) -> None:
        self._n, self._job = n, job

    @classmethod
    def of(cls, column: np.ndarray) -> PerRequest:
        """The list of one column's values."""
        return cls(len(column), functools.partial(_column_job, column))

    @classmethod
    def itls(cls, times: TimesTable) -> PerRequest:
        """Each request's ITLs, a list a request."""
        return cls(len(times), functools.partial(_itl_job, times))

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        if not -self._n <= i < self._n:
            raise IndexError(i)
        i %= self._n
        return self._values(i, i + 1)[0]

    def __iter__(self) -> Iterator[Any]:
        for values in self.chunks():
            yield from values

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, list | PerRequest):
            return NotImplemented
        return list(self) == list(other)

    def _values(self, start: int, end: int) -> list[Any]:
        fn, args = self._job(start, end)
        return fn(*args)

    def chunks(self) -> Iterator[list[Any]]:
        """The values, a chunk of requests at a time (request_times.chunk_bounds)."""
        for start, end in chunk_bounds(self._n):
            yield self._values(start, end)

    def json_job(self, start: int, end: int) -> Job:
        """The job (experiments.parallel_text) of requests start..end-1's values as JSON,
        without the list's brackets."""
        return _json_text, self._job(start, end)


def _json_text(fn: Callable[..., list], args: tuple) -> str:
    return json.dumps(fn(*args), allow_nan=False)[1:-1]


def _column_job(column: np.ndarray, start: int, end: int) -> tuple[Callable[..., list], tuple]:
    return _column_values, (column[start:end],)


def _column_values(part: np.ndarray) -> list[Any]:
    """A column's values, JSON-ready (a non-finite one as _jsonable writes it)."""
    values = part.tolist()
    return _jsonable(values) if part.dtype.kind == "f" and not np.isfinite(part).all() else values


def _itl_job(times: TimesTable, start: int, end: int) -> tuple[Callable[..., list], tuple]:
    return _itl_values, times.itl_runs(start, end)


def _itl_values(itls: np.ndarray, bounds: np.ndarray) -> list[Any]:
    """Each request's ITL list (TimesTable.itl_runs' form), JSON-ready."""
    lists = runs_as_lists(itls, bounds)
    return _jsonable(lists) if not np.isfinite(itls).all() else lists


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


def steps_csv(steps: Any) -> str:
    """Per-step records (mappings, dataclasses, a DataFrame or simulator.outcome.StepRows) as
    CSV."""
    if hasattr(steps, "csv_job"):
        fn, args = steps.csv_job(0, len(steps))
        return ",".join(steps.columns) + "\n" + fn(*args)
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
                  replicas: Sequence[int] | None = None, times: TimesTable | None = None,
                  streamed: StreamedRows | None = None,
                  extra_columns: Sequence[tuple[str, np.ndarray]] = ()) -> Path:
    """Write run_dir/result.json (summary + {"schedlab": extra}), requests.csv and, given
    per-step records, steps.csv, given the printout, summary.txt, as one unit: a previous run's
    files are removed first, each file is written atomically, result.json last, and if any write
    fails (or is interrupted) none of them is left. Returns result.json's path. ``times``: the
    requests' TimesTable, when the caller has it already. ``streamed``: requests.csv's rows
    so far, and steps.csv's where it streamed ``steps``, written while the run went on (the
    rows after those are written here)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # Everything else is rendered before anything is written: a bad value leaves no new file.
    # The rows (requests.csv's, steps.csv's as StepRows, result.json's per-request lists) are
    # taken and rendered a chunk at a time as they are written, by worker processes too in a
    # long run (experiments.parallel_text): a failing chunk removes what was written with the
    # rest (the previous run's files are gone by then).
    result = _json_pieces({**summary, "schedlab": dict(extra)})
    streamed_steps = _end_stream(streamed, steps) if streamed is not None else None
    rows = RequestRows(requests, replicas, times, extra_columns)
    request_rows = _Chunked(rows.job, len(requests),
                            streamed.rows_given if streamed is not None else 0)
    step_rows = None
    texts = []
    if hasattr(steps, "csv_job"):  # simulator.outcome.StepRows: rows rendered like requests
        step_rows = _Chunked(steps.csv_job, len(steps),
                             streamed_steps.rows_given if streamed_steps is not None else 0)
    elif steps is not None:
        texts.append(("steps.csv", steps_csv(steps)))
    lists = [_Chunked(p.json_job, len(p)) for p in result if isinstance(p, PerRequest)]
    if summary_text is not None:
        texts.append(("summary.txt", summary_text + "\n"))
    parts = [request_rows, *([step_rows] if step_rows is not None else []), *lists]
    clear_results(run_dir)
    # (workers that could not start for the stream are not tried again)
    renderer = Texts(workers_for(max(p.rows for p in parts))
                     if streamed is None or streamed.parallel else 0)
    chunks = renderer.rest(itertools.chain.from_iterable(p.jobs for p in parts))
    try:
        # a streamed file's copy is completed and put in place here, with the rows before
        _write_rows(streamed.requests if streamed is not None
                    else AtomicText(run_dir / "requests.csv", rows.header),
                    chunks, request_rows.count)
        if step_rows is not None:
            _write_rows(streamed_steps if streamed_steps is not None
                        else AtomicText(run_dir / "steps.csv", ",".join(steps.columns) + "\n"),
                        chunks, step_rows.count)
        for name, text in texts:
            write_text_atomic(run_dir / name, text)
        _write_json(run_dir / "result.json", result, chunks, [p.count for p in lists])
    except BaseException:
        if streamed is not None:  # the copies it has not put in place removed
            with contextlib.suppress(OSError):  # the write's own error is the one to report
                streamed.discard()
        with contextlib.suppress(OSError):
            clear_results(run_dir)
        raise
    finally:
        chunks.close()
        renderer.close()  # stops the workers
    _fsync_dir(run_dir)
    return run_dir / "result.json"


class _Chunked:
    """A file's (or a list's) rows first..n-1 as jobs (experiments.parallel_text), a chunk of
    rows at a time, each job made as it is taken: ``count`` of them, ``rows`` rows."""

    def __init__(self, job: Callable[[int, int], Job], n: int, first: int = 0) -> None:
        bounds = [(max(a, first), b) for a, b in chunk_bounds(n) if b > first]
        self.jobs: Iterator[Job] = (job(a, b) for a, b in bounds)
        self.count, self.rows = len(bounds), n - first


def _end_stream(streamed: StreamedRows, steps: Any) -> AtomicText | None:
    """The stream of the run's rows ended (its workers' texts written, the workers stopped);
    steps.csv's streamed copy, if it streamed ``steps``. Steps other than those it streamed
    are refused, its copies removed."""
    if streamed.steps is not None and streamed.step_rows is not steps:
        streamed.discard()
        raise ValueError("write_results: steps are not the rows streamed into steps.csv")
    streamed.finish()
    return streamed.steps


def _write_rows(file: AtomicText, chunks: Iterator[str], count: int) -> None:
    """The next ``count`` chunks' text into ``file``, put in place when done (or removed)."""
    with file as f:
        for _ in range(count):
            f.write(next(chunks))


def _write_json(path: Path, result: list[str | PerRequest], chunks: Iterator[str],
                counts: list[int]) -> None:
    """result.json from its pieces (_json_pieces), each per-request list from the next of
    ``counts`` chunks' texts (an empty chunk adds no separator)."""
    with atomic_text_file(path) as f:
        lists = iter(counts)
        for piece in result:
            if isinstance(piece, str):
                f.write(piece)
                continue
            f.write("[")
            sep = ""
            for _ in range(next(lists)):
                if text := next(chunks):
                    f.write(sep + text)
                    sep = ", "
            f.write("]")
