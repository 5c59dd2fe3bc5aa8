"""The main run: one workload on one backend under one policy, written as vLLM-style results."""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from omegaconf import DictConfig

from common.parallel import ParallelConfig
from common.paths import conf_dir
from experiments.choices import ClusterChoice, PolicyChoice, plain
from experiments.cli_checks import check_run_settings, suggest_keys
from experiments.files import interrupts_held
from experiments.run_dir import (
    MANIFEST,
    STAMP_KEY,
    RunDirError,
    check_inputs_outside,
    config_stamp,
    finished,
    record,
    remove_recorded,
    sweeping,
)
from experiments.run_log import RunLogHandler
from experiments.sweep_workers import job_label, stop_with_sweep
from policies import ModelSpec
from policies.base import MOVED_SETTINGS
from policies.request import Request

if TYPE_CHECKING:
    from experiments.backends import Backend
    from experiments.metrics import ResultSettings
    from experiments.request_times import TimesTable

CONF_DIR = str(conf_dir())  # one home: experiments/paths.py


def outcome_stats(outcome: Any) -> dict[str, Any]:
    """The backend-independent counters of a run, for result.json's schedlab section.

    ``num_wasted_steps`` counts decode slots, not steps: each request's share of a multi-step
    window run after it had all its tokens (a window of k steps in which a request finishes
    at step j wastes k - j of its slots; the other requests' slots in those steps are not).
    """
    st = outcome.stats
    stats = {k: getattr(st, k) for k in ("num_invocations", "num_windows", "num_steps",
                                         "num_preemptions", "num_wasted_steps")} \
        if not isinstance(st, Mapping) else dict(st)
    for key in ("num_blocks", "gpu_busy_fraction", "cpu_busy_fraction"):
        if hasattr(outcome, key):
            stats[key] = getattr(outcome, key)
    spec = getattr(outcome, "spec_decode", None)  # speculative decoding's (vLLM's names)
    if spec is not None:
        stats.update(spec.metrics())
    return stats


# The real backend's fields that only mean something on a GPU (CUDA graphs, the CUDA module
# loader); a run on the CPU keeps them in result.json but leaves them out of its printout.
CUDA_ONLY_FIELDS = ("cuda_graph_sizes", "prefill_graphs", "prefill_graph_replays",
                    "piecewise_graph_sizes", "piecewise_capture_s", "piecewise_graph_replays",
                    "cuda_module_loading")
# From this many requests on, computing the metrics and writing the files takes long enough
# to be noticed, so a line says what the run is doing meanwhile (the time a request: the 1M
# cases of BENCHMARKS.md; figures are kept there, dated, rather than here to go stale).
LONG_WRITE_REQUESTS = 10_000

# A single run of the command line leaves its objects (a 1M-request run's millions) to the
# operating system when the process ends, rather than Python freeing them one by one (a
# noticeable part of a long run's time): main() sets LEAVE_TO_EXIT, run() keeps them here, main() ends the process.
LEAVE_TO_EXIT = False
_left_to_exit: list[Any] = []

# The run's lines for its run.log (Hydra's job log); the console gets them from print. Its
# handlers are Hydra's file handlers, attached by the app for each job (log_to_run_log).
_RUN_LOG = logging.getLogger("schedlab.run")

# The directories of the runs this process has completed (result files and manifest in place,
# the summary given). A Ctrl-C acted on after a single run completed (interrupts_held) leaves
# its result, so the run ends as completed (main).
_completed: list[Path] = []


def log_to_run_log() -> None:
    """Send say()'s lines to the file handlers Hydra's job logging gave the root logger (the
    run's run.log) and nowhere else; none (hydra/job_logging=disabled): no log."""
    _RUN_LOG.handlers = [h for h in logging.getLogger().handlers
                         if isinstance(h, logging.FileHandler)]
    _RUN_LOG.setLevel(logging.INFO)
    # Set for each job, not at import: a joblib worker gets the app by value (it is __main__
    # there) and its logger by name, a fresh one that would also pass every line to the root
    # logger's console and file handlers (each run's line printed two or three times).
    _RUN_LOG.propagate = False


def say(text: str, *, console: bool = True, error: bool = False) -> None:
    """A message of the run: on the console (errors on stderr) unless ``console`` is false, and
    in its run.log (a failure to write it is reported by check_run_log)."""
    if console:
        print(text, file=sys.stderr if error else sys.stdout, flush=True)
    _RUN_LOG.log(logging.ERROR if error else logging.INFO, text)


def check_run_log() -> None:
    """Raise an OSError naming run.log if a line of the run could not be written to it (its
    handler a RunLogHandler, as conf/hydra/job_logging/schedlab.yaml has it)."""
    for h in _RUN_LOG.handlers:
        if isinstance(h, RunLogHandler):
            h.check()


@contextlib.contextmanager
def result_as_one_unit(run_dir: Path
                       ) -> Iterator[Callable[[Sequence[str], Sequence[str]], None]]:
    """The block places the run's result files in run_dir (write_results) and then calls the
    function given, ``commit(logged, printed)``: ``logged`` lines go to run.log (a failure to
    write it is an OSError naming it), the files into run_dir's manifest, then ``printed``
    lines to the console, with Ctrl-C and SIGTERM held until it is done (interrupts_held). If
    the block ends before the commit (an error, or an interrupt just after the files were
    placed), they are removed: run_dir holds the whole result, listed in its manifest and
    summarized on the console, or none of it, and a re-run into it is not refused."""
    committed = False

    def commit(logged: Sequence[str], printed: Sequence[str]) -> None:
        nonlocal committed
        from experiments.result_files import RESULT_FILES

        with interrupts_held():
            for line in logged:
                say(line, console=False)
            check_run_log()
            record(run_dir, [name for name in RESULT_FILES if (run_dir / name).is_file()])
            committed = True
            _completed.append(run_dir)
            for line in printed:
                print(line, flush=True)

    try:
        yield commit
    except BaseException:
        if not committed:
            from experiments.result_files import clear_results

            # the run's own error (or Ctrl-C) is the one to report
            with interrupts_held(), contextlib.suppress(OSError):
                clear_results(run_dir)
                record(run_dir, [])
        raise


def one_line_warning(message: Warning | str, category: type[Warning], filename: str,
                     lineno: int, line: str | None = None) -> str:
    """A warning as a user of the run reads it: its category and message, without Python's
    file, line number and source-line echo (warnings.formatwarning's signature)."""
    return f"{category.__name__}: {message}\n"


class RunExit(SystemExit):
    """A failed run's end: exit code 2 and its one-line message."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message


class RunFailed(Exception):
    """A failed run inside a submitit job. There a SystemExit ends the job with no result, which
    the launcher reports as a traceback; an exception is kept in the job's result instead, and
    unpickled in the sweep process as the RunExit it stands for (main() prints its line)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple[type[RunExit], tuple[str]]:
        return RunExit, (self.message,)


def text_tokenizer_id(workload: Mapping[str, Any], model: ModelSpec) -> str:
    """The tokenizer result.json names (vLLM's tokenizer_id) and the real backend's outputs are
    decoded with: the workload's (ShareGPT), else the model's, else the default (Llama-3)."""
    from experiments.workload import DEFAULT_TOKENIZER

    return workload.get("tokenizer") or model.tokenizer or DEFAULT_TOKENIZER


def generated_texts(requests: Sequence[Request], tokenizer: Any) -> list[str]:
    """Each request's output ids as text, as benchmark_serving's client receives it: the
    tokenizer's special tokens are skipped (vLLM detokenizes with skip_special_tokens), and so
    are ids the tokenizer does not have; an unfinished request's text is empty, as a failed
    one's is. A test model's small vocabulary holds the tokenizer's first ids (prompts are
    folded modulo its size), so its outputs decode as those tokens."""
    n = tokenizer.n_vocab
    special = {i for i in range(n) if tokenizer.is_special_token(i)}
    ids = [[t for t in r.output_token_ids if t < n and t not in special]
           if r.finish_time is not None else [] for r in requests]
    return tokenizer.decode_batch(ids)


def sweep_line(label: str, result: Mapping[str, Any], run_dir: Path) -> str:
    """A run of a sweep in one line; the full summary is its summary.txt."""
    line = (f"{label}: {result['request_throughput']:.2f} req/s, median TTFT "
            f"{result['median_ttft_ms']:.1f} ms, median TPOT {result['median_tpot_ms']:.1f} ms")
    if result.get("request_goodput") is not None:
        line += f", goodput {result['request_goodput']:.2f} req/s"
    return f"{line} -> {run_dir}"


@dataclass
class RunPlan:
    """A run's choices, every setting checked before the run directory is touched: its backend,
    model, parallel layout, policy, cluster or single replica, workload, and what its results
    compute. ``max_len``: a request's longest prompt plus output (``max_len_set_by``: what sets
    it where not model.max_model_len, a cluster's replica groups)."""

    cfg: Mapping[str, Any]
    backend_cls: type[Backend]
    results: ResultSettings
    model: ModelSpec
    parallel: ParallelConfig
    choice: PolicyChoice
    cluster: ClusterChoice
    workload: dict[str, Any]
    max_len: int
    max_len_set_by: Any = None

    @classmethod
    def of(cls, cfg: Mapping[str, Any]) -> RunPlan:
        # the top level's names, the backend's settings, metrics, model, parallel, policy and
        # cluster (a sweep checks each job by the same function before its first runs)
        s = check_run_settings(cfg)
        plan = cls(cfg, s.backend_cls, s.results, s.model, s.parallel, s.choice, s.cluster,
                   plain(cfg["workload"]), s.model.max_model_len)
        cluster = s.cluster
        if cluster.groups:  # the simulator: a request may go to any replica
            plan.max_len, plan.max_len_set_by = cluster.request_limit()
            if cluster.size == 1:  # the run is its one replica
                plan.model, plan.choice = cluster.groups[0].model, cluster.groups[0].choice
        return plan

    def new_backend(self) -> Backend:
        """The run's backend, built (its settings that need the run's choices checked)."""
        return self.backend_cls(self.cfg, self.choice, self.model, self.parallel, self.cluster)


@dataclass
class RunRequests:
    """The run's requests (``num_dropped``: workload.drop_too_long's over max_len), the most in
    flight at once, and the tokenizer its outputs are named and decoded with (loaded only where
    a backend's outputs become text)."""

    requests: list[Request]
    num_dropped: int
    limit: int | None
    tokenizer_id: str
    tokenizer: Any

    @classmethod
    def of(cls, plan: RunPlan) -> RunRequests:
        """The workload's requests, made with the cyclic collector off and then frozen: they
        live to the run's end, and the collector would rescan them again and again as they are
        made (unfrozen when the run ends, ``run``)."""
        from experiments.workload import build_requests, load_tokenizer, max_concurrency

        with_ids = plan.backend_cls.needs_token_ids  # the simulator needs lengths only
        workload, model = plan.workload, plan.model
        collecting = gc.isenabled()
        gc.disable()
        try:
            requests, num_dropped = build_requests(
                workload, vocab_size=model.vocab_size if with_ids else None,
                max_model_len=plan.max_len, limit=plan.max_len_set_by)
            tokenizer_id = text_tokenizer_id(workload, model)
            # the real backend's outputs become text: its tokenizer is loaded before the run
            tokenizer = load_tokenizer(tokenizer_id) \
                if with_ids and plan.results.save_per_request else None
            made = cls(requests, num_dropped, max_concurrency(workload), tokenizer_id, tokenizer)
            gc.freeze()
        finally:
            if collecting:
                gc.enable()
        return made


def run(cfg: Mapping[str, Any], run_dir: str | os.PathLike, *,
        sweep_label: str | None = None) -> dict[str, Any]:
    """Run one configuration and write result.json, requests.csv (, steps.csv) and summary.txt
    into run_dir. The summary is printed, or with ``sweep_label`` (a run of a sweep) one line
    named by it; either way run.log gets the summary.

    Every setting is checked, and every input read, before run_dir is touched; then a previous
    run's result files go, if schedlab wrote them there (run_dir's manifest lists them): a file
    of that name it did not write, or an input the run would overwrite, is refused."""
    from experiments.result_files import RESULT_FILES

    run_dir = Path(run_dir)
    plan = RunPlan.of(cfg)
    work = RunRequests.of(plan)
    backend = None
    try:
        backend = plan.new_backend()
        # Every setting is checked: now the run directory (a run of a sweep: a job directory)
        setting = "hydra.run.dir" if sweep_label is None else "hydra.sweep.dir"
        check_inputs_outside(cfg, run_dir, (*RESULT_FILES, MANIFEST), setting)
        remove_recorded(run_dir, RESULT_FILES, setting)

        wall0 = time.perf_counter()
        outcome = backend.run(work.requests, run_dir, max_concurrency=work.limit,
                              progress=bool(cfg.get("progress", True)))
        wall = time.perf_counter() - wall0
        gc.freeze()  # what the run made (its steps, delivery times) lives to its end too

        long_run = len(work.requests) >= LONG_WRITE_REQUESTS
        if long_run:
            say(f"writing results to {run_dir} ...", console=sweep_label is None)
        result, extra, times, replica_of = run_result(plan, work, backend, outcome, wall)
        write_run(run_dir, plan, work.requests, backend, outcome, result, extra, times,
                  replica_of, sweep_label)
        if LEAVE_TO_EXIT and sweep_label is None and long_run:
            _left_to_exit.append((work.requests, outcome, backend, times))
        return {**result, "schedlab": extra}
    except BaseException:
        if backend is not None:  # what it wrote as it went removed, its workers stopped
            backend.discard()
        raise
    finally:
        gc.unfreeze()


def run_result(plan: RunPlan, work: RunRequests, backend: Backend, outcome: Any, wall: float
               ) -> tuple[dict[str, Any], dict[str, Any], TimesTable, Sequence[int] | None]:
    """result.json's vLLM fields and its schedlab section of a run that is over, every
    request's times (with their ITLs only where the per-request lists are saved), and each
    request's replica in a cluster's run."""
    from experiments.metrics import save_result_metadata, summarize
    from experiments.scheduling_metrics import scheduling_metrics
    from experiments.workload.settings import get_float

    requests, results, workload = work.requests, plan.results, plan.workload
    texts = generated_texts(requests, work.tokenizer) if work.tokenizer is not None else None
    # once, for every metric and file below (the simulator's: taken as each request finished)
    times = backend.times(requests)
    summary = summarize(requests, outcome.duration, percentiles=results.percentiles,
                        goodput=results.goodput, generated_texts=texts,
                        per_request=results.save_per_request, times=times, streamed=True)
    scheduling = scheduling_metrics(requests, outcome.duration, plan.choice.service_time_fn,
                                    times)
    if not results.save_per_request:
        times = times.without_itls()  # taken: its memory is back before the files are written
    classes = scheduling.pop("classes", None)
    summary.update(scheduling)
    trace = workload.get("kind") == "trace"
    result = {**save_result_metadata(
        backend=f"schedlab-{backend.name}", model_id=plan.model.name,
        tokenizer_id=work.tokenizer_id, num_prompts=len(requests),
        request_rate=None if trace else get_float(workload, "request_rate", math.inf),
        burstiness=None if trace else get_float(workload, "burstiness", 1.0),
        max_concurrency=work.limit), **summary}
    cluster, entries, replica_of = backend.cluster_fields(times)
    result.update(entries)
    extra = schedlab_section(plan, work, backend, outcome, wall, cluster)
    if classes:
        extra["classes"] = classes
    extra.update(backend.run_fields(outcome, wall))
    if backend.settings.get("save_token_ids"):
        result["output_token_ids"] = [list(r.output_token_ids) for r in requests]
    return result, extra, times, replica_of


def schedlab_section(plan: RunPlan, work: RunRequests, backend: Backend, outcome: Any,
                     wall: float, cluster: Mapping[str, Any]) -> dict[str, Any]:
    """result.json's schedlab section: what ran (backend, policy, model, parallel layout,
    hardware, workload), its counters, and the config's stamp (``cluster``: a cluster's router
    and replica count)."""
    from experiments.metrics import prefix_cache_hit_rate

    choice, policy = plan.choice, plan.choice.policy
    extra = {
        "backend": backend.name,
        "policy": choice.name,
        "policy_settings": policy.describe(),
        "k": getattr(policy, "num_steps", 1),
        "overlap": choice.scheduler.overlap,
        "enable_prefix_caching": choice.scheduler.enable_prefix_caching,
        "prefix_cache_hit_rate": prefix_cache_hit_rate(work.requests),
        "model": plan.model.name,
        # the run's, or its one replica's (a replica group's own parallel)
        "tensor_parallel_size": plan.cluster.parallel.tensor_parallel_size,
        "pipeline_parallel_size": plan.cluster.parallel.pipeline_parallel_size,
        **backend.labels(outcome),  # hardware, overhead, host
        # (speculation's acceptance named only where set: the section of a run without
        # speculation is as it was before speculation existed)
        "workload": {k: v for k, v in plan.workload.items()
                     if k != "acceptance" or v is not None},
        "wall_seconds": wall,
        **outcome_stats(outcome),
        STAMP_KEY: config_stamp(plan.cfg),
    }
    if plan.workload.get("drop_too_long"):
        extra["num_dropped_too_long"] = work.num_dropped
    if choice.speculation is not None:
        extra["spec"] = choice.speculation.describe()
    if plan.results.goodput:
        extra["goodput_slo_ms"] = dict(plan.results.goodput)
    extra.update(cluster)
    return extra


def write_run(run_dir: Path, plan: RunPlan, requests: Sequence[Request], backend: Backend,
              outcome: Any, result: dict[str, Any], extra: dict[str, Any], times: TimesTable,
              replica_of: Sequence[int] | None, sweep_label: str | None) -> None:
    """The run's result files placed in run_dir as one unit with its manifest and run.log's
    summary (result_as_one_unit); the summary printed, or in a sweep its one line."""
    from experiments.metrics import format_summary
    from experiments.result_files import write_results

    hidden = {STAMP_KEY, *(CUDA_ONLY_FIELDS if extra.get("device") == "cpu" else ())}
    text = format_summary(result, {k: v for k, v in extra.items() if k not in hidden},
                          shown=plan.results.shown)
    with result_as_one_unit(run_dir) as commit:
        write_results(run_dir, result, requests, extra,
                      steps=getattr(outcome, "steps", None), summary_text=text,
                      replicas=replica_of, times=times, streamed=backend.streamed,
                      extra_columns=backend.request_columns)
        if sweep_label is None:
            lines = [text, f"results: {run_dir}{os.sep} ({', '.join(_written(run_dir))})"]
            commit(lines, lines)
        else:
            line = sweep_line(sweep_label, result, run_dir)
            commit([text, line], [line])


def no_huge_pages() -> None:
    """Ask numpy not to request transparent huge pages for its large arrays (what
    NUMPY_MADVISE_HUGEPAGE=0 sets when numpy is imported; a value given in the environment is
    kept). Where the kernel compacts memory to find huge pages for a region that asks
    (transparent_hugepage/defrag = madvise, a common default), a long run's first arrays of
    tens of MB cost much system time (BENCHMARKS.md, "system time", has the figures)."""
    if "NUMPY_MADVISE_HUGEPAGE" in os.environ:
        return
    import numpy as np

    core = getattr(np, "_core", None) or getattr(np, "core", None)
    setting = getattr(getattr(core, "multiarray", None), "_set_madvise_hugepage", None)
    if setting is not None:
        setting(False)


def _written(run_dir: Path) -> list[str]:
    from experiments.result_files import RESULT_FILES

    names = [name for name in RESULT_FILES if (run_dir / name).is_file()]
    return names + [p.name for p in run_dir.glob("*.log")]


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def _app(cfg: DictConfig) -> str | None:
    """One run; in a sweep its line is also the job's return, which a launcher whose jobs
    print elsewhere (submitit's log files) prints in the sweep process."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    stop_with_sweep()
    no_huge_pages()
    log_to_run_log()
    warnings.formatwarning = one_line_warning
    hydra_cfg = HydraConfig.get()
    run_dir = hydra_cfg.runtime.output_dir
    # a sweep prints one line per run (its summary is in summary.txt and run.log)
    sweep_label = job_label(hydra_cfg) if hydra_cfg.mode == RunMode.MULTIRUN else None
    if cfg.get("skip_existing", False) and finished(run_dir, config_stamp(cfg)):
        line = f"skipping {run_dir}: result.json of this configuration exists"
        say(line)
        return line
    try:
        # Hydra has written this run's .hydra files already; run() checks every setting before
        # it removes a previous run's results (a typo keeps them), then the run starts.
        result = run(cfg, run_dir, sweep_label=sweep_label)
    except (ValueError, OSError, TypeError, RunDirError) as err:  # bad settings, input: one line
        # TypeError: a setting of the wrong type (e.g. a word where a number goes)
        what = "a setting has the wrong type: " if isinstance(err, TypeError) else ""
        line = f"error: {what}{err}"
        say(line, error=True)
        if "submitit" in str(hydra_cfg.launcher.get("_target_", "")):
            raise RunFailed(line) from None
        sys.exit(2)
    return None if sweep_label is None else sweep_line(sweep_label, result, Path(run_dir))


def refuse_moved_settings(overrides: Sequence[str]) -> None:
    """A setting given under its old name (policy.overlap, now scheduler.overlap) is one line
    and exit 2, before Hydra's own several-line error for an unknown key."""
    for arg in overrides:
        key = arg.lstrip("+").partition("=")[0]
        group, _, name = key.partition(".")
        if group == "policy" and name in MOVED_SETTINGS:
            print(f"error: policy.{name} is now scheduler.{name}: overlap scheduling is a mode "
                  "of the engine loop, for every policy", file=sys.stderr)
            sys.exit(2)


def main() -> None:
    """``python -m experiments.run`` / ``schedlab-run``: the Hydra app; Ctrl-C and SIGTERM
    (kill, timeout, scancel) are one line and exit 130 and 143 (128 + the signal's number)."""
    import signal

    terminated: list[int] = []

    def on_sigterm(signum: int, frame: object) -> None:
        # SIGTERM takes Ctrl-C's path, so that the same cleanup runs (tensor-parallel workers
        # ended, their rendezvous directory removed); a second SIGTERM ends the process at once
        terminated.append(signum)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    refuse_moved_settings(sys.argv[1:])
    global LEAVE_TO_EXIT
    LEAVE_TO_EXIT = True
    try:
        with suggest_keys("config", sys.argv[1:]):  # "did you mean ...?" after Hydra's error
            _app()
    except RunExit as err:  # a run of a submitit sweep failed (RunFailed)
        print(err.message, file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        # A run's result files and its manifest are one unit (result_as_one_unit): a Ctrl-C
        # acted on before they are committed leaves none of them, one after leaves the whole.
        if sweeping():
            print("interrupted: the sweep's finished runs keep their results; no other result "
                  "written", file=sys.stderr)
        elif _completed:
            sys.exit(0)  # the run completed (its summary printed) before the interrupt
        else:
            print("interrupted: no result written", file=sys.stderr)
        sys.exit(128 + signal.SIGTERM if terminated else 130)
    if _left_to_exit:
        exit_leaving_objects()


def exit_leaving_objects() -> None:
    """End the process as Python would (exit status 0, every atexit handler run, stdout and
    stderr flushed) but without freeing its objects one by one: the operating system takes
    the memory back at once. Not where a thread other than daemons is still running, nor under
    a profiler, tracer or debugger (``python -m cProfile``, coverage), whose own work at exit
    would be lost."""
    import atexit
    import threading

    monitoring = getattr(sys, "monitoring", None)  # Python 3.12+: cProfile's and pdb's hooks
    watched = monitoring is not None and any(
        monitoring.get_tool(tool) is not None
        for tool in (monitoring.PROFILER_ID, monitoring.DEBUGGER_ID))
    if watched or sys.getprofile() is not None or sys.gettrace() is not None or \
            any(t.is_alive() and not t.daemon for t in threading.enumerate()
                if t is not threading.main_thread()):
        return
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:  # a closed pipe: Python's own exit status for it
        os._exit(120)
    os._exit(0)


if __name__ == "__main__":
    main()
