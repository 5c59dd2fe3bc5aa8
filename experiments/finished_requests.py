"""What a simulated run keeps of each request as it finishes (the simulator's finish hook): its
times (a TimesRecorder), the replica it went to, and its requests.csv row, written while the
run goes on with steps.csv's rows so far (StreamedRows); the request then lets go of its lists, so that a 1M-request run keeps a few numbers a request, not
every token's time."""

from __future__ import annotations

import operator
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from experiments.request_rows import RequestRows
from experiments.request_times import TimesRecorder, TimesTable
from experiments.streamed_files import StreamedRows
from policies.request import Request

if TYPE_CHECKING:
    from simulator.outcome import StepRows

_REQUEST_ID = operator.attrgetter("request_id")


class FinishedRequests:
    """The finish hook of a simulation of ``requests`` (numbered by position) writing into
    ``run_dir``: called with the requests that finished, the replica they ran on and their
    decode group's runs (simulator.replica_state.FinishHook). ``streamed``: requests.csv
    (and steps.csv) so far; ``table()``: every request's times once the run is over."""

    def __init__(self, requests: Sequence[Request], run_dir: str | os.PathLike[str], *,
                 cluster: bool, steps: StepRows | None = None,
                 extra_columns: Sequence[tuple[str, np.ndarray]] = ()) -> None:
        self._requests = requests
        self._recorder = TimesRecorder(len(requests))
        self._routed_to = np.zeros(len(requests), np.int64) if cluster else None
        # requests.csv's rows written as the run goes: each chunk of requests once they have
        # all finished (the rows' times are the recorder's, final once placed), and with them
        # ``steps``' rows so far (the simulation's StepRows as it appends them)
        self.streamed = StreamedRows(run_dir, RequestRows(requests, self._routed_to,
                                                          self._recorder.columns(),
                                                          extra_columns), steps)
        self._recorder.on_placed = self.streamed.add

    def __call__(self, finished: list[Request], replica: int,
                 runs: tuple[Any, list[tuple[int, int]]] | None) -> None:
        requests = self._requests
        numbers = list(map(_REQUEST_ID, finished))
        if not _all_of(requests, numbers, finished):  # (a request that is not one of the run's)
            mine = [i for i, (n, r) in enumerate(zip(numbers, finished, strict=True))
                    if 0 <= n < len(requests) and requests[n] is r]
            finished, numbers = [finished[i] for i in mine], [numbers[i] for i in mine]
            runs = None if runs is None else (runs[0], [runs[1][i] for i in mine])
        if self._routed_to is not None:
            self._routed_to[numbers] = replica
        self._recorder.record(numbers, finished, runs)
        # its token times, its freed block table, the output ids a simulated request never
        # has: empty tuples, which the simulator leaves as they are
        for r in finished:
            r.token_times = r.block_table = r.output_token_ids = ()

    def table(self) -> TimesTable:
        """Every request's times (those that never finished too), once the run is over."""
        return self._recorder.table()


def _all_of(requests: Sequence[Request], numbers: list[int], finished: list[Request]) -> bool:
    """Whether each of ``finished`` is the run's request of its number (in one pass in C)."""
    if numbers and not 0 <= min(numbers) <= max(numbers) < len(requests):
        return False
    return all(map(operator.is_, map(requests.__getitem__, numbers), finished))
