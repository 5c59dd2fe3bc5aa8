"""What a streaming client saw of each request (TTFT, ITLs, TPOT, E2EL): of one request
(``request_times``), or of every request of a run as columns (``TimesTable``), the form the
metrics and result files read. ``TimesRecorder`` fills a table as requests finish, so that a
long simulated run keeps a few numbers a request rather than every token's time."""

from __future__ import annotations

import dataclasses
import itertools
import operator
from array import array
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from policies.request import Request

_ARRIVAL = operator.attrgetter("arrival_time")
_OUTPUTS, _TOKEN_TIMES = operator.attrgetter("num_output_tokens"), operator.attrgetter("token_times")
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)

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
                      token_times: Sequence[Sequence[float]],
                      runs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> _Columns:
    """request_times of finished requests (their ids, arrival times, output token counts and
    token times) in one pass over all their token times (request i's ITLs are the nonzero gaps
    between its successive times, a chunk being the tokens of one instant), with
    request_times' checks. With ``runs`` (a log and each request's start and end in it), request
    i's times are token_times[i] followed by log[start[i]:end[i]]: the log's gaps are taken once
    for all of them (a decode group's members share its steps), not once a request."""
    n = len(ids)
    lens = np.fromiter(map(len, token_times), np.int64, n)
    total = lens if runs is None else lens + (runs[2] - runs[1])
    for i in np.flatnonzero((total != np.asarray(outputs, np.int64)) | (total == 0))[:1]:
        if not total[i]:
            raise ValueError(f"request {ids[i]} finished but has no token_times")
        raise ValueError(f"request {ids[i]} has {total[i]} token_times but "
                         f"num_output_tokens = {outputs[i]}")
    # (a decode group member holds one or two times of its own: made an array each, they
    # would cost more than their values)
    times = np.fromiter(itertools.chain.from_iterable(token_times), float, int(lens.sum()))
    if runs is not None:  # each run's first time goes after its request's own: their gap is one
        log, run_start, run_end = runs
        joined = run_end > run_start
        lens = lens + joined
        with_first = np.empty(int(lens.sum()))
        mine = np.ones(len(with_first), bool)
        mine[_starts(lens)[1:][joined] - 1] = False
        with_first[mine] = times
        with_first[~mine] = log[run_start[joined]]
        times = with_first
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
    num_chunks = seen[end] - seen[start + 1] + 1
    itls = gaps[step]
    if runs is not None:
        last[joined] = log[run_end[joined] - 1]
        num_chunks, itls = _with_run_itls(ids, log, run_start, run_end, joined, num_chunks,
                                          itls)
    ttft, e2el = first - arrival, last - arrival
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot = np.where(total > 1, (e2el - ttft) / (total - 1), np.nan)
    return _Columns(total, ttft, e2el, tpot, num_chunks, itls)


def _with_run_itls(ids: Sequence[int], log: np.ndarray, run_start: np.ndarray,
                   run_end: np.ndarray, joined: np.ndarray, num_chunks: np.ndarray,
                   itls: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The chunk counts and pooled ITLs of requests whose times so far end with their run's
    first time (those whose run is not empty: ``joined``), with the rest of their runs' gaps
    added after each one's own."""
    lo = int(run_start[joined].min()) if joined.any() else 0
    hi = int(run_end[joined].max()) if joined.any() else 0
    gaps = np.diff(log[lo:hi])  # gap j: log[lo + j + 1] - log[lo + j]
    new = np.zeros(len(gaps) + 1, np.int64)  # new[j]: new chunks among gaps 0..j-1
    np.cumsum(gaps != 0, out=new[1:])
    back = np.zeros(len(gaps) + 1, np.int64)
    np.cumsum(gaps < 0, out=back[1:])
    # a run's gaps are lo-relative gaps start - lo .. end - lo - 2
    a = np.where(joined, run_start - lo, 0)
    b = np.where(joined, run_end - lo - 1, 0)
    for i in np.flatnonzero(back[b] > back[a])[:1]:
        j = lo + a[i] + int(np.argmax(gaps[a[i]:b[i]] < 0))
        raise ValueError(f"request {ids[i]}: token_times go backwards "
                         f"({log[j]} then {log[j + 1]})")
    more = new[b] - new[a]  # each request's ITLs in its run
    own = num_chunks - 1
    # each request's run's ITLs (the log's nonzero gaps from new[a[i]] on), its own before them
    out = np.insert(gaps[gaps != 0][_run_index(new[a], more)],
                    np.repeat(_starts(more)[:-1], own), itls)
    return num_chunks + more, out


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
        ITL statistics are taken where no per-request list is written (its ITLs' memory back)."""
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


class _Pending:
    """Requests recorded, not yet worked out: their numbers, the requests, their arrivals,
    output counts and token times, and with a ``log``, each one's run of it (start, end) after
    its times."""

    __slots__ = ("numbers", "reqs", "arrival", "outputs", "times", "log", "starts", "ends")

    def __init__(self, log: np.ndarray | None) -> None:
        self.numbers: list[int] = []
        self.reqs: list[Request] = []  # (their ids are read only to name one in an error)
        self.arrival: list[float] = []
        self.outputs: list[int] = []
        self.times: list[Sequence[float]] = []
        self.log = log
        self.starts: list[int] = []
        self.ends: list[int] = []

    def columns(self) -> _Columns:
        """Their times worked out (runs far apart in the log: each request's times made whole,
        rather than the gaps of all the log between them)."""
        ids = _Ids(self.reqs)
        if self.log is None:
            return _finished_columns(ids, self.arrival, self.outputs, self.times)
        starts, ends = np.asarray(self.starts, np.int64), np.asarray(self.ends, np.int64)
        joined = ends > starts
        span = int(ends[joined].max() - starts[joined].min()) if joined.any() else 0
        if span > 2 * int((ends - starts).sum()) + 4096:
            times = [np.concatenate((t, self.log[a:b]))
                     for t, a, b in zip(self.times, self.starts, self.ends, strict=True)]
            return _finished_columns(ids, self.arrival, self.outputs, times)
        return _finished_columns(ids, self.arrival, self.outputs, self.times,
                                 (self.log, starts, ends))


class _Ids(Sequence[int]):
    """The request ids of requests, each read when asked for."""

    def __init__(self, reqs: Sequence[Request]) -> None:
        self._reqs = reqs

    def __len__(self) -> int:
        return len(self._reqs)

    def __getitem__(self, i):  # type: ignore[override]
        return self._reqs[i].request_id


class TimesRecorder:
    """Fills a TimesTable as requests finish (``record``), for requests numbered 0..n-1 by
    position; ``table`` adds the requests that never finished. The times of a few thousand
    finished requests are worked out together (numpy's cost per call is the cost of a few
    hundred tokens). ITLs are put in request order a chunk of requests (CHUNK_REQUESTS) at a
    time, once every request of the chunk and of those before it has finished: requests finish
    roughly in order, so few are held, and the run's ITLs are never copied whole."""

    PENDING = 4096

    def __init__(self, n: int) -> None:
        # called with (start, end) of each chunk placed whose requests have all finished, in
        # order, until a chunk is placed with one unfinished (the rows final so far: result
        # files written as the run goes on, experiments.streamed_files.StreamedRows)
        self.on_placed: Callable[[int, int], None] | None = None
        self._all_final = True
        self._done = np.zeros(n, bool)
        self._num_done = 0  # numbers recorded (each once: checked)
        self._output_len = np.zeros(n, np.int64)
        self._ttft = np.zeros(n)
        self._e2el = np.zeros(n)
        self._tpot = np.full(n, np.nan)
        self._chunks = np.zeros(n, np.int64)
        self._itls: array | None = array("d")  # in request order; None once table() took them
        self._itl_start = np.zeros(n + 1, np.int64)
        self._bounds = list(chunk_bounds(n))
        self._size = CHUNK_REQUESTS
        # each chunk's finished requests and their ITLs, held until the chunks before it are
        # placed: (numbers, ITL counts, ITLs) pieces; how many finished; the next to place
        self._held: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        self._finished = [0] * len(self._bounds)
        self._next = 0
        # recorded, not yet worked out: by log (id(log), None for none; each holds its log)
        self._pending: dict[int | None, _Pending] = {}
        self._num_pending = 0

    def record(self, index: Sequence[int], reqs: Sequence[Request],
               runs: tuple[np.ndarray, Sequence[tuple[int, int]]] | None = None) -> None:
        """The times of requests ``index`` (numbers), ``reqs``, now that they have finished
        (their token times are kept; the requests may let go of them). ``runs``: a log and
        each request's run of it (start, end), its times after its own token_times (a decode
        group's step log: simulator.replica_state.FinishHook)."""
        if self._itls is None:
            raise RuntimeError("TimesRecorder.record after table(): the table is made once")
        if len(index) != len(reqs) or (runs is not None and len(runs[1]) != len(reqs)):
            raise ValueError(f"{len(index)} numbers and {len(runs[1]) if runs else 'no'} runs "
                             f"for {len(reqs)} requests")
        log = None if runs is None else runs[0]
        key = None if log is None else id(log)
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = _Pending(log)
        pending.numbers += index
        pending.reqs += reqs
        pending.arrival += map(_ARRIVAL, reqs)
        pending.outputs += map(_OUTPUTS, reqs)
        pending.times += map(_TOKEN_TIMES, reqs)
        if runs is not None:
            pending.starts += map(_FIRST, runs[1])
            pending.ends += map(_SECOND, runs[1])
        self._num_pending += len(index)
        if self._num_pending >= self.PENDING:
            self._work_out()

    def _work_out(self) -> None:
        """The pending requests' columns into the table's arrays, their ITLs held by chunk."""
        batches, self._pending, self._num_pending = self._pending.values(), {}, 0
        for pending in batches:
            if not pending.numbers:
                continue
            c = pending.columns()
            i = np.asarray(pending.numbers, np.int64)
            again = i[self._done[i]]
            self._done[i] = True
            self._num_done += len(i)
            # (a number given twice in one batch is counted twice, marked once)
            if len(again) or np.count_nonzero(self._done) < self._num_done:
                twice = int(again[0]) if len(again) else \
                    int(next(n for n, k in zip(*np.unique(i, return_counts=True)) if k > 1))
                raise ValueError(f"request number {twice} was recorded as finished twice")
            self._output_len[i] = c.output_len
            self._ttft[i], self._e2el[i], self._tpot[i] = c.ttft, c.e2el, c.tpot
            self._chunks[i] = c.num_chunks
            self._hold(i, c.num_chunks - 1, c.itls)
        self._place()

    def _hold(self, numbers: np.ndarray, counts: np.ndarray, itls: np.ndarray) -> None:
        """Requests ``numbers``' ITLs (``counts`` each, pooled in their order), kept by chunk."""
        order = np.argsort(numbers, kind="stable")
        numbers, counts, itls = numbers[order], counts[order], _runs_in(itls, counts, order)
        where = _starts(counts)
        chunk = numbers // self._size
        cut = np.flatnonzero(np.diff(chunk)) + 1
        for a, b in zip([0, *cut.tolist()], [*cut.tolist(), len(numbers)], strict=True):
            k = int(chunk[a])
            self._held.setdefault(k, []).append(
                (numbers[a:b], counts[a:b], itls[where[a]:where[b]]))
            self._finished[k] += b - a

    def _place(self, *, all_of_them: bool = False) -> None:
        """Each chunk whose requests have all finished (``all_of_them``: every chunk, its
        unfinished requests with no ITL), once those before it are placed: its ITLs appended
        in request order."""
        while self._next < len(self._bounds):
            k = self._next
            a, b = self._bounds[k]
            if self._finished[k] < b - a and not all_of_them:
                return
            pieces = self._held.pop(k, [])
            counts = np.zeros(b - a, np.int64)
            if pieces:
                numbers = np.concatenate([p[0] for p in pieces])
                got = np.concatenate([p[1] for p in pieces])
                counts[numbers - a] = got
                itls = np.concatenate([p[2] for p in pieces])
                self._itls.frombytes(memoryview(_runs_in(itls, got, np.argsort(numbers)))
                                     .cast("B"))
            base = self._itl_start[a]
            np.cumsum(counts, out=self._itl_start[a + 1:b + 1])
            self._itl_start[a + 1:b + 1] += base
            self._next += 1
            self._all_final = self._all_final and self._finished[k] == b - a
            if self._all_final and self.on_placed is not None:
                self.on_placed(a, b)

    def columns(self) -> TimesTable:
        """The table's columns as they stand, without ITLs: the rows of the chunks placed so
        far (``on_placed``) are final; the arrays are the table's (``table``) own."""
        return TimesTable(self._done, self._output_len, self._ttft, self._e2el, self._tpot,
                          self._chunks, np.zeros(0), np.zeros(len(self._done) + 1, np.int64))

    def table(self) -> TimesTable:
        """The table of every request (those never recorded: unfinished), made once: the
        recorder's arrays are handed over, so it records nothing more."""
        if self._itls is None:
            raise RuntimeError("TimesRecorder.table called twice: the table is made once")
        self._work_out()
        self._place(all_of_them=True)
        # a request never recorded has zeros (and a NaN TPOT) throughout
        itls = np.frombuffer(self._itls, dtype=float) if len(self._itls) else np.zeros(0)
        self._itls = None
        return TimesTable(self._done, self._output_len, self._ttft, self._e2el, self._tpot,
                          self._chunks, itls, self._itl_start)


def _runs_in(values: np.ndarray, counts: np.ndarray, order: np.ndarray) -> np.ndarray:
    """``values``, runs of ``counts`` each, with the runs put in ``order``."""
    return values[_run_index(_starts(counts)[:-1][order], counts[order])]


def _run_index(first: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The positions of runs one after another: first[i], first[i] + 1, ..., counts[i] of
    them, for each i in turn."""
    index = np.repeat(first - _starts(counts)[:-1], counts)
    index += np.arange(len(index))
    return index
