"""Result files written while a long run goes on (a simulation's requests.csv and steps.csv):
their rows given to worker processes (experiments.parallel_text) as they become final, their
text written into the files' temporary copies, which ``write_results`` completes and puts in
place with the other result files."""

from __future__ import annotations

import contextlib
import os
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from experiments.files import AtomicText
from experiments.parallel_text import Job, Texts, workers_for
from experiments.request_rows import RequestRows

if TYPE_CHECKING:
    from simulator.outcome import StepRows


class StreamedFile(AtomicText):
    """One result file written while a run goes on (its temporary copy, ``AtomicText``), and
    how many of its rows are given to the workers."""

    def __init__(self, path: Path, header: str) -> None:
        super().__init__(path, header)
        self.rows_given = 0  # rows 0..rows_given-1 are given to the workers


class StreamedRows:
    """requests.csv, and a simulation's steps.csv, written while a long run goes on: a chunk of
    requests.csv's rows is given to worker processes (experiments.parallel_text) as soon as its
    requests have all finished, with steps.csv's rows closed by then, and their text goes into
    the files' temporary copies, in order, once rendered. ``finish`` ends it as the simulation
    ends (the workers stopped: their memory is back before the metrics, the run's peak);
    ``write_results`` writes the rest and puts the files in place with the others. ``start``
    gives None where there would be no workers (too few rows, one CPU): the files are then
    written whole at the end. ``discard``, after an error, removes the copies and stops the
    workers."""

    BATCH_ROWS = 20_000  # requests.csv's rows given at a time, at least (steps.csv's: a fifth)

    def __init__(self, run_dir: Path, rows: RequestRows, texts: Texts,
                 steps: StepRows | None = None) -> None:
        self._rows, self.texts, self.step_rows = rows, texts, steps
        self.parallel = False  # whether its workers rendered rows (known once finished)
        self.requests = self.steps = None
        self._to: deque[StreamedFile] = deque()  # the file of each text given, in order
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.requests = StreamedFile(run_dir / "requests.csv", rows.header)
            if steps is not None:
                self.steps = StreamedFile(run_dir / "steps.csv", ",".join(steps.columns) + "\n")
        except BaseException:
            self.discard()
            raise
        self.rows_final = 0  # requests.csv's rows 0..rows_final-1 are final
        self.finished = False

    @classmethod
    def start(cls, run_dir: str | os.PathLike[str], rows: RequestRows,
              steps: StepRows | None = None) -> StreamedRows | None:
        """The stream of these rows into run_dir/requests.csv (and ``steps``, a simulation's
        StepRows as it appends them, into run_dir/steps.csv), its workers starting (without
        waiting for them), or None where there would be none."""
        workers = workers_for(len(rows))
        return cls(Path(run_dir), rows, Texts(workers), steps) if workers else None

    @property
    def rows_given(self) -> int:
        """requests.csv's rows 0..rows_given-1 are given to the workers."""
        return self.requests.rows_given

    def add(self, start: int, end: int) -> None:
        """requests.csv's rows start..end-1 are final (the next ones after those given before):
        given to the workers with those before them not given yet, BATCH_ROWS or more at a time
        (a job costs this process a few thread wakeups), and steps.csv's rows closed so far
        likewise; the texts rendered by now are written."""
        if self.finished:  # the rest is write_results'
            return
        if start != self.rows_final:
            raise ValueError(f"requests.csv's rows {start}..{end - 1} came after rows up to "
                             f"{self.rows_final - 1}")
        self.rows_final = end
        if end - self.requests.rows_given >= self.BATCH_ROWS and self.texts.parallel:
            # (where the workers could not start, the rows are left to be written at the end)
            self._give(self.requests, self._rows.job, end)
            if self.steps is not None \
                    and len(self.step_rows) - self.steps.rows_given >= self.BATCH_ROWS // 5:
                self._give(self.steps, self.step_rows.csv_job, len(self.step_rows))
        for text in self.texts.ready():
            self._to.popleft().write(text)

    def _give(self, to: StreamedFile, job: Callable[[int, int], Job], end: int) -> None:
        self.texts.put(job(to.rows_given, end))
        self._to.append(to)
        to.rows_given = end

    def finish(self) -> None:
        """No more rows are given: the texts of those given are written (waited for) and the
        workers stopped; each file's rows from its rows_given on are write_results'. Once."""
        if self.finished:
            return
        self.finished = True
        self.parallel = self.texts.parallel
        for text in self.texts.rest(()):
            self._to.popleft().write(text)
        self.texts.close()

    def discard(self) -> None:
        """After an error: the files' copies removed and the workers stopped (each, whichever
        fails); once."""
        with contextlib.ExitStack() as stack:
            stack.callback(self.texts.close)
            for streamed in (self.steps, self.requests):
                if streamed is not None:
                    stack.callback(streamed.discard)
