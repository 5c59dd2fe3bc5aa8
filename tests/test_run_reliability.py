"""Runs and sweeps never mix or lose results: run directories are named by what changes a
result, written as one unit, unique by default, one command at a time; re-runs replace or skip
in place; unwritable outputs, Ctrl-C and a killed sweep end cleanly, with one-line errors."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml
from hydra import compose, initialize_config_dir

from experiments.run import CONF_DIR, run
from experiments.run_dir import (
    CONTROL_KEYS,
    STAMP_KEY,
    claim,
    config_stamp,
    finished,
    record,
    release,
)

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["backend=sim", "workload=synthetic", "workload.num_prompts=8", "model=tiny", "hardware=cpu",
         "overhead=none", "progress=false"]
LONG = ["workload=synthetic", "workload.num_prompts=40000", "hardware=h200", "progress=false"]
RESULTS = ("result.json", "requests.csv", "steps.csv")


def _default_ctrl_c(then: Callable[[], Any] | None = None) -> Callable[[], None]:
    """What the child runs before it starts: Ctrl-C's default disposition, so that Python makes
    it a KeyboardInterrupt there even when this process (a test worker) ignores it (Python
    keeps an ignored SIGINT ignored in the processes it starts); then ``then``, a caller's."""
    def before() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if then is not None:
            then()
    return before


def cli(*args: str, cwd: Path = ROOT, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, preexec_fn=_default_ctrl_c())


def popen(*args: str, cwd: Path = ROOT, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    kw["preexec_fn"] = _default_ctrl_c(kw.get("preexec_fn"))
    return subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def one_line_error(p: subprocess.CompletedProcess, code: int = 2) -> str:
    assert p.returncode == code, (p.returncode, p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    return lines[0]


def composed(*overrides: str, hydra: bool = False):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra)


def mtimes(root: Path) -> dict[str, int]:
    return {p.parent.name: p.stat().st_mtime_ns for p in root.rglob("result.json")}


# --- 1. control keys name no run directory ---------------------------------------------------

def test_control_keys_name_no_run_directory():
    conf = yaml.safe_load((ROOT / "conf/config.yaml").read_text())
    assert set(CONTROL_KEYS) <= set(conf["hydra"]["job"]["config"]["override_dirname"]["exclude_keys"])
    cfg = composed("+skip_existing=true", "++progress=false", "policy.num_steps=2", hydra=True)
    assert cfg.hydra.job.override_dirname == "policy.num_steps=2"
    cfg = composed("+experiment=steps_sweep", "skip_existing=false", "policy.num_steps=2", hydra=True)
    assert cfg.hydra.job.override_dirname == "+experiment=steps_sweep,policy.num_steps=2"


def test_rerunning_steps_sweep_replaces_or_skips_each_run_in_place(tmp_path):
    """skip_existing=false replaces (the table keeps one row per run); skip_existing=true skips
    only runs whose result is stamped with this config; a run of another config is redone."""
    sweep = tmp_path / "sweep"
    args = ["-m", "experiments.run", "-m", "+experiment=steps_sweep", f"hydra.sweep.dir={sweep}",
            "policy=multi_step", "policy.num_steps=1,4", "scheduler.overlap=false", *SMALL,
            "hydra.launcher.n_jobs=1"]
    p = cli(*args)
    assert p.returncode == 0, p.stderr[-2000:]
    first = mtimes(sweep)
    assert len(first) == 2 and len(pd.read_csv(sweep / "aggregate.csv")) == 2
    k4 = next(sweep.glob("*policy.num_steps=4*"))
    (k4 / "result.json").write_text(json.dumps({"request_throughput": 99.0}))  # not this config's
    record(k4, ["result.json"])  # as an older schedlab would have written it
    p = cli(*args)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.count("skipping") == 1
    second = mtimes(sweep)
    assert second[k4.name] != first[k4.name] and len(second) == 2
    assert {k: v for k, v in second.items() if k != k4.name} == \
        {k: v for k, v in first.items() if k != k4.name}
    assert json.loads((k4 / "result.json").read_text())["request_throughput"] != 99.0
    p = cli(*args, "skip_existing=false")
    assert p.returncode == 0, p.stderr[-2000:]
    third = mtimes(sweep)
    assert third.keys() == first.keys() and all(third[k] != second[k] for k in third)
    df = pd.read_csv(sweep / "aggregate.csv")
    assert len(df) == 2 and sorted(df["k"]) == [1, 4]
    assert len(pd.read_parquet(sweep / "aggregate.parquet")) == 2


def test_plain_sweep_resumes_with_skip_existing_and_fails_loudly_on_a_bad_result(tmp_path):
    """+skip_existing=true after a plain sweep skips its runs (no second set of directories);
    an unreadable result.json below the sweep fails the multirun, names the file, and the old
    tables are removed."""
    args = ["-m", "experiments.run", "-m", "policy.num_steps=1,2", *SMALL,
            f"hydra.sweep.dir={tmp_path}"]
    assert cli(*args).returncode == 0
    first = mtimes(tmp_path)
    p = cli(*args, "+skip_existing=true")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.count("skipping") == 2 and mtimes(tmp_path) == first
    assert len(pd.read_csv(tmp_path / "aggregate.csv")) == 2
    bad = tmp_path / "stray" / "result.json"
    bad.parent.mkdir()
    bad.write_text('{"request_throughput": 1')  # truncated
    p = cli(*args, "+skip_existing=true")
    assert p.returncode != 0
    assert str(bad) in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "aggregate.csv").exists()
    assert not (tmp_path / "aggregate.parquet").exists()


# --- 2. a run directory's files come from one run --------------------------------------------

def test_a_rerun_with_a_bad_setting_keeps_the_previous_results(tmp_path):
    """A re-run's settings are checked before its run directory is touched: a typo (here an
    unknown sim backend key) is one line and the previous run's results stay as they were (its
    result.json keeps its own config's stamp, so skip_existing is not fooled)."""
    out = tmp_path / "run"
    run(composed(*SMALL), out)  # the previous run (in this process: only the re-run is the CLI's)
    before = {name: (out / name).read_bytes() for name in RESULTS}
    p = cli("-m", "experiments.run", *SMALL, "+backend.time_scal=2", f"hydra.run.dir={out}")
    line = one_line_error(p)
    assert "'time_scal'" in line and "time_scale" in line and "stream_per_step" in line
    assert {name: (out / name).read_bytes() for name in RESULTS} == before


def test_finished_needs_a_result_stamped_with_this_config(tmp_path):
    cfg = composed(*SMALL)
    stamp = config_stamp(cfg)
    assert not finished(tmp_path, stamp)  # no result
    assert config_stamp(composed(*SMALL[:-1], "progress=true", "+skip_existing=true")) == stamp
    assert config_stamp(composed(*SMALL, "policy.num_steps=2")) != stamp
    run(cfg, tmp_path)
    assert json.loads((tmp_path / "result.json").read_text())["schedlab"][STAMP_KEY] == stamp
    assert finished(tmp_path, stamp)
    assert not finished(tmp_path, config_stamp(composed(*SMALL, "workload.num_prompts=9")))
    (tmp_path / "result.json").write_text('{"request_throughput": 1.0, "schedlab": {}}')
    assert not finished(tmp_path, stamp)  # unstamped (an older run, or another tool's)
    (tmp_path / "result.json").write_bytes(b"\xff\x00")
    assert not finished(tmp_path, stamp)  # unreadable


def test_result_files_are_written_as_one_unit(tmp_path, monkeypatch):
    from experiments import result_files

    cfg = composed(*SMALL)
    run(cfg, tmp_path)
    real = result_files.atomic_text_file

    def interrupted(path):
        if Path(path).name == "result.json":  # the last file, written after the others
            raise KeyboardInterrupt
        return real(path)

    monkeypatch.setattr(result_files, "atomic_text_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(cfg, tmp_path)
    assert not any((tmp_path / name).exists() for name in RESULTS)  # neither old nor half new
    assert not list(tmp_path.glob(".*.tmp"))
    monkeypatch.setattr(result_files, "atomic_text_file", real)
    (tmp_path / "steps.csv").write_text("stale\n")
    result_files.write_results(tmp_path, {"request_throughput": 1.0}, [], {})  # no steps
    assert not (tmp_path / "steps.csv").exists()


# --- 3. default directories are unique --------------------------------------------------------

def test_runs_started_together_get_their_own_default_directories(tmp_path):
    conf = yaml.safe_load((ROOT / "conf/config.yaml").read_text())
    assert "${pid:}" in conf["hydra"]["run"]["dir"] and "${pid:}" in conf["hydra"]["sweep"]["dir"]
    procs = [popen("-m", "experiments.run", *SMALL, cwd=tmp_path) for _ in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
    dirs = sorted(tmp_path.glob("outputs/*/*"))
    assert len(dirs) == 2 and all((d / "result.json").exists() for d in dirs)
    assert {d.name.rsplit("-", 1)[1] for d in dirs} == {str(p.pid) for p in procs}


# --- 4. one command per run directory -----------------------------------------------------------

def test_a_run_directory_in_use_is_refused(tmp_path):
    out = tmp_path / "run"
    holder = popen("-c", "import sys, time\nfrom experiments.run_dir import claim\n"
                   f"claim({str(out)!r})\nprint('held', flush=True)\ntime.sleep(60)")
    try:
        assert holder.stdout.readline().strip() == "held"
        p = cli("-m", "experiments.run", *SMALL, f"hydra.run.dir={out}")
        line = one_line_error(p)
        assert "in use by another run" in line and f"pid {holder.pid}" in line
        assert not (out / ".hydra").exists() and not (out / "result.json").exists()
    finally:
        holder.kill()
        holder.wait()
    path = claim(out)  # the holder's exit released it
    release(path)


# --- unwritable outputs, Ctrl-C, full disk, killed sweeps ---------------------------------------

def _read_only_dir(tmp_path: Path) -> Path:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        (ro / "probe").touch()
    except PermissionError:
        return ro
    pytest.skip("this user writes into read-only directories (root)")


def test_an_unusable_run_or_sweep_directory_is_a_one_line_error(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    line = one_line_error(cli("-m", "experiments.run", *SMALL, f"hydra.run.dir={a_file}"))
    assert line.startswith("error:") and str(a_file) in line and "not a directory" in line
    line = one_line_error(cli("-m", "experiments.run", "-m", "policy.num_steps=1,2", *SMALL,
                              f"hydra.sweep.dir={a_file}"))
    assert "hydra.sweep.dir" in line and str(a_file) in line
    ro = _read_only_dir(tmp_path)
    line = one_line_error(cli("-m", "experiments.run", *SMALL, f"hydra.run.dir={ro}"))
    assert str(ro) in line and "cannot write" in line


def test_aggregate_and_plot_output_errors_are_one_line(tmp_path, monkeypatch, capsys):
    from experiments import aggregate as agg
    from experiments import plot

    sweep = tmp_path / "sweep"
    run(composed(*SMALL), sweep / "a")
    run(composed(*SMALL, "policy.num_steps=2"), sweep / "b")
    table = tmp_path / "table.csv"
    agg.aggregate(sweep).to_csv(table, index=False)
    a_file = tmp_path / "file"
    a_file.write_text("")
    (sweep / "aggregate.parquet").unlink()
    (sweep / "aggregate.parquet").mkdir()  # the parquet cannot be written
    cases = [(agg.main, [str(sweep)], "aggregate.parquet"),
             (agg.main, [str(a_file)], str(a_file)),
             (plot.main, [str(table), "--out", str(a_file)], str(a_file)),
             (plot.main, [str(table), "--out", str(a_file / "figures")], str(a_file))]
    for main, argv, needle in cases:
        monkeypatch.setattr(sys, "argv", ["prog", *argv])
        with pytest.raises(SystemExit) as exit_:
            main()
        assert exit_.value.code == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and needle in err[0], err
    assert not (sweep / "aggregate.csv").exists()  # never out of step with the parquet


def test_aggregate_tables_are_written_as_a_pair(tmp_path, monkeypatch):
    from experiments import aggregate as agg

    run(composed(*SMALL), tmp_path / "a")
    agg.aggregate(tmp_path)
    assert len(pd.read_csv(tmp_path / "aggregate.csv")) == 1

    def no_parquet(self, *args, **kwargs):
        raise OSError("parquet writer unavailable")

    monkeypatch.setattr(pd.DataFrame, "to_parquet", no_parquet)
    with pytest.raises(OSError):
        agg.aggregate(tmp_path)
    assert not (tmp_path / "aggregate.csv").exists() and not (tmp_path / "aggregate.parquet").exists()
    assert not list(tmp_path.glob(".aggregate*"))


def test_ctrl_c_is_one_line_and_leaves_no_result(tmp_path):
    out = tmp_path / "run"
    run(composed(*SMALL), out)  # the earlier results the interrupted run must remove
    # Ctrl-C's default action in the run, even where the suite itself was started with SIGINT
    # ignored (a shell's background job), which a child would inherit
    p = popen("-m", "experiments.run", *LONG, f"hydra.run.dir={out}",
              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    # until the run has started (its overrides written, the old results gone), however loaded
    # the machine
    while "num_prompts=40000" not in _text(out / ".hydra" / "overrides.yaml") \
            or any((out / name).exists() for name in RESULTS):
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.05)
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert err.strip().splitlines() == ["interrupted: no result written"]
    assert not any((out / name).exists() for name in RESULTS)  # the old ones went too
    assert not list(out.glob(".*.tmp"))


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


# --- the last instant of a run: its message and its directory agree --------------------------

ALL_RESULTS = ("result.json", "requests.csv", "steps.csv", "summary.txt")


def _result_state(run_dir: Path) -> str:
    """"whole": every result file, each listed in the manifest as it is; "none": none of them
    (any other state fails the test)."""
    from experiments.run_dir import MANIFEST, unrecorded

    present = [n for n in ALL_RESULTS if (run_dir / n).exists()]
    assert not list(run_dir.glob(".*.tmp"))
    if not present:
        listed = json.loads(_text(run_dir / MANIFEST) or '{"files": {}}')["files"]
        assert not set(listed) & set(ALL_RESULTS), listed
        return "none"
    assert present == list(ALL_RESULTS) and unrecorded(run_dir, ALL_RESULTS) == [], present
    return "whole"


@pytest.fixture
def ctrl_c(monkeypatch):
    """A real SIGINT sent to this process (its handler Python's, raising KeyboardInterrupt);
    the runs completed meanwhile, as main() sees them."""
    from experiments import run as run_module

    monkeypatch.setattr(run_module, "_completed", [])
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield lambda: os.kill(os.getpid(), signal.SIGINT)
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize(("point", "outcome"), [
    ("result.json placed", "none"),  # inside write_results, after its last file
    ("write_results returned", "none"),
    ("manifest to be written", "whole"),  # inside the commit: held until it is done
    ("manifest written", "whole"),
])
def test_ctrl_c_in_the_last_instant_leaves_the_whole_result_or_none(tmp_path, monkeypatch,
                                                                    ctrl_c, point, outcome):
    """A Ctrl-C at each point of a run's end: before, "interrupted: no result written" while
    the files were in place without a manifest, and a re-run into the directory was refused
    ("files schedlab did not write"). Now the run is interrupted before its commit (none of
    it is left) or after (the whole, as a completed run: main() ends it with exit 0), and a
    re-run replaces it."""
    from experiments import result_files
    from experiments import run as run_module

    cfg = composed(*SMALL)
    run(cfg, tmp_path)  # a previous run's result, which the interrupted run replaces
    run_module._completed.clear()
    real_atomic, real_write, real_record = (result_files.atomic_text_file,
                                            result_files.write_results, run_module.record)

    @contextlib.contextmanager
    def atomic_then_interrupt(path):
        with real_atomic(path) as f:
            yield f
        if Path(path).name == "result.json":
            ctrl_c()

    def write_then_interrupt(*args, **kwargs):
        out = real_write(*args, **kwargs)
        ctrl_c()
        return out

    def record_interrupted(directory, names):
        if point == "manifest to be written":
            ctrl_c()
        real_record(directory, names)
        if point == "manifest written":
            ctrl_c()

    if point == "result.json placed":
        monkeypatch.setattr(result_files, "atomic_text_file", atomic_then_interrupt)
    if point == "write_results returned":
        monkeypatch.setattr(result_files, "write_results", write_then_interrupt)
    monkeypatch.setattr(run_module, "record", record_interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(cfg, tmp_path)
    assert _result_state(tmp_path) == outcome
    assert run_module._completed == ([tmp_path] if outcome == "whole" else [])
    monkeypatch.undo()
    run(cfg, tmp_path)
    assert _result_state(tmp_path) == "whole"


def _run_interrupted_at(run_dir: Path, patch: str) -> subprocess.CompletedProcess:
    """The CLI run into run_dir with ``patch`` (code) applied to experiments.run first."""
    code = ("import errno, os, signal, sys\nimport experiments.run as r\n" + patch +
            f"\nsys.argv = ['schedlab-run', *{SMALL!r}, 'hydra.run.dir={run_dir}']\nr.main()")
    return cli("-c", code)


@pytest.mark.parametrize(("when", "code", "message"), [
    ("before", 'import experiments.result_files as f\nw = f.write_results\n'
               'def write(*a, **k):\n    out = w(*a, **k)\n    os.kill(os.getpid(), 2)\n'
               '    return out\nf.write_results = write', "interrupted: no result written"),
    ("during", 'rec = r.record\ndef record(d, names):\n    os.kill(os.getpid(), 2)\n'
               '    rec(d, names)\nr.record = record', None),
])
def test_ctrl_c_at_the_commit_through_the_cli_says_what_the_directory_holds(tmp_path, when,
                                                                            code, message):
    """Ctrl-C after the files are placed and before the commit: exit 130, the line says no
    result was written and none is; during the commit: the run completes (exit 0, its summary
    printed, its files listed in the manifest). A re-run into the directory works either way
    (before: refused as "files schedlab did not write")."""
    out = tmp_path / "run"
    p = _run_interrupted_at(out, code)
    if message is None:
        assert (p.returncode, p.stderr) == (0, ""), p.stderr[-2000:]
        assert "Serving Benchmark Result" in p.stdout and f"results: {out}" in p.stdout
        assert _result_state(out) == "whole"
    else:
        assert p.returncode == 130 and p.stderr.strip().splitlines() == [message], p.stderr
        assert _result_state(out) == "none"
    p = cli("-m", "experiments.run", *SMALL, f"hydra.run.dir={out}")
    assert p.returncode == 0, p.stderr[-2000:]
    assert _result_state(out) == "whole"


def test_an_interrupted_sweep_says_its_finished_runs_keep_their_results(tmp_path):
    """Ctrl-C in a sweep's second run, its files placed and not committed: the first run's
    result stays, the second's goes, and the line says so (before: "no result written")."""
    code = ('import experiments.result_files as f\nw = f.write_results\ncalls = []\n'
            'def write(*a, **k):\n    out = w(*a, **k)\n    calls.append(1)\n'
            '    if len(calls) == 2:\n        os.kill(os.getpid(), 2)\n    return out\n'
            'f.write_results = write\n'
            f"sys.argv = ['schedlab-run', '-m', *{SMALL!r}, 'policy.num_steps=1,2', "
            f"'hydra.sweep.dir={tmp_path}']\nr.main()")
    p = cli("-c", "import os, sys\nimport experiments.run as r\n" + code)
    assert p.returncode == 130, p.stderr[-2000:]
    assert p.stderr.strip().splitlines() == [
        "interrupted: the sweep's finished runs keep their results; no other result written"]
    assert [_result_state(next(tmp_path.glob(f"*policy.num_steps={k},*"))) for k in (1, 2)] \
        == ["whole", "none"]


def test_interrupts_held_acts_on_ctrl_c_and_sigterm_at_the_end_of_the_section(ctrl_c):
    from experiments.files import interrupts_held

    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held():
            ctrl_c()
            done.append("after Ctrl-C")
    assert done == ["after Ctrl-C"] and signal.getsignal(signal.SIGINT) is \
        signal.default_int_handler
    terms = []
    previous = signal.signal(signal.SIGTERM, lambda s, _: terms.append(s))
    try:
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGTERM)
            done.append("after SIGTERM")
            assert terms == []
        assert terms == [signal.SIGTERM] and done[-1] == "after SIGTERM"
    finally:
        signal.signal(signal.SIGTERM, previous)


# --- a full disk for run.log ------------------------------------------------------------------

class _FullDisk:
    """A log file on a full disk: every write or flush fails as the OS fails it."""

    def write(self, text=None):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    flush = write

    def close(self):
        pass


def test_a_full_disk_for_run_log_fails_the_run_in_one_error_and_leaves_no_result(
        tmp_path, monkeypatch, capsys):
    """Before: "--- Logging error ---" tracebacks for each line, run.log empty, exit 0 with
    the result files in place. Now the run fails with one OSError naming run.log (main: one
    line, exit 2), nothing printed for the lines lost, and no result left."""
    import logging

    from experiments import run as run_module
    from experiments.run_log import RunLogHandler

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # put back as they were after the test
    monkeypatch.setattr(run_module._RUN_LOG, "handlers", [])
    monkeypatch.setattr(run_module._RUN_LOG, "propagate", run_module._RUN_LOG.propagate)
    root.addHandler(RunLogHandler(tmp_path / "run.log"))  # as Hydra's job logging makes it
    run_module.log_to_run_log()
    (log,) = run_module._RUN_LOG.handlers
    log.stream.close()
    log.stream = _FullDisk()
    try:
        with pytest.raises(OSError) as err:
            run(composed(*SMALL), tmp_path)
        assert (err.value.errno, err.value.filename) == (errno.ENOSPC,
                                                         str(tmp_path / "run.log"))
        assert _result_state(tmp_path) == "none"
        out, logged = capsys.readouterr()
        assert "Logging error" not in logged and "Serving Benchmark Result" not in out
        logging.getLogger("schedlab.other").warning("another logger's line, lost too")
        run_module.say("error: the run's own line", error=True)
        assert capsys.readouterr().err == "error: the run's own line\n"  # the rest kept
    finally:
        log.stream = None


def test_a_full_disk_for_run_log_through_the_cli_is_one_line_and_exit_2(tmp_path):
    out = tmp_path / "run"
    p = _run_interrupted_at(out, "import logging\ndef full(self):\n    raise OSError("
                                 "errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
                                 "logging.FileHandler.flush = full")
    line = one_line_error(p)
    assert line == f"error: [Errno 28] No space left on device: '{out / 'run.log'}'"
    assert p.stdout == "" and _result_state(out) == "none"
    assert cli("-m", "experiments.run", *SMALL, f"hydra.run.dir={out}").returncode == 0
    assert _result_state(out) == "whole" and "results:" in (out / "run.log").read_text()


def test_a_full_disk_names_the_file(tmp_path, monkeypatch):
    from experiments import files

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.os, "fsync", full)
    target = tmp_path / "result.json"
    with pytest.raises(OSError, match=r"\[Errno 28\].*result\.json") as err:
        files.write_text_atomic(target, "{}")
    assert err.value.filename == str(target)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("override", "key"), [
    ("+gpu_memory_utilisation=0.5", "gpu_memory_utilisation"),
    ("+schedular.max_num_seqs=8", "schedular"),
    ("+backend.time_scal=2", "time_scal"),
])
def test_unknown_top_level_and_sim_backend_keys_are_refused(tmp_path, override, key):
    with pytest.raises(ValueError) as err:
        run(composed(*SMALL, override), tmp_path)
    msg = str(err.value)
    assert f"no setting {key!r}" in msg and "\n" not in msg
    assert ("gpu_memory_utilization" in msg and "scheduler" in msg) if "backend" not in override \
        else "time_scale" in msg
    assert not (tmp_path / "result.json").exists()


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return kids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_killed_joblib_sweep_leaves_no_workers(tmp_path):
    p = popen("-m", "experiments.run", "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
              "policy.num_steps=1,2,4,8", *LONG, f"hydra.sweep.dir={tmp_path}")
    kids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*/.hydra/config.yaml"))) < 2:  # both workers on a job
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.05)
        kids = _children(p.pid)
        assert len(kids) >= 2
        p.kill()
        p.wait()
        deadline = time.monotonic() + 20
        while any(_alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [k for k in kids if _alive(k)]
        assert not list(tmp_path.glob("*/result.json"))
    finally:
        for k in kids:
            if _alive(k):
                os.kill(k, signal.SIGKILL)


@pytest.mark.parametrize(("override", "message"), [
    ("backend.stream_per_step=maybe", "backend.stream_per_step must be true or false, got 'maybe'"),
    ("backend.num_blocks=2.5", "backend.num_blocks must be an integer >= 1, got 2.5"),
    ("backend.time_scale=abc", "backend.time_scale must be a finite number, got 'abc'"),
    ("backend.time_scale=1e300", "backend.time_scale must be <= 1000, got 1e+300"),
    ("gpu_memory_utilization=abc", "gpu_memory_utilization must be a finite number, got 'abc'"),
    ("gpu_memory_utilization=1.5", "gpu_memory_utilization must be in (0, 1], got 1.5"),
    ("+skip_existing=abc", "skip_existing must be true or false, got 'abc'"),
])
def test_sim_backend_and_switch_settings_are_checked(tmp_path, override, message):
    """A word where a number goes, or 'maybe' for a switch: one line naming the setting (before,
    'maybe' ran as true and 2.5 blocks failed with no setting named). The first through the
    command line (exit 2, its one line), the others through run() in this process: the
    command's line is the message of the error run() raises."""
    if override == "backend.stream_per_step=maybe":
        p = cli("-m", "experiments.run", *SMALL, f"hydra.run.dir={tmp_path / 'r'}", override)
        assert message in one_line_error(p)
        return
    with pytest.raises((ValueError, TypeError)) as err:
        run(composed(*SMALL, override), tmp_path / "r")
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not (tmp_path / "r" / "result.json").exists()


def test_hydra_config_path_that_is_a_file_is_one_line(tmp_path):
    """Hydra writes the run's config into <run dir>/.hydra after the run directory is claimed;
    a file of that name was a FileExistsError traceback."""
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / ".hydra").write_text("x")
    p = cli("-m", "experiments.run", *SMALL, f"hydra.run.dir={run_dir}")
    assert ".hydra is a file" in one_line_error(p)


def test_a_failed_sweep_leaves_no_aggregate_of_an_earlier_one(tmp_path):
    """A job that fails ends the sweep before the aggregate callback: the table of an earlier
    sweep into the same directory must not stay beside the new results."""
    sweep = tmp_path / "s"
    ok = cli("-m", "experiments.run", "-m", *SMALL, f"hydra.sweep.dir={sweep}",
             "policy.num_steps=1,2")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert (sweep / "aggregate.csv").exists() and (sweep / "aggregate.parquet").exists()
    # a bad setting is found before any job runs (experiments/cli_checks.py): nothing changes
    bad = cli("-m", "experiments.run", "-m", *SMALL, f"hydra.sweep.dir={sweep}",
              "policy.num_steps=1,0")
    assert bad.returncode == 2 and "job 2 of 2" in bad.stderr
    assert (sweep / "aggregate.csv").exists()
    # a job that fails only when it runs (its trace is missing), after the first one ran
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_time,prompt_len,output_len\n0,10,4\n")
    small = [a for a in SMALL if not a.startswith("workload")]
    failed = cli("-m", "experiments.run", "-m", *small, f"hydra.sweep.dir={sweep}",
                 "workload=trace", f"workload.trace_path={trace},{tmp_path / 'missing.csv'}")
    assert failed.returncode == 2, failed.stderr[-2000:]
    assert not (sweep / "aggregate.csv").exists() and not (sweep / "aggregate.parquet").exists()


def test_a_full_disk_at_the_start_is_one_line(tmp_path, monkeypatch):
    """Claiming the run directory writes the lock holder's pid: ENOSPC there is a RunDirError
    naming the directory, not a traceback from Hydra's config writer later."""
    from experiments import run_dir as rd

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rd.os, "write", full)
    with pytest.raises(rd.RunDirError, match=r"cannot write into hydra.run.dir=.*No space left"):
        claim(tmp_path / "r")
    assert not rd._held


def test_plot_of_a_table_that_is_not_one_is_exit_2(tmp_path):
    table = tmp_path / "bin.csv"
    table.write_bytes(b"\x00\x01\x02binary")
    p = cli("-m", "experiments.plot", str(table), "--out", str(tmp_path / "f"))
    assert "bin.csv" in one_line_error(p)


def test_one_row_per_simulated_configuration_however_it_was_spelled(tmp_path):
    """A sweep resumed with a setting spelled out (policy=multi_step, the default) writes new
    directories for the same configurations: the aggregate keeps one row per configuration."""
    sweep = tmp_path / "s"
    for extra in ([], ["policy=multi_step", "+skip_existing=true"]):
        p = cli("-m", "experiments.run", "-m", *SMALL, f"hydra.sweep.dir={sweep}",
                "policy.num_steps=1,2", *extra)
        assert p.returncode == 0, p.stderr[-2000:]
    assert len(list(sweep.rglob("result.json"))) == 4
    df = pd.read_csv(sweep / "aggregate.csv")
    assert len(df) == 2 and sorted(df["k"]) == [1, 2]
