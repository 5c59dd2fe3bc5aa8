"""A long run's result text (requests.csv's rows, steps.csv's, result.json's per-request lists)
rendered a chunk of rows at a time, by this process and worker processes side by side where
there are many rows: formatting tens of millions of numbers is a 1M-request run's largest cost
after the simulation, and a chunk's text depends on its own rows alone.

A job is a module-level function and its chunk's data (numpy slices, a few thousand rows),
which a worker receives pickled and renders; the text comes back in job order, a few jobs
ahead at most (``Texts.rest``). Rows that are final before the run ends (requests.csv's, in
a simulation) are given to the workers as they become final (``Texts.put``): they are
rendered beside the simulation rather than after it.

The workers start from a fresh process (``forkserver``), not as copies of this one: a copy
would share this process's pages until either side wrote to them, and both do as they
allocate, so a forked worker grows by the pages this process frees and reuses. One worker
fewer than the CPUs, this process rendering its share, keeps it to one worker on two CPUs.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

Job = tuple[Callable[..., str], tuple[Any, ...]]  # function, its arguments: the chunk's text

log = logging.getLogger(__name__)

# Fewer rows than this are rendered in this process: starting a worker and sending it the
# data would cost about as much as rendering them (the rendering's figures: BENCHMARKS.md).
PARALLEL_MIN_ROWS = 100_000
MAX_PROCESSES = 4  # this one and its workers
_START = "forkserver"
# what a worker imports before its first job (the renderers' modules)
_PRELOAD = ["experiments.request_rows", "experiments.result_files", "simulator.outcome"]


def num_workers() -> int:
    """Worker processes for a long run's text beside this one: one per usable CPU but this
    one's (at most MAX_PROCESSES in all), or none where a fresh process cannot be forked."""
    if _START not in multiprocessing.get_all_start_methods():
        return 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(cpus or 1, MAX_PROCESSES) - 1


def workers_for(rows: int) -> int:
    """Workers for a text of ``rows`` rows (a run's requests, or a simulation's windows): none
    below PARALLEL_MIN_ROWS, nor where a worker could not import this program's main module."""
    return num_workers() if rows >= PARALLEL_MIN_ROWS and _main_is_importable() else 0


class Texts:
    """Jobs' texts in the order the jobs come: given one by one as a run goes on (``put``:
    rendered by the workers, their texts taken as they are done, ``ready``), then the rest
    (``rest``: this process rendering its share). The workers start in the background, so
    that a run does not wait for them; with none (``workers`` 0, or where they cannot start)
    every job is rendered here when its text is asked for."""

    def __init__(self, workers: int) -> None:
        self._workers = workers
        self._pool: ProcessPoolExecutor | None = None
        self._failed: BaseException | None = None
        self._starting: threading.Thread | None = None
        if self._workers:
            self._starting = threading.Thread(target=self._start, daemon=True)
            self._starting.start()
        # (job, its future; None: rendered here when its turn comes), in order
        self._queue: deque[tuple[Job, Any]] = deque()

    def _start(self) -> None:
        try:
            self._pool = _start(self._workers)
        except BaseException as err:  # raised in the run's thread, when the pool is asked for
            self._failed = err

    def _started(self) -> ProcessPoolExecutor | None:
        self._join()
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed
        return self._pool

    def _join(self) -> None:
        if self._starting is not None:
            self._starting.join()
            self._starting = None

    @property
    def parallel(self) -> bool:
        """Whether workers render the jobs (waits for them to start)."""
        return self._started() is not None

    def put(self, job: Job) -> None:
        """A job, given to a worker now (where there is none: kept to be rendered here)."""
        pool = self._started()
        self._queue.append((job, None if pool is None else self._submit(pool, job)))

    def ready(self) -> Iterator[str]:
        """The texts at the head of the order that workers have done; none is waited for."""
        queue = self._queue
        while queue and queue[0][1] is not None and queue[0][1].done():
            yield self._result(queue.popleft()[1])

    def rest(self, jobs: Iterable[Job]) -> Iterator[str]:
        """Every text not taken yet, in order: the jobs given so far, then ``jobs``' (taken a
        few ahead of the text asked for, one in every workers + 1 rendered here)."""
        pool, queue = self._started(), self._queue
        taken = iter(enumerate(jobs))
        workers = self._workers if pool is not None else 0

        def fill() -> None:
            while len(queue) <= 2 * workers and (nxt := next(taken, None)) is not None:
                i, job = nxt
                queue.append((job, None if pool is None or i % (workers + 1) == 0
                              else self._submit(pool, job)))

        fill()
        while queue:
            (fn, args), future = queue.popleft()
            fill()  # the workers go on while this one renders its share
            yield fn(*args) if future is None else self._result(future)

    @staticmethod
    def _submit(pool: ProcessPoolExecutor, job: Job) -> Any:
        try:
            return pool.submit(job[0], *job[1])
        except BrokenProcessPool as err:
            raise _broken(err) from err

    @staticmethod
    def _result(future: Any) -> str:
        try:
            return future.result()
        except BrokenProcessPool as err:
            raise _broken(err) from err

    def close(self) -> None:
        """Stop the workers (the jobs not done are dropped); a failure to start them is not
        raised here (an error being handled is the one to report)."""
        self._join()
        pool = self._pool
        self._queue.clear()
        self._pool = None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _broken(err: BrokenProcessPool) -> RuntimeError:
    return RuntimeError(f"a worker process rendering the result files exited unexpectedly "
                        f"({err}); its error, if any, is on stderr above")


def _start(workers: int) -> ProcessPoolExecutor | None:
    """A pool of ``workers`` started (its first worker asked for), or None where it cannot
    start (a forkserver's socket path too long for this system's temporary directory...)."""
    context = multiprocessing.get_context(_START)
    context.set_forkserver_preload(_PRELOAD)
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_exit_with_parent)
    try:
        pool.submit(int)  # starts the forkserver and a worker, or fails here
    except (OSError, BrokenProcessPool) as err:
        pool.shutdown(wait=False, cancel_futures=True)
        log.warning("rendering the result files in one process: its workers cannot start (%s)",
                    err)
        return None
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    return pool


def _main_is_importable() -> bool:
    """Whether a worker may import this program's main module (each does, as multiprocessing's
    fresh processes do): a module run with ``python -m`` (its ``if __name__ == "__main__"``
    guard is the custom) or no file at all, not a script, which would run again in each."""
    main = sys.modules.get("__main__")
    return getattr(main, "__spec__", None) is not None or getattr(main, "__file__", None) is None


def _exit_with_parent() -> None:
    """A worker's initializer: it exits when the run's process does, killed or not (a worker
    would otherwise wait for jobs for ever), and leaves Ctrl-C to the run (a terminal sends it
    to every process of the run: the run says in one line that it was interrupted, and its
    workers end with it). SIGTERM still ends it: the pool stops a broken worker's siblings so."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
