"""What a simulated run keeps of each request as it finishes (the simulator's finish hook): its
times (a TimesRecorder), the replica it went to, and in a long run its requests.csv row, given
to worker processes while the run goes on (StreamedRows); the request then lets go of its lists,
so that a 1M-request run keeps a few numbers a request, not every token's time."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from experiments.request_times import TimesRecorder, TimesTable
from experiments.result_files import RequestRows, StreamedRows
from policies.request import Request


class FinishedRequests:
    """The finish hook of a simulation of ``requests`` (numbered by position) writing into
    ``run_dir``: called with the requests that finished, the replica they ran on and their
    decode group's runs (simulator.replica_state.FinishHook). ``streamed``: requests.csv so
    far (None in a short run); ``table()``: every request's times once the run is over."""

    def __init__(self, requests: Sequence[Request], run_dir: str | os.PathLike[str], *,
                 cluster: bool) -> None:
        self._requests = requests
        self._recorder = TimesRecorder(len(requests))
        self._routed_to = np.zeros(len(requests), np.int64) if cluster else None
        # requests.csv's rows written as the run goes: each chunk of requests once they have
        # all finished (the rows' times are the recorder's, final once placed)
        self.streamed = StreamedRows.start(run_dir, RequestRows(requests, self._routed_to,
                                                                self._recorder.columns()))
        if self.streamed is not None:
            self._recorder.on_placed = self.streamed.add

    def __call__(self, finished: list[Request], replica: int,
                 runs: tuple[Any, list[tuple[int, int]]] | None) -> None:
        requests = self._requests
        mine = [i for i, r in enumerate(finished)
                if r.request_id < len(requests) and requests[r.request_id] is r]
        if len(mine) < len(finished):  # (a request that is not one of the run's)
            finished = [finished[i] for i in mine]
            runs = None if runs is None else (runs[0], [runs[1][i] for i in mine])
        numbers = [r.request_id for r in finished]
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
