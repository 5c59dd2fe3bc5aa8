"""requests.csv: one row a request, its columns taken a chunk of requests at a time from the
run (the requests' own fields and their TimesTable), so that a long run's rows are never held
whole and a chunk can be written as soon as its requests have finished
(experiments/streamed_files.py). Each cell is the csv module's: the value's own ``str()`` (a
time the request holds as the int 0 reads "0"), empty for None, NaN or an unfinished request's
times (experiments/result_text.py writes them)."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from experiments.request_times import TimesTable, times_for
from experiments.result_text import Column, Numbers
from policies.request import Request

REQUEST_CSV_COLUMNS = ("request_id", "arrival_time", "prompt_len", "output_len",
                       "first_scheduled_time", "ttft", "e2el", "tpot", "num_chunks",
                       "num_preemptions", "finish_time", "replica", "num_cached_tokens")


class RequestRows:
    """requests.csv's rows, a chunk at a time (``columns(start, end)``: those requests'
    columns, taken then)."""

    def __init__(self, requests: Sequence[Request], replicas: Sequence[int] | None,
                 times: TimesTable | None,
                 extra: Sequence[tuple[str, np.ndarray]] = ()) -> None:
        self._requests, self._replicas = requests, replicas
        self._times = times_for(requests, times)
        # columns after REQUEST_CSV_COLUMNS (a disaggregated cluster's: HandoffLog), per
        # request, filled by the time a request's row is taken (NaN written empty)
        self._extra = list(extra)
        self.names = (*REQUEST_CSV_COLUMNS, *(name for name, _ in self._extra))

    def __len__(self) -> int:
        return len(self._requests)

    def columns(self, start: int, end: int) -> list[Column]:
        """Rows start..end-1's columns, in ``names``' order."""
        reqs = self._requests[start:end]
        n, t = len(reqs), self._times
        unfinished = ~t.completed[start:end]

        def column(attr: str) -> np.ndarray:
            return np.fromiter(map(operator.attrgetter(attr), reqs), np.int64, n)

        def as_given(attr: str) -> list[Any]:  # each value's own str(): 0 stays 0, None ""
            return list(map(operator.attrgetter(attr), reqs))

        def finished(values: np.ndarray) -> Column:  # an unfinished request's: empty
            return Numbers(values[start:end], unfinished)

        def or_empty(values: np.ndarray) -> Column:  # NaN: empty
            return values if values.dtype == bool else Numbers(values, np.isnan(values))

        replica = (np.asarray(self._replicas[start:end], np.int64)
                   if self._replicas is not None else np.zeros(n, np.int64))
        # the times the requests hold as they hold them (a t = 0 run's clock starts at the
        # int 0); NaN written empty where a column has no value (a TPOT of one token)
        return [column("request_id"), as_given("arrival_time"), column("prompt_len"),
                column("num_output_tokens"), as_given("first_scheduled_time"),
                finished(t.ttft), finished(t.e2el), or_empty(t.tpot[start:end]),
                t.num_chunks[start:end], column("num_preemptions"), as_given("finish_time"),
                replica, column("num_cached_prompt_tokens"),
                *(or_empty(values[start:end]) for _, values in self._extra)]
