"""A long run's result text (requests.csv's rows, steps.csv's, result.json's per-request lists)
rendered a chunk of rows at a time, by this process and forked worker processes side by side
where there are many rows: formatting tens of millions of numbers is a 1M-request run's largest
cost after the simulation, and a chunk's text depends on its own rows alone.

A renderer is a callable (start, end) -> text over data the workers inherit when they fork
(numpy columns, preferably: a worker that reads Python objects bumps their reference counts and
so copies the pages they sit on); a job is (renderer number, start, end), and only it and the
text travel between processes. The text comes back in job order, a few jobs ahead at most. A
worker's memory is the pages it or this process writes after the fork: small chunks
(request_times.CHUNK_REQUESTS) keep it small, and one worker fewer than the CPUs, this process
rendering its share, keeps it to one worker's on two CPUs.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

Renderer = Callable[[int, int], str]
Job = tuple[int, int, int]  # (renderer number, first row, end row)

# Fewer rows than this are rendered in this process (forking the workers and gathering their
# text costs tens of milliseconds; 100k rows take about a second to render).
PARALLEL_MIN_ROWS = 100_000
MAX_PROCESSES = 4  # this one and its workers

_renderers: Sequence[Renderer] = ()  # what the workers find when they fork


def _render(job: Job) -> str:
    which, start, end = job
    return _renderers[which](start, end)


def num_workers() -> int:
    """Worker processes for a long run's text beside this one, which renders its share too: one
    per usable CPU but this one's (at most MAX_PROCESSES in all), or none where processes
    cannot fork (a forked worker inherits the run's data)."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(cpus or 1, MAX_PROCESSES) - 1


def rendered(renderers: Sequence[Renderer], jobs: Sequence[Job], rows: int) -> Iterator[str]:
    """Each job's text, in order: with ``rows`` (the run's requests) at PARALLEL_MIN_ROWS or
    more, by forked workers and this process in turn (one job in every workers + 1 is rendered
    here), else here alone. A renderer's error is raised here as it was raised there; closing
    the iterator early stops the workers."""
    workers = num_workers() if rows >= PARALLEL_MIN_ROWS else 0
    if not workers:
        for job in jobs:
            yield _here(renderers, job)
        return
    global _renderers
    _renderers = renderers  # the workers fork on the first submit, after this
    # a worker makes no reference cycles: without the collector it never walks (and so
    # copies) the objects it inherits
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                               initializer=gc.disable)
    try:
        queued = iter(enumerate(jobs))
        ahead: deque = deque()  # (job, its future; None: rendered here when its turn comes)

        def fill() -> None:
            while len(ahead) <= 2 * workers and (nxt := next(queued, None)) is not None:
                i, job = nxt
                ahead.append((job, None if i % (workers + 1) == 0
                              else pool.submit(_render, job)))

        fill()
        while ahead:
            job, future = ahead.popleft()
            fill()  # the workers go on while this one renders its share
            yield _here(renderers, job) if future is None else future.result()
    except BrokenProcessPool as err:
        raise RuntimeError("a process rendering the result files died (out of memory?); "
                           "set metrics.save_per_request=false or use fewer requests") from err
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        _renderers = ()


def _here(renderers: Sequence[Renderer], job: Job) -> str:
    which, start, end = job
    return renderers[which](start, end)
