"""requests.csv and a simulation's steps.csv written while a long run goes on: their rows given
to the files' writers (experiments.result_text.CsvFile, a thread each) as they become final,
into the files' temporary copies, which ``write_results`` completes and puts in place with the
other result files."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from experiments.request_rows import RequestRows
from experiments.result_text import CsvFile

if TYPE_CHECKING:
    from simulator.outcome import StepRows


class StreamedRows:
    """requests.csv, and a simulation's steps.csv, written as a run goes on: a chunk of
    requests.csv's rows is given to its writer as soon as its requests have all finished
    (``add``), with steps.csv's rows closed by then; ``finish`` ends it as the simulation ends
    (what was given written); ``complete`` writes the rest and puts the files in place.
    ``discard``, after an error, removes the copies."""

    BATCH_ROWS = 20_000  # requests.csv's rows given at a time, at least (steps.csv's: a fifth)

    def __init__(self, run_dir: str | os.PathLike[str], rows: RequestRows,
                 steps: StepRows | None = None) -> None:
        self._rows, self.step_rows = rows, steps
        self.requests: CsvFile | None = None
        self.steps: CsvFile | None = None
        self.rows_given = self.steps_given = 0  # rows 0..*_given-1 are given to the writers
        try:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            self.requests = CsvFile(Path(run_dir) / "requests.csv", rows.names)
            if steps is not None:
                self.steps = CsvFile(Path(run_dir) / "steps.csv", steps.columns)
        except BaseException:
            self.discard()
            raise
        self.rows_final = 0  # requests.csv's rows 0..rows_final-1 are final
        self.finished = False

    def add(self, start: int, end: int) -> None:
        """requests.csv's rows start..end-1 are final (the next ones after those given before):
        given to its writer with those before them not given yet, BATCH_ROWS or more at a
        time, and steps.csv's rows closed so far likewise."""
        if self.finished:  # the rest is complete()'s
            return
        if start != self.rows_final:
            raise ValueError(f"requests.csv's rows {start}..{end - 1} came after rows up to "
                             f"{self.rows_final - 1}")
        self.rows_final = end
        if end - self.rows_given >= self.BATCH_ROWS:
            self._give_rows(end)
            if self.steps is not None \
                    and len(self.step_rows) - self.steps_given >= self.BATCH_ROWS // 5:
                self._give_steps()

    def _give_rows(self, end: int) -> None:
        for a in range(self.rows_given, end, self.BATCH_ROWS):
            self.requests.write(self._rows.columns(a, min(a + self.BATCH_ROWS, end)))
        self.rows_given = end

    def _give_steps(self) -> None:
        end = len(self.step_rows)
        self.steps.write(self.step_rows.columns_of(self.steps_given, end))
        self.steps_given = end

    def finish(self) -> None:
        """No more rows are given as the run goes (the rest: ``complete``'s). Once."""
        self.finished = True

    def complete(self, steps: StepRows | None) -> None:
        """Every row written (those not given yet now) and the files put in place; ``steps``:
        the run's steps (simulator.outcome.StepRows; None: no steps.csv), refused where they
        are not the rows streamed into steps.csv."""
        try:
            if self.steps is None and steps is not None:  # steps.csv written whole here
                self.step_rows = steps
                self.steps = CsvFile(self.requests.path.with_name("steps.csv"), steps.columns)
            elif steps is not self.step_rows:
                raise ValueError("write_results: steps are not the rows streamed into steps.csv")
            self.finished = True
            if len(self._rows) > self.rows_given:
                self._give_rows(len(self._rows))
            if self.steps is not None and len(self.step_rows) > self.steps_given:
                self._give_steps()
            files = [f for f in (self.requests, self.steps) if f is not None]
            for file in files:  # both written before either is put in place
                file.wait()
            for file in files:
                file.close()
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        """After an error: the files' copies removed (each, whichever fails); once."""
        with contextlib.ExitStack() as stack:
            for file in (self.steps, self.requests):
                if file is not None:
                    stack.callback(file.discard)
