"""A run's result files written while it goes on (requests.csv's and steps.csv's rows given to
their writers' threads as they become final) are the files written whole at its end, byte for
byte; a writer's failure is raised naming the file and leaves no file, and the cells are what
the csv module writes."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from experiments import request_times, result_files, result_text, streamed_files
from experiments.run import CONF_DIR, run
from simulator.outcome import StepRows

RUN = ["backend=sim", "workload=synthetic", "workload.num_prompts=60", "model=tiny",
       "hardware=cpu", "overhead=none", "progress=false", "metrics.save_per_request=true",
       "cluster.num_replicas=2", "router=round_robin"]


def _run(tmp_path, name: str, *more: str) -> dict[str, str]:
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=[*RUN, *more])
    run(cfg, tmp_path / name)
    files = {f: (tmp_path / name / f).read_text() for f in ("requests.csv", "steps.csv")}
    text = (tmp_path / name / "result.json").read_text()
    return {**files, "lists": text[text.index('"input_lens"'):text.index('"schedlab"')]}


@pytest.mark.parametrize("replicas", [2, 1])
def test_rows_written_as_the_run_goes_are_the_rows_written_at_its_end(tmp_path, monkeypatch,
                                                                      replicas):
    """requests.csv's rows given to its writer while the simulation runs (each chunk once its
    requests have all finished), and one replica's steps.csv rows with them, make the files
    that are written whole at the end, byte for byte, with the replica each request went to."""
    more = [f"cluster.num_replicas={replicas}"]
    monkeypatch.setattr(request_times, "CHUNK_REQUESTS", 7)
    monkeypatch.setattr(request_times.TimesRecorder, "PENDING", 5)  # chunks placed mid-run
    here = _run(tmp_path, "here", *more)  # BATCH_ROWS: every row written at the end
    monkeypatch.setattr(streamed_files.StreamedRows, "BATCH_ROWS", 10)
    given: list[int] = []
    steps_given: list[int] = []
    real_add = streamed_files.StreamedRows.add

    def add(self, start, end):
        real_add(self, start, end)
        given.append(self.rows_given)
        steps_given.append(self.steps_given)

    monkeypatch.setattr(streamed_files.StreamedRows, "add", add)
    there = _run(tmp_path, "streamed", *more)
    assert there == here
    assert 0 < max(given) < 60 and max(given) % 7 == 0  # given during the run, not all
    assert given[-1] == max(given)  # none given once finished (the rest: write_results')
    windows = here["steps.csv"].count("\n") - 1
    if replicas == 1:  # steps.csv's rows given too, not all (a cluster's: at its end)
        assert 0 < max(steps_given) < windows and steps_given[-1] == max(steps_given)
    else:
        assert not any(steps_given)
    assert not [t for t in threading.enumerate() if t.name.startswith("write ")]
    assert here["requests.csv"].splitlines()[1].split(",")[4] == "0"  # the t = 0 clock's int 0
    replica_column = {line.split(",")[11] for line in here["requests.csv"].splitlines()[1:]}
    assert replica_column == ({"0", "1"} if replicas == 2 else {"0"})


@pytest.mark.parametrize("name", ["requests.csv", "steps.csv"])
def test_a_full_disk_while_streaming_names_the_file(tmp_path, monkeypatch, name):
    """The writer's thread fails (a full disk, in pyarrow's words): the next call raises it
    in the OS's words, naming the file, and no copy is left."""
    rows = result_files.RequestRows([], None, request_times.TimesRecorder(0).columns())
    streamed = streamed_files.StreamedRows(tmp_path, rows, StepRows(False))
    assert sorted(n.split(".")[1] for n in os.listdir(tmp_path)) == ["requests", "steps"]
    file = streamed.requests if name == "requests.csv" else streamed.steps

    def full(columns):
        raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space "
                                    "left on device")

    monkeypatch.setattr(file, "_write", full)
    file.write([[]] * len(file.names))
    with pytest.raises(OSError, match=rf"^\[Errno 28\] No space left on device: '.*{name}'$"):
        streamed.complete(streamed.step_rows)
    assert not os.listdir(tmp_path)


def test_a_bad_cell_in_the_writers_thread_is_one_line_naming_file_and_column(tmp_path):
    file = result_text.CsvFile(tmp_path / "steps.csv", ["window", "note"])
    file.write([[1, 2], ["a", "b"]])
    file.write([[3], [object()]])
    with pytest.raises(ValueError) as raised:
        file.close()
    message = str(raised.value)
    assert "\n" not in message and "steps.csv" in message and "column note" in message
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("error", [ValueError("the run fails here"),
                                   OSError(errno.EIO, "the disk fails here")])
@pytest.mark.parametrize("replicas", [2, 1])
def test_a_run_failing_after_rows_were_streamed_leaves_no_file(tmp_path, monkeypatch, error,
                                                               replicas):
    """The run's own error is raised (an OSError too: not one naming requests.csv), its files'
    copies are removed (steps.csv's too, streamed with one replica)."""
    monkeypatch.setattr(request_times, "CHUNK_REQUESTS", 7)
    monkeypatch.setattr(request_times.TimesRecorder, "PENDING", 5)
    monkeypatch.setattr(streamed_files.StreamedRows, "BATCH_ROWS", 7)
    real_record = request_times.TimesRecorder.record

    def record(self, *args, **kwargs):
        if self.on_placed.__self__.rows_given > 0:  # once rows were given to the writer
            raise error
        real_record(self, *args, **kwargs)

    monkeypatch.setattr(request_times.TimesRecorder, "record", record)
    with pytest.raises(type(error)) as raised:
        _run(tmp_path, "broken", f"cluster.num_replicas={replicas}")
    assert raised.value is error
    assert not any(n.endswith((".csv", ".json", ".tmp")) for n in os.listdir(tmp_path / "broken"))


def test_a_failing_chunk_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setattr(request_times, "CHUNK_REQUESTS", 7)
    real_columns = result_files.RequestRows.columns

    def broken(self, start, end):  # the writer's thread is given a column it cannot write
        columns = real_columns(self, start, end)
        return [*columns[:-1], [f"rows {start}..", 0.5] * 4] if end > 21 else columns

    monkeypatch.setattr(result_files.RequestRows, "columns", broken)
    with pytest.raises(ValueError, match=r"requests.csv: result column num_cached_tokens"):
        _run(tmp_path, "broken")
    assert not any(n.endswith((".csv", ".json", ".tmp")) for n in os.listdir(tmp_path / "broken"))


def test_cells_are_the_csv_modules_whatever_the_values():
    """A column's cells are what the csv module writes of the values themselves: equal values
    keep their own text (0 and 0.0, 0.0 and -0.0), None and NaN are empty where the caller
    says so ("nan" elsewhere), and floats in every range pyarrow and Python write differently
    (no fraction, below 1e-4, from 1e10) are Python's."""
    import csv
    import io

    rng = np.random.default_rng(3)
    spread = (10 ** rng.uniform(-12, 22, 3000) * rng.choice([1, -1], 3000)).tolist()
    columns = [list(range(600)), [0.25] * 300 + [1 / 3] * 300, [0] * 300 + [0.0] * 300,
               [None] * 299 + [2.5] * 301, [float("nan")] * 400 + [0.125] * 200,
               [0.0] * 300 + [-0.0] * 300, spread[:600], [round(x) if abs(x) < 1e15 else x for x in spread[:600]],
               [1e-5, 2.5e-7, 1e16, 123456789012.5, float("inf"), -float("inf")] * 100,
               ["0.100000;0.200000"] * 600]
    # numpy columns too, among the lists: a batch's int columns and its float columns are
    # each written end to end in one go and cut apart, so each must keep its own cells
    ints, floats = np.arange(600) * 7 - 300, np.round(rng.uniform(-3, 3, 600), 1)
    empty = rng.random(600) < 0.3
    given = [*columns, ints, result_text.Numbers(floats, empty), np.array([1e-6, 2.0] * 300)]
    columns += [ints.tolist(), [None if e else x for x, e in zip(floats.tolist(), empty)],
                [1e-6, 2.0] * 300]
    names = [f"c{i}" for i in range(len(columns))]
    text = result_text.csv_text(names, given)
    expected = io.StringIO()
    writer = csv.writer(expected, lineterminator="\n")
    writer.writerow(names)
    writer.writerows(zip(*columns))
    assert text == expected.getvalue()
    # a column of many floats pyarrow writes otherwise (more than Python writes one by one)
    many = [*(np.arange(6000) * 0.5).tolist(), *(-np.arange(3000) * 1.0).tolist(), 1e-7, 1e12,
            -0.0, float("nan"), float("inf"), 0.1]
    assert result_text.number_text(np.array(many)).to_pylist() == list(map(str, many))
    mixed = [int(v) if i % 3 == 0 and v == int(v) else v for i, v in enumerate(many[:-4])]
    assert result_text.number_text(np.array(mixed, float), None, mixed).to_pylist() \
        == list(map(str, mixed))
    tpot = np.array([float("nan"), 0.125])
    assert result_text.number_text(tpot, np.isnan(tpot)).to_pylist() == [None, "0.125"]
    assert text.splitlines()[1].split(",")[3] == ""  # None
    # a disaggregated run's bools (HandoffLog.rejected) as str() writes them
    assert result_text.cells(np.array([True, False])).to_pylist() == ["True", "False"]


def test_steps_other_than_those_streamed_are_refused_and_leave_no_copy(tmp_path):
    rows = result_files.RequestRows([], None, request_times.TimesRecorder(0).columns())
    streamed = streamed_files.StreamedRows(tmp_path, rows, StepRows(False))
    with pytest.raises(ValueError, match="steps are not the rows streamed into steps.csv"):
        result_files.write_results(tmp_path, {}, [], {}, steps=StepRows(False), streamed=streamed)
    assert not os.listdir(tmp_path)


def test_a_run_killed_while_its_rows_are_written_leaves_no_requests_csv(tmp_path):
    """SIGKILL once rows were written as the run went: no requests.csv (whole or half), only
    its temporary copy, which the next run into the directory removes."""
    import subprocess
    import sys

    from experiments.files import stale_copies

    out = tmp_path / "killed"
    code = ("import os, signal\nfrom experiments import request_times, streamed_files as s\n"
            "request_times.CHUNK_REQUESTS = 7\nrequest_times.TimesRecorder.PENDING = 5\n"
            "s.StreamedRows.BATCH_ROWS = 7\nadd = s.StreamedRows.add\n"
            "def killing(self, a, b):\n    add(self, a, b)\n"
            "    if self.rows_given:\n        self.requests.wait()\n"
            "        os.kill(os.getpid(), signal.SIGKILL)\n"
            "s.StreamedRows.add = killing\nimport sys\nimport experiments.run as r\n"
            f"sys.argv = ['schedlab-run', *{RUN!r}, 'cluster.num_replicas=1', "
            f"'hydra.run.dir={out}']\nr.main()")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}, timeout=120)
    assert p.returncode == -9, p.stderr
    assert not (out / "requests.csv").exists() and not (out / "result.json").exists()
    copies = stale_copies(out / "requests.csv")
    assert len(copies) == 1 and copies[0].read_text().startswith("request_id,arrival_time")
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        run(compose("config", overrides=[*RUN, "cluster.num_replicas=1"]), out)
    assert (out / "requests.csv").exists() and not stale_copies(out / "requests.csv")
