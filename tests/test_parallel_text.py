"""A long run's result files rendered by worker processes beside the run's own are the files
rendered in one process, byte for byte, and a worker's failure is raised and leaves no file."""

from __future__ import annotations

import errno
import multiprocessing
import os
import signal
from concurrent.futures import ProcessPoolExecutor

import pytest
from hydra import compose, initialize_config_dir

from experiments import parallel_text, request_rows, request_times, result_files, streamed_files
from experiments.run import CONF_DIR, run
from simulator.outcome import StepRows

RUN = ["backend=sim", "workload=synthetic", "workload.num_prompts=60", "model=tiny",
       "hardware=cpu", "overhead=none", "progress=false", "metrics.save_per_request=true",
       "cluster.num_replicas=2", "router=round_robin"]

needs_workers = pytest.mark.skipif(not parallel_text.num_workers(),
                                   reason="needs two CPUs and a forkserver")


def _run(tmp_path, name: str, *more: str) -> dict[str, str]:
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=[*RUN, *more])
    run(cfg, tmp_path / name)
    files = {f: (tmp_path / name / f).read_text() for f in ("requests.csv", "steps.csv")}
    text = (tmp_path / name / "result.json").read_text()
    return {**files, "lists": text[text.index('"input_lens"'):text.index('"schedlab"')]}


class _Counting(ProcessPoolExecutor):
    submitted = 0

    def submit(self, *args, **kwargs):
        _Counting.submitted += 1
        return super().submit(*args, **kwargs)


@needs_workers
def test_workers_write_the_files_one_process_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(request_times, "CHUNK_REQUESTS", 7)  # many chunks, some empty lists
    here = _run(tmp_path, "here")
    monkeypatch.setattr(parallel_text, "PARALLEL_MIN_ROWS", 1)
    monkeypatch.setattr(parallel_text, "ProcessPoolExecutor", _Counting)
    there = _run(tmp_path, "workers")
    # 9 chunks of requests.csv, steps.csv's and 8 lists' of 9: the workers took their share
    assert 0 < _Counting.submitted < 9 * 9 + 1
    assert there == here
    assert here["steps.csv"].count("\n") > 10 and '"itls": [[' in here["lists"]
    # a time as the request holds it: the first scheduled at the t = 0 clock's int 0 reads 0
    assert here["requests.csv"].splitlines()[1].split(",")[4] == "0"


@needs_workers
@pytest.mark.parametrize("replicas", [2, 1])
def test_rows_written_as_the_run_goes_are_the_rows_written_at_its_end(tmp_path, monkeypatch,
                                                                      replicas):
    """requests.csv's rows given to the workers while the simulation runs (each chunk once its
    requests have all finished), and one replica's steps.csv rows with them, make the files
    that are written whole at the end, byte for byte, with the replica each request went to."""
    more = [f"cluster.num_replicas={replicas}"]
    monkeypatch.setattr(request_times, "CHUNK_REQUESTS", 7)
    monkeypatch.setattr(request_times.TimesRecorder, "PENDING", 5)  # chunks placed mid-run
    here = _run(tmp_path, "here", *more)  # 60 rows: too few to stream
    monkeypatch.setattr(parallel_text, "PARALLEL_MIN_ROWS", 1)
    monkeypatch.setattr(streamed_files.StreamedRows, "BATCH_ROWS", 10)
    given: list[int] = []
    steps_given: list[int] = []
    real_add, real_finish = streamed_files.StreamedRows.add, streamed_files.StreamedRows.finish
    workers_after_finish = []

    def add(self, start, end):
        real_add(self, start, end)
        given.append(self.rows_given)
        steps_given.append(self.steps.rows_given if self.steps is not None else 0)

    def finish(self):
        real_finish(self)
        workers_after_finish.append(len(multiprocessing.active_children()))

    monkeypatch.setattr(streamed_files.StreamedRows, "add", add)
    monkeypatch.setattr(streamed_files.StreamedRows, "finish", finish)
    there = _run(tmp_path, "streamed", *more)
    assert there == here
    assert 0 < max(given) < 60 and max(given) % 7 == 0  # given during the run, not all
    assert given[-1] == max(given)  # none given once finished (the rest: write_results')
    windows = here["steps.csv"].count("\n") - 1
    if replicas == 1:  # steps.csv's rows given too, not all (a cluster's: at its end)
        assert 0 < max(steps_given) < windows and steps_given[-1] == max(steps_given)
    else:
        assert not any(steps_given)
    # the stream ends with the simulation, its workers stopped before the metrics
    assert workers_after_finish[0] == 0 and len(workers_after_finish) == 2
    replica_column = {line.split(",")[11] for line in here["requests.csv"].splitlines()[1:]}
    assert replica_column == ({"0", "1"} if replicas == 2 else {"0"})


@pytest.mark.parametrize("name", ["requests.csv", "steps.csv"])
def test_a_full_disk_while_streaming_names_the_file(tmp_path, name):
    rows = result_files.RequestRows([], None, request_times.TimesRecorder(0).columns())
    streamed = streamed_files.StreamedRows(tmp_path, rows, parallel_text.Texts(0), StepRows(False))
    assert sorted(n.split(".")[1] for n in os.listdir(tmp_path)) == ["requests", "steps"]

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    file = streamed.requests if name == "requests.csv" else streamed.steps
    file.file = Full()
    with pytest.raises(OSError, match=rf"No space left on device: '.*{name}'"):
        file.write("0,0.0\n")
    streamed.discard()
    assert not os.listdir(tmp_path)


@needs_workers
@pytest.mark.parametrize("error", [ValueError("the run fails here"),
                                   OSError(errno.EIO, "the disk fails here")])
@pytest.mark.parametrize("replicas", [2, 1])
def test_a_run_failing_after_rows_were_streamed_leaves_no_file(tmp_path, monkeypatch, error,
                                                               replicas):
    """The run's own error is raised (an OSError too: not one naming requests.csv), its files'
    copies are removed (steps.csv's too, streamed with one replica) and its workers are
    stopped."""
    monkeypatch.setattr(request_times, "CHUNK_REQUESTS", 7)
    monkeypatch.setattr(request_times.TimesRecorder, "PENDING", 5)
    monkeypatch.setattr(parallel_text, "PARALLEL_MIN_ROWS", 1)
    monkeypatch.setattr(streamed_files.StreamedRows, "BATCH_ROWS", 7)
    real_record = request_times.TimesRecorder.record

    def record(self, *args, **kwargs):
        if self.on_placed.__self__.rows_given > 0:  # once rows were given to the workers
            raise error
        real_record(self, *args, **kwargs)

    monkeypatch.setattr(request_times.TimesRecorder, "record", record)
    with pytest.raises(type(error)) as raised:
        _run(tmp_path, "broken", f"cluster.num_replicas={replicas}")
    assert raised.value is error
    assert not any(n.endswith((".csv", ".json", ".tmp")) for n in os.listdir(tmp_path / "broken"))
    assert not multiprocessing.active_children()


@needs_workers
def test_workers_leave_ctrl_c_to_the_run():
    """A terminal's Ctrl-C reaches every process of the run: a worker ignores it (the run says
    in one line that it was interrupted, and its workers end with it)."""
    texts = parallel_text.Texts(1)
    try:
        assert texts.parallel
        texts.put((signal.getsignal, (signal.SIGINT,)))
        assert list(texts.rest([])) == [signal.SIG_IGN]
    finally:
        texts.close()


@needs_workers
def test_a_job_failing_in_a_worker_is_raised_there(monkeypatch):
    monkeypatch.setattr(parallel_text, "PARALLEL_MIN_ROWS", 1)
    jobs = [(str, (1,)), (int, ("not a number",)), (str, (3,))]  # the second goes to a worker
    texts = parallel_text.Texts(parallel_text.workers_for(3))
    with pytest.raises(ValueError, match="not a number"):
        list(texts.rest(jobs))
    texts.close()
    texts = parallel_text.Texts(parallel_text.workers_for(5))
    assert list(texts.rest([(str, (i,)) for i in range(5)])) == ["0", "1", "2", "3", "4"]
    texts.close()


@needs_workers
def test_a_failing_chunk_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setattr(request_times, "CHUNK_REQUESTS", 7)
    monkeypatch.setattr(parallel_text, "PARALLEL_MIN_ROWS", 1)
    real_job = result_files.RequestRows.job

    def broken(self, start, end):  # the worker is given a job that fails
        return (int, (f"rows {start}..",)) if end > 21 else real_job(self, start, end)

    monkeypatch.setattr(result_files.RequestRows, "job", broken)
    with pytest.raises(ValueError, match=r"rows \d+\.\."):
        _run(tmp_path, "broken")
    assert not any(n.endswith((".csv", ".json", ".tmp")) for n in os.listdir(tmp_path / "broken"))


def test_request_rows_are_the_csv_modules_cells_whatever_repeats():
    """A chunk's cells, its repeated values made once, are what the csv module writes of the
    values themselves: equal values keep their own text (0 and 0.0, 0.0 and -0.0), None and
    NaN are empty where their column says so ("nan" elsewhere), an unfinished request's times
    too."""
    import csv
    import io

    import numpy as np

    n = 600
    repeated = [0.25] * 300 + [1 / 3] * 300  # a window's requests share their times
    mixed = [0] * 300 + [0.0] * 300  # equal, of two types
    with_none = [None] * 299 + [2.5] * 301
    tpot = [float("nan")] * 400 + [0.125] * 200
    done = np.ones(n, bool)
    done[[5, 450]] = False
    signed = [0.0] * 300 + [-0.0] * 300  # equal, of one type: each keeps its sign
    columns = [(list(range(n)), ""), (repeated, ""), (mixed, ""), (with_none, "none"),
               (np.array(repeated), "done"), (np.array(tpot), "nan"), (signed, ""),
               (signed[::-1], ""), (np.array(tpot), "done")]
    text = request_rows._request_rows_text(columns, done)
    expected = io.StringIO()
    writer = csv.writer(expected, lineterminator="\n")
    for i in range(n):
        writer.writerow([i, repeated[i], mixed[i], "" if with_none[i] is None else with_none[i],
                         repeated[i] if done[i] else "", "" if tpot[i] != tpot[i] else tpot[i],
                         signed[i], signed[::-1][i], tpot[i] if done[i] else ""])
    assert text == expected.getvalue()
    assert text.splitlines()[0] == "0,0.25,0,,0.25,,0.0,-0.0,nan"
    assert text.splitlines()[599].split(",")[2] == "0.0"


def test_steps_other_than_those_streamed_are_refused_and_leave_no_copy(tmp_path):
    rows = result_files.RequestRows([], None, request_times.TimesRecorder(0).columns())
    streamed = streamed_files.StreamedRows(tmp_path, rows, parallel_text.Texts(0), StepRows(False))
    with pytest.raises(ValueError, match="steps are not the rows streamed into steps.csv"):
        result_files.write_results(tmp_path, {}, [], {}, steps=StepRows(False), streamed=streamed)
    assert not os.listdir(tmp_path)
