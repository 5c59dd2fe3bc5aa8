"""A long run's result text (requests.csv's rows, steps.csv's, result.json's per-request lists)
rendered a chunk of rows at a time, by forked worker processes side by side where there are
many rows: formatting tens of millions of numbers is a 1M-request run's largest cost after the
simulation, and a chunk's text depends on its own rows alone.

A renderer is a callable (start, end) -> text over data the workers inherit when they fork
(numpy columns, preferably: a worker that reads Python objects bumps their reference counts and
so copies the pages they sit on); a job is (renderer number, start, end), and only it and the
text travel between processes. The text comes back in job order, a few jobs ahead at most."""

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
MAX_WORKERS = 4

_renderers: Sequence[Renderer] = ()  # what the workers find when they fork


def _render(job: Job) -> str:
    which, start, end = job
    return _renderers[which](start, end)


def num_workers() -> int:
    """Worker processes for a long run's text: one per usable CPU (up to MAX_WORKERS), or
    none where processes cannot fork (a forked worker inherits the run's data)."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(cpus or 1, MAX_WORKERS) if (cpus or 1) > 1 else 0


def rendered(renderers: Sequence[Renderer], jobs: Sequence[Job], rows: int) -> Iterator[str]:
    """Each job's text, in order: by forked workers when ``rows`` (the run's requests) reach
    PARALLEL_MIN_ROWS and there are CPUs for them, else here. A renderer's error is raised
    here as it was raised there; closing the iterator early stops the workers."""
    workers = num_workers() if rows >= PARALLEL_MIN_ROWS else 0
    if not workers:
        for which, start, end in jobs:
            yield renderers[which](start, end)
        return
    global _renderers
    _renderers = renderers  # the workers fork on the first submits, after this
    # a worker makes no reference cycles: without the collector it never walks (and so
    # copies) the objects it inherits
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                               initializer=gc.disable)
    try:
        ahead: deque = deque()
        for job in jobs:
            ahead.append(pool.submit(_render, job))
            if len(ahead) > 2 * workers:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()
    except BrokenProcessPool as err:
        raise RuntimeError("a process rendering the result files died (out of memory?); "
                           "set metrics.save_per_request=false or use fewer requests") from err
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        _renderers = ()
