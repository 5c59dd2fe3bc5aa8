"""requests.csv: one row a request, rendered a chunk of requests at a time from the run's
columns (the requests' own fields and their TimesTable), so that a long run's rows are never
held whole and a chunk can be rendered by a worker process (experiments/parallel_text.py).

The cells are the csv module's: each value's own ``str()`` (a time the request holds as the
int 0 reads "0", a float its shortest repr), empty for None, NaN or an unfinished request's
times. pandas' and pyarrow's CSV writers were measured on the 1M-request case
(benchmarks/results_write.py; figures in BENCHMARKS.md): neither writes these bytes (pyarrow
writes the float 0.0 as "0"; pandas writes a column of ints and floats, the t = 0 clock's int 0
among float times, as floats), and pandas is slower than this renderer. So requests.csv keeps
its own renderer: columns in arrays, and each distinct float of a column that repeats (a
window's requests share their times) formatted once, a float's repr being most of a row's
cost."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from experiments.parallel_text import Job
from experiments.request_times import TimesTable, times_for
from policies.request import Request

REQUEST_CSV_COLUMNS = ("request_id", "arrival_time", "prompt_len", "output_len",
                       "first_scheduled_time", "ttft", "e2el", "tpot", "num_chunks",
                       "num_preemptions", "finish_time", "replica", "num_cached_tokens")
REQUEST_CSV_HEADER = ",".join(REQUEST_CSV_COLUMNS) + "\n"



class RequestRows:
    """requests.csv's rows, a chunk at a time (``job(start, end)``: the job that renders them,
    its columns taken of those requests then, so that a worker renders one chunk while the
    next is taken)."""

    def __init__(self, requests: Sequence[Request], replicas: Sequence[int] | None,
                 times: TimesTable | None,
                 extra: Sequence[tuple[str, np.ndarray]] = ()) -> None:
        self._requests, self._replicas = requests, replicas
        self._times = times_for(requests, times)
        # columns after REQUEST_CSV_COLUMNS (a disaggregated cluster's: HandoffLog), per
        # request, filled by the time a request's row is taken (NaN written empty)
        self._extra = list(extra)
        self.header = REQUEST_CSV_HEADER if not self._extra else \
            ",".join((*REQUEST_CSV_COLUMNS, *(name for name, _ in self._extra))) + "\n"

    def __len__(self) -> int:
        return len(self._requests)

    def job(self, start: int, end: int) -> Job:
        """The job (experiments.parallel_text) of rows start..end-1's text."""
        reqs = self._requests[start:end]
        n, t = len(reqs), self._times

        def column(attr: str) -> np.ndarray:
            return np.fromiter(map(operator.attrgetter(attr), reqs), np.int64, n)

        def as_given(attr: str) -> list[Any]:  # each value's own str(): 0 stays 0, None ""
            return list(map(operator.attrgetter(attr), reqs))

        replica = (np.asarray(self._replicas[start:end], np.int64)
                   if self._replicas is not None else np.zeros(n, np.int64))
        # REQUEST_CSV_COLUMNS' columns, and what of each is written empty ("nan": NaN,
        # "none": None, "done": a request that did not finish); the times the requests hold as
        # they hold them (a t = 0 run's clock starts at the int 0)
        columns = [(column("request_id"), ""), (as_given("arrival_time"), ""),
                   (column("prompt_len"), ""), (column("num_output_tokens"), ""),
                   (as_given("first_scheduled_time"), "none"), (t.ttft[start:end], "done"),
                   (t.e2el[start:end], "done"), (t.tpot[start:end], "nan"),
                   (t.num_chunks[start:end], ""), (column("num_preemptions"), ""),
                   (as_given("finish_time"), "none"), (replica, ""),
                   (column("num_cached_prompt_tokens"), "")]
        columns += [(values[start:end], "nan") for _, values in self._extra]
        return _request_rows_text, (columns, t.completed[start:end])


def _text(x: Any, how: str) -> str:
    """A cell: the value's str(), empty for None in a "none" column, NaN in a "nan" one."""
    return "" if (how == "none" and x is None) or (how == "nan" and x != x) else str(x)


class _Texts(dict):
    """The cell of each value asked for (``_text``), made once a value."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def __missing__(self, x: Any) -> str:
        text = self[x] = _text(x, self.how)
        return text


def _cells(values: list[Any] | np.ndarray, how: str) -> list[str]:
    """Each value's cell (``_text``). Where the values are of one type and repeat (a window's
    requests share their times), each distinct one is made once: a float's shortest repr is
    most of a row's cost."""
    numbers = isinstance(values, np.ndarray) and values.dtype.kind in "iuf"
    plain = numbers and not (values.dtype.kind == "f" and np.isnan(values).any())
    if isinstance(values, np.ndarray):
        values = values.tolist()
    head = values[:256]
    if len(set(head)) * 2 <= len(head) and (plain or len(set(map(type, values))) == 1):
        texts = _Texts(how)  # one type: 0 and 0.0 never meet
        cells = list(map(texts.__getitem__, values))
        zero = next((x for x in texts if x == 0), None)
        if isinstance(zero, float):  # 0.0 and -0.0 are one key: each zero its own sign
            sign = math.copysign(1.0, zero)
            for i, x in enumerate(values):
                if x == 0 and math.copysign(1.0, x) != sign:
                    cells[i] = _text(x, how)
        return cells
    if plain or how in ("", "done"):
        return list(map(str, values))
    return [_text(x, how) for x in values]


def _request_rows_text(columns: list[tuple[Sequence[Any], str]], done: np.ndarray) -> str:
    """requests.csv's lines of these rows: each column made as text at once, the csv module's
    cells (a number's str; "" for None in a "none" column, NaN in a "nan" one, and in a "done"
    one where the request did not finish)."""
    cols = []
    for values, how in columns:
        cells = _cells(values, how)
        if how == "done":
            for i in np.flatnonzero(~done).tolist():
                cells[i] = ""
        cols.append(cells)
    return "\n".join(map(",".join, zip(*cols))) + "\n" if len(done) else ""
