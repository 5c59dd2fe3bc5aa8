"""A sweep's jobs: one line each on the sweep's console under every launcher (submitit's jobs
print into log files, so their lines come back as the jobs' returns), named "run 3 of 12"; a
joblib sweep's worker
processes stop when the sweep process is gone (killed), instead of running its remaining jobs
for no one; and no job's config outlives it."""

from __future__ import annotations

import _thread
import contextlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

# The launchers' own console lines ("Launching 2 jobs locally", "#0 : k=1 ..."): each run's
# line names its overrides and directory already, so a sweep prints one line per run.
LAUNCHER_LOGGERS = ("hydra._internal.core_plugins.basic_launcher",
                    "hydra_plugins.hydra_joblib_launcher._core",
                    "hydra_plugins.hydra_joblib_launcher.joblib_launcher",
                    "hydra_plugins.hydra_submitit_launcher.submitit_launcher")

# The sweep process's pid, set before it starts its pool; the workers inherit it. Set only for
# the joblib launcher, whose workers are children of the sweep process on the same host (a
# SLURM or Ray worker, which may inherit the environment too, has other parents).
SWEEP_PID_ENV = "SCHEDLAB_SWEEP_PID"
# The number of jobs in the sweep, set by the sweep process for its jobs (a job's config has
# only its own overrides); the workers of every launcher that passes on the environment have it.
SWEEP_JOBS_ENV = "SCHEDLAB_SWEEP_JOBS"
_watching = False


class SweepWorkersCallback(Callback):
    """Marks a joblib sweep's environment before its workers start, and empties each job's
    return of its configs when it ends."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        for name in LAUNCHER_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
        jobs = sweep_size(config)
        if jobs is None:
            os.environ.pop(SWEEP_JOBS_ENV, None)
        else:
            os.environ[SWEEP_JOBS_ENV] = str(jobs)
        launcher = str(OmegaConf.select(config, "hydra.launcher._target_", default=""))
        if "submitit" in launcher:
            print_submitit_lines()
        if "joblib" not in launcher:
            return
        os.environ[SWEEP_PID_ENV] = str(os.getpid())
        # Ctrl-C stops the pool with its semaphores still registered; multiprocessing's resource
        # tracker then frees them itself, and its warning about them is noise.
        quiet = "ignore::UserWarning:multiprocessing.resource_tracker"
        os.environ["PYTHONWARNINGS"] = ",".join(
            filter(None, [os.environ.get("PYTHONWARNINGS"), quiet]))

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        # Hydra's sweeper keeps every job's return until the sweep ends, each with two deep
        # copies of the job's config (~0.2 MB): a 500-job sweep grew by 100 MB for nothing.
        # Nothing reads them after the job (the table is built from result.json files), and a
        # joblib or submitit worker no longer pickles them back.
        job_return.cfg = None
        job_return.hydra_cfg = None


def sweep_size(config: DictConfig) -> int | None:
    """How many jobs Hydra's basic sweeper makes of the multirun's overrides; None under another
    sweeper, or overrides only the sweeper itself can read."""
    jobs = job_overrides(config)
    return None if jobs is None else len(jobs)


def job_overrides(config: DictConfig) -> list[list[str]] | None:
    """Each job's overrides as Hydra's basic sweeper makes them of the multirun's overrides (the
    sweeper's params and the command line's), split as the sweeper splits them; None under
    another sweeper, or overrides only the sweeper itself can read."""
    if not str(OmegaConf.select(config, "hydra.sweeper._target_", default="")).endswith(
            BasicSweeper.__name__):
        return None
    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    args = [f"{k}={v}" for k, v in params.items()]
    args += list(OmegaConf.select(config, "hydra.overrides.task", default=[]) or [])
    try:
        return split_jobs(args)
    except Exception:  # the sweeper reports what it cannot parse; the lines go without a total
        return None


def split_jobs(args: Sequence[str]) -> list[list[str]]:
    """A multirun's overrides (``policy=cp1,cp2 policy.num_steps=1,8``) as each job's, in the
    basic sweeper's order."""
    batches = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(list(args)),
                                           None)
    return [list(job) for batch in batches for job in batch]


def job_label(hydra_cfg: DictConfig) -> str:
    """A sweep's run as its line names it: "run 3 of 12 (policy=cp1,workload.request_rate=20)"
    (its job number and overrides; without the sweep's size, "run 3 (...)")."""
    overrides = hydra_cfg.job.override_dirname or "defaults"
    num = OmegaConf.select(hydra_cfg, "job.num")
    if num is None:
        return overrides
    total = os.environ.get(SWEEP_JOBS_ENV, "")
    of = f" of {total}" if total.isdigit() else ""
    return f"run {int(num) + 1}{of} ({overrides})"


def stop_with_sweep() -> None:
    """Called at the start of every job. In a joblib sweep's worker: exit at once if the sweep
    process is gone already, else watch it; once it is gone the job is interrupted as by Ctrl-C
    (its result files are cleared) and the worker exits soon after."""
    global _watching
    sweep_pid = os.environ.get(SWEEP_PID_ENV, "")
    if not sweep_pid.isdigit() or int(sweep_pid) == os.getpid():
        return  # not a worker: a single run, or jobs run in the sweep process itself
    if os.getppid() != int(sweep_pid):
        os._exit(1)  # orphaned before this job started
    if _watching:
        return

    def watch() -> None:
        while os.getppid() == int(sweep_pid):
            time.sleep(0.5)
        _thread.interrupt_main()
        time.sleep(2)  # the interrupted job clears its files; then go, whatever the pool does
        os._exit(1)

    threading.Thread(target=watch, name="sweep-watch", daemon=True).start()
    _watching = True


def print_job_lines(returns: Sequence[JobReturn], submitit_folder: str) -> None:
    """In the sweep process, each finished job's line (the run's return: its one line, or the
    skip), in job order; and the folder submitit makes for its %j pattern itself, left empty
    (each job's files go to its own job id's folder), removed."""
    for r in returns:
        if r.status == JobStatus.COMPLETED and isinstance(r.return_value, str):
            print(r.return_value, flush=True)
    pattern = Path(submitit_folder)
    if "%j" in pattern.name:
        with contextlib.suppress(OSError):  # not there, or not empty: left alone
            pattern.rmdir()


def print_submitit_lines() -> None:
    """Make the submitit launchers (local and SLURM) print each finished job's line in the
    sweep process once the jobs are done (print_job_lines). Called in the sweep process before
    its launcher starts; the jobs themselves run the launcher's __call__, not launch. (Hydra
    takes launchers only from the hydra_plugins package, so this wraps the plugin's launch
    rather than naming a launcher of schedlab's own.)"""
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher

    launch = BaseSubmititLauncher.launch
    if getattr(launch, "prints_job_lines", False):
        return

    def launch_and_print(self: Any, job_overrides: Sequence[Sequence[str]],
                         initial_job_idx: int) -> Sequence[JobReturn]:
        returns = launch(self, job_overrides, initial_job_idx)
        print_job_lines(returns, self.params["submitit_folder"])
        return returns

    launch_and_print.prints_job_lines = True  # type: ignore[attr-defined]
    BaseSubmititLauncher.launch = launch_and_print  # type: ignore[method-assign]
