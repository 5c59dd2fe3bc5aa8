"""What a streaming client saw of each request (TTFT, ITLs, TPOT, E2EL): of one request
(``request_times``), or of every request of a run as columns (``TimesTable``), the form the
metrics and result files read. ``TimesRecorder`` fills a table as requests finish, so that a
long simulated run keeps a few numbers a request rather than every token's time."""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Iterator, Sequence

import numpy as np

from policies.request import Request

# A long run's per-request work (reordering, the peaks, the result files) is done this many
# requests at a time: its temporaries are a chunk's, not the whole run's.
CHUNK_REQUESTS = 5_000


def chunk_bounds(n: int) -> Iterator[tuple[int, int]]:
    """(start, end) of each chunk of CHUNK_REQUESTS of n requests, in order."""
    size = CHUNK_REQUESTS
    for start in range(0, n, size):
        yield start, min(start + size, n)


@dataclasses.dataclass(slots=True)
class RequestTimes:
    """What a streaming client saw of one request (times in seconds)."""

    completed: bool
    output_len: int
    ttft: float = 0.0
    e2el: float = 0.0
    tpot: float | None = None  # None with fewer than two output tokens
    itls: Sequence[float] = dataclasses.field(default_factory=list)
    num_chunks: int = 0


def request_times(req: Request) -> RequestTimes:
    """TTFT, ITLs, TPOT and E2EL of one request from its token delivery times.

    A chunk is the set of tokens delivered at one instant (equal token_times: a backend stamps
    a burst with one clock reading), so with multi-step a chunk may carry up to k tokens and
    the ITLs are the gaps between successive chunks, as benchmark_serving measures them.
    A request counts as completed once it has a finish_time; unfinished ones look like
    benchmark_serving's failed requests (output_len 0, no latencies).
    """
    if req.finish_time is None:
        return RequestTimes(completed=False, output_len=0)
    c = _finished_columns([req.request_id], [req.arrival_time], [req.num_output_tokens],
                          [req.token_times])
    return RequestTimes(completed=True, output_len=int(c.output_len[0]), ttft=float(c.ttft[0]),
                        e2el=float(c.e2el[0]),
                        tpot=None if c.output_len[0] < 2 else float(c.tpot[0]),
                        itls=c.itls.tolist(), num_chunks=int(c.num_chunks[0]))


@dataclasses.dataclass(slots=True)
class _Columns:
    """request_times of finished requests, as arrays (ITLs pooled in their order)."""

    output_len: np.ndarray
    ttft: np.ndarray
    e2el: np.ndarray
    tpot: np.ndarray  # NaN with fewer than two tokens
    num_chunks: np.ndarray
    itls: np.ndarray


def _finished_columns(ids: Sequence[int], arrival: Sequence[float], outputs: Sequence[int],
                      token_times: Sequence[Sequence[float]]) -> _Columns:
    """request_times of finished requests (their ids, arrival times, output token counts and
    token times) in one pass over all their token times (request i's ITLs are the nonzero gaps
    between its successive times, a chunk being the tokens of one instant), with
    request_times' checks."""
    n = len(ids)
    lens = np.fromiter(map(len, token_times), np.int64, n)
    for i in np.flatnonzero((lens != np.asarray(outputs, np.int64)) | (lens == 0))[:1]:
        if not lens[i]:
            raise ValueError(f"request {ids[i]} finished but has no token_times")
        raise ValueError(f"request {ids[i]} has {lens[i]} token_times but "
                         f"num_output_tokens = {outputs[i]}")
    times = np.concatenate(token_times).astype(float, copy=False) if n else np.zeros(0)
    arrival = np.asarray(arrival, float)
    bounds = _starts(lens)
    start, end = bounds[:-1], bounds[1:]
    first, last = times[start], times[end - 1]
    for i in np.flatnonzero(first < arrival)[:1]:
        raise ValueError(f"request {ids[i]}: first token at {first[i]} is before "
                         f"its arrival at {arrival[i]}")
    gaps = np.diff(times)
    inner = np.ones(len(gaps), bool)  # the gaps within a request, not between two
    inner[end[:-1] - 1] = False
    back = np.flatnonzero((gaps < 0) & inner)
    if len(back):
        j = back[0]
        i = int(np.searchsorted(end, j, side="right"))
        raise ValueError(f"request {ids[i]}: token_times go backwards "
                         f"({times[j]} then {times[j + 1]})")
    step = (gaps != 0) & inner  # where a new chunk starts
    seen = np.zeros(len(times) + 1, np.int64)
    np.cumsum(step, out=seen[2:])
    ttft, e2el = first - arrival, last - arrival
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot = np.where(lens > 1, (e2el - ttft) / (lens - 1), np.nan)
    return _Columns(lens, ttft, e2el, tpot, seen[end] - seen[start + 1] + 1, gaps[step])


class TimesTable:
    """Every request's RequestTimes as columns, in request order: ``completed``, ``output_len``,
    ``ttft``, ``e2el`` (0 where unfinished), ``tpot`` (NaN where there is none),
    ``num_chunks``, and every request's ITLs in one array (``itls``), request i's being
    ``itls[itl_start[i]:itl_start[i + 1]]``."""

    __slots__ = ("completed", "output_len", "ttft", "e2el", "tpot", "num_chunks", "itls",
                 "itl_start")

    def __init__(self, completed: np.ndarray, output_len: np.ndarray, ttft: np.ndarray,
                 e2el: np.ndarray, tpot: np.ndarray, num_chunks: np.ndarray, itls: np.ndarray,
                 itl_start: np.ndarray) -> None:
        self.completed, self.output_len, self.ttft, self.e2el = completed, output_len, ttft, e2el
        self.tpot, self.num_chunks, self.itls, self.itl_start = tpot, num_chunks, itls, itl_start

    def __len__(self) -> int:
        return len(self.completed)

    @classmethod
    def of(cls, times: Sequence[RequestTimes]) -> TimesTable:
        """The table of these RequestTimes, in their order."""
        n = len(times)
        itls = array("d")
        counts = np.empty(n, np.int64)
        for i, t in enumerate(times):
            counts[i] = len(t.itls)
            itls.extend(t.itls)
        return cls(np.fromiter((t.completed for t in times), bool, n),
                   np.fromiter((t.output_len for t in times), np.int64, n),
                   np.fromiter((t.ttft for t in times), float, n),
                   np.fromiter((t.e2el for t in times), float, n),
                   np.fromiter((np.nan if t.tpot is None else t.tpot for t in times), float, n),
                   np.fromiter((t.num_chunks for t in times), np.int64, n),
                   np.frombuffer(itls, dtype=float) if len(itls) else np.zeros(0),
                   _starts(counts))

    @classmethod
    def of_requests(cls, requests: Sequence[Request]) -> TimesTable:
        """The table of these requests' request_times."""
        recorder = TimesRecorder(len(requests))
        done = [i for i, r in enumerate(requests) if r.finish_time is not None]
        recorder.record(done, [requests[i] for i in done])
        return recorder.table()

    def without_itls(self) -> TimesTable:
        """The table with no ITL left (every other column shared): what a run keeps once its
        ITL statistics are taken where no per-request list is written (0.14 GB at 1M)."""
        return TimesTable(self.completed, self.output_len, self.ttft, self.e2el, self.tpot,
                          self.num_chunks, np.zeros(0), np.zeros(len(self) + 1, np.int64))

    def tpots(self, picked: np.ndarray) -> np.ndarray:
        """The TPOTs of the requests ``picked`` (a mask) that have one."""
        tpot = self.tpot[picked]
        return tpot[~np.isnan(tpot)]

    def itl_runs(self, first: int = 0, end: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Requests first..end-1's ITLs as one array, and the bounds of each request's run in
        it (run i: bounds[i]..bounds[i + 1]); ``runs_as_lists`` makes them the lists."""
        end = len(self) if end is None else end
        bounds = self.itl_start[first:end + 1]
        base = int(bounds[0]) if len(bounds) else 0
        return self.itls[base:int(bounds[-1]) if len(bounds) else 0], bounds - base

    def itl_lists(self, first: int = 0, end: int | None = None) -> list[list[float]]:
        """Each request's ITLs as a list (result.json's ``itls``), of requests first..end-1."""
        return runs_as_lists(*self.itl_runs(first, end))


def runs_as_lists(values: np.ndarray, bounds: np.ndarray) -> list[list[float]]:
    """``values`` cut into lists at ``bounds`` (run i: values[bounds[i]:bounds[i + 1]])."""
    flat = values.tolist()
    edges = bounds.tolist()
    return [flat[a:b] for a, b in zip(edges, edges[1:])]


def times_for(requests: Sequence[Request], times: TimesTable | None) -> TimesTable:
    """The requests' table: ``times`` where the caller has it (one row a request, checked),
    else made from the requests."""
    if times is None:
        return TimesTable.of_requests(requests)
    if len(times) != len(requests):
        raise ValueError(f"{len(times)} request times for {len(requests)} requests")
    return times


def _starts(counts: np.ndarray) -> np.ndarray:
    """Where each of ``counts``' runs starts in their concatenation, and the total, last."""
    start = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=start[1:])
    return start


class TimesRecorder:
    """Fills a TimesTable as requests finish (``record``), for requests numbered 0..n-1 by
    position; ``table`` adds the requests that never finished. The times of a few thousand
    finished requests are worked out together (numpy's cost per call is the cost of a few
    hundred tokens); ITLs are kept as they come (finish order) and put in request order once,
    at the end."""

    PENDING = 4096

    def __init__(self, n: int) -> None:
        self._done = np.zeros(n, bool)
        self._output_len = np.zeros(n, np.int64)
        self._ttft = np.zeros(n)
        self._e2el = np.zeros(n)
        self._tpot = np.full(n, np.nan)
        self._chunks = np.zeros(n, np.int64)
        self._first_itl = np.zeros(n, np.int64)  # where its ITLs start in _itls
        self._itls: array | None = array("d")  # None once table() has taken them
        # recorded, not yet worked out: numbers, request ids, arrivals, output counts, times
        self._pending: tuple[list, list, list, list, list] = ([], [], [], [], [])

    def record(self, index: Sequence[int], reqs: Sequence[Request]) -> None:
        """The times of requests ``index`` (numbers), ``reqs``, now that they have finished
        (their token times are kept; the requests may let go of them)."""
        if self._itls is None:
            raise RuntimeError("TimesRecorder.record after table(): the table is made once")
        numbers, ids, arrival, outputs, times = self._pending
        numbers += index
        for r in reqs:
            ids.append(r.request_id)
            arrival.append(r.arrival_time)
            outputs.append(r.num_output_tokens)
            times.append(r.token_times)
        if len(numbers) >= self.PENDING:
            self._work_out()

    def _work_out(self) -> None:
        """The pending requests' columns into the table's arrays."""
        index, *pending = self._pending
        self._pending = ([], [], [], [], [])
        if not index:
            return
        c = _finished_columns(*pending)
        i = np.asarray(index, np.int64)
        self._done[i] = True
        self._output_len[i] = c.output_len
        self._ttft[i], self._e2el[i], self._tpot[i] = c.ttft, c.e2el, c.tpot
        self._chunks[i] = c.num_chunks
        self._first_itl[i] = len(self._itls) + _starts(c.num_chunks - 1)[:-1]
        self._itls.frombytes(memoryview(c.itls).cast("B"))

    def table(self) -> TimesTable:
        """The table of every request (those never recorded: unfinished), made once: the
        recorder's arrays are handed over, so it records nothing more."""
        if self._itls is None:
            raise RuntimeError("TimesRecorder.table called twice: the table is made once")
        self._work_out()
        done = self._done  # a request never recorded has zeros (and a NaN TPOT) throughout
        counts = np.maximum(self._chunks - 1, 0)
        start = _starts(counts)
        flat = np.frombuffer(self._itls, dtype=float) if len(self._itls) else np.zeros(0)
        itls = np.empty(start[-1])
        # position j of the request-order array takes its request's (j - start) th ITL; a
        # chunk of requests at a time (an index of every ITL would be as large as they are)
        for a, b in chunk_bounds(len(done)):
            order = np.repeat(self._first_itl[a:b] - start[a:b], counts[a:b])
            order += np.arange(start[a], start[b])
            itls[start[a]:start[b]] = flat[order]
        del flat
        self._itls = self._first_itl = None
        return TimesTable(done, self._output_len, self._ttft, self._e2el, self._tpot,
                          self._chunks, itls, start)
