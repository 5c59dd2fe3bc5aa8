"""A run's result files: result.json (vLLM's ``--save-result`` format plus schedlab's section),
requests.csv, steps.csv and summary.txt, written as one unit; a run's per-request lists and rows
are written a chunk at a time, never held as one text or as lists of every value."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import enum
import io
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from experiments.files import atomic_text_file, write_text_atomic
from experiments.request_rows import (  # noqa: F401  (requests.csv's columns: the run's files' names)
    REQUEST_CSV_COLUMNS,
    RequestRows,
)
from experiments.request_times import TimesTable, chunk_bounds, runs_as_lists
from experiments.result_text import csv_text, json_is_plain, json_number_lists, json_numbers
from experiments.streamed_files import StreamedRows
from policies.request import Request


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
    Made of a column of numbers (``of``) or of each request's ITLs (``itls``)."""

    def __init__(self, n: int, column: np.ndarray | None = None,
                 times: TimesTable | None = None) -> None:
        self._n, self._column, self._times = n, column, times

    @classmethod
    def of(cls, column: np.ndarray) -> PerRequest:
        """The list of one column's values."""
        return cls(len(column), column=column)

    @classmethod
    def itls(cls, times: TimesTable) -> PerRequest:
        """Each request's ITLs, a list a request."""
        return cls(len(times), times=times)

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
        for start, end in chunk_bounds(self._n):
            yield from self._values(start, end)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, list | PerRequest):
            return NotImplemented
        return list(self) == list(other)

    def _values(self, start: int, end: int) -> list[Any]:
        """Requests start..end-1's values, JSON-ready (a non-finite number as _jsonable
        writes it)."""
        if self._column is not None:
            part = self._column[start:end]
            values = part.tolist()
            return values if json_is_plain(part) else _jsonable(values)
        itls, bounds = self._times.itl_runs(start, end)
        lists = runs_as_lists(itls, bounds)
        return lists if json_is_plain(itls) else _jsonable(lists)

    def json_text(self, start: int, end: int) -> str:
        """Requests start..end-1's values as JSON, without the list's brackets (pyarrow's
        text: experiments.result_text)."""
        if self._column is not None:
            part = self._column[start:end]
            if json_is_plain(part):
                return json_numbers(part)
        else:
            itls, bounds = self._times.itl_runs(start, end)
            if json_is_plain(itls):
                return json_number_lists(itls, bounds)
        return json.dumps(self._values(start, end), allow_nan=False)[1:-1]


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
    if hasattr(steps, "columns_of"):
        return csv_text(steps.columns, steps.columns_of(0, len(steps)))
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
    # taken and rendered a chunk at a time as they are written: a failing chunk removes what
    # was written with the rest (the previous run's files are gone by then).
    result = _json_pieces({**summary, "schedlab": dict(extra)})
    step_rows = steps if hasattr(steps, "columns_of") else None  # simulator.outcome.StepRows
    texts = []
    if steps is not None and step_rows is None:
        texts.append(("steps.csv", steps_csv(steps)))
    if summary_text is not None:
        texts.append(("summary.txt", summary_text + "\n"))
    rows = RequestRows(requests, replicas, times, extra_columns) if streamed is None else None
    try:
        clear_results(run_dir)
        if streamed is None:
            streamed = StreamedRows(run_dir, rows)
        # (a streamed file's copy is completed and put in place here, with the rows before)
        streamed.complete(step_rows)
        for name, text in texts:
            write_text_atomic(run_dir / name, text)
        _write_json(run_dir / "result.json", result)
    except BaseException:
        if streamed is not None:  # the copies it has not put in place removed
            with contextlib.suppress(OSError):  # the write's own error is the one to report
                streamed.discard()
        with contextlib.suppress(OSError):
            clear_results(run_dir)
        raise
    _fsync_dir(run_dir)
    return run_dir / "result.json"


def _write_json(path: Path, result: list[str | PerRequest]) -> None:
    """result.json from its pieces (_json_pieces), each per-request list a chunk of requests
    at a time (an empty chunk adds no separator)."""
    with atomic_text_file(path) as f:
        for piece in result:
            if isinstance(piece, str):
                f.write(piece)
                continue
            f.write("[")
            sep = ""
            for start, end in chunk_bounds(len(piece)):
                if text := piece.json_text(start, end):
                    f.write(sep + text)
                    sep = ", "
            f.write("]")
