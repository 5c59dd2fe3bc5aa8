"""What the Hydra command lines (experiments.run, experiments.serve) check before anything runs:
every job of a sweep, with the checks a run makes of its settings, before the first job starts;
and, for a key the config does not have, the key it most likely meant. (Their short --help is
conf/hydra/help/schedlab.yaml.)"""

from __future__ import annotations

import contextlib
import copy
import difflib
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

# what a bad setting raises: the errors a run reports in one line (experiments/run.py _app),
# and a job's config that does not compose
CHECK_ERRORS = (ValueError, TypeError, OSError, HydraException, OmegaConfBaseException)


@dataclass(frozen=True)
class RunSettings:
    """What a run's settings make before it reads any input: run()'s first step
    (experiments/run.py RunPlan.of) and a sweep's check of each job take them from here."""

    backend_cls: Any
    results: Any
    model: Any
    parallel: Any
    choice: Any
    cluster: Any


def check_run_settings(cfg: Mapping[str, Any]) -> RunSettings:
    """The checks a run makes of its settings before it reads any input (the first steps of
    experiments/run.py run), without building a backend: a bad value raises one line naming
    the setting."""
    from common.parallel import ParallelConfig
    from experiments.backends import backend_class
    from experiments.choices import ClusterChoice, PolicyChoice, known_settings, plain
    from experiments.metrics import result_settings
    from policies import ModelSpec
    from policies.base import check_settings

    check_settings("the config's top level", cfg, known_settings()[0])
    backend_cls = backend_class(cfg)
    backend_cls.check(cfg)
    results = result_settings(plain(cfg.get("metrics") or {}), plain(cfg.get("goodput") or {}))
    model = ModelSpec.from_dict(plain(cfg["model"]))
    parallel = ParallelConfig.from_mapping(plain(cfg.get("parallel") or {}))
    parallel.check_model(model)
    choice = PolicyChoice(cfg, model)
    cluster = ClusterChoice(cfg, plain(cfg["backend"]), parallel)
    return RunSettings(backend_cls, results, model, parallel, choice, cluster)


class SweepCheckCallback(Callback):
    """Before a multirun's first job starts, every job's config is composed and checked as its
    run would check it: a bad value in one job (``-m policy.num_steps=1,2,0``) stops the sweep
    at once in one line naming the job, instead of when that job's turn comes."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.core.global_hydra import GlobalHydra

        from experiments.sweep_workers import job_overrides

        jobs = job_overrides(config)
        if jobs and GlobalHydra.instance().is_initialized():
            problem = first_bad_job(GlobalHydra.instance().config_loader(), config, jobs)
            if problem:
                print(problem, file=sys.stderr)
                sys.exit(2)


def first_bad_job(loader: Any, master: DictConfig, jobs: Sequence[Sequence[str]]) -> str | None:
    """The error line of the first job whose config fails to compose or fails the run's checks,
    else None. Jobs that choose the same config groups share one composition (Hydra's, with the
    sweep's own overrides); each job's values are then applied to a copy as Hydra applies them.
    Jobs that differ only in what the checks do not read (hydra.*, the workload: its requests
    are checked as they are read) are checked once."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    composed: dict[tuple[str, ...], DictConfig] = {}
    checked: set[tuple[tuple[str, ...], tuple[str, ...]]] = set()
    for num, overrides in enumerate(jobs, 1):
        key: tuple[str, ...] = ()
        try:
            groups, values = [], []
            for o in parser.parse_overrides(list(overrides)):
                if loader.repository.group_exists(o.key_or_group):
                    groups.append(o)
                elif not o.key_or_group.startswith(("hydra.", "workload.")):
                    values.append(o)
            key = tuple(o.input_line for o in groups)
            if (key, tuple(o.input_line for o in values)) in checked:
                continue
            try:
                if key not in composed:  # a run's config, as its job gets it: no hydra node
                    cfg = loader.load_sweep_config(master, list(key))
                    composed[key] = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
                cfg = copy.deepcopy(composed[key])
                ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
            except CHECK_ERRORS:  # the shortcut's error: Hydra's own composition says
                cfg = loader.load_sweep_config(master, list(overrides))
                cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
            check_run_settings(cfg)
            checked.add((key, tuple(o.input_line for o in values)))
        except CHECK_ERRORS as err:
            what = " ".join(str(err).split())
            hint = unknown_key_hint(overrides, composed.get(key))
            return (f"error: job {num} of {len(jobs)} ({','.join(overrides)}): {what}"
                    f"{'; ' + hint if hint else ''}")
    return None


def config_keys(cfg: Any, prefix: str = "") -> Iterator[str]:
    """Every key of a config, dotted (``policy``, ``policy.num_steps``, ...)."""
    if isinstance(cfg, Mapping):
        for name, value in cfg.items():
            key = f"{prefix}{name}"
            yield key
            yield from config_keys(value, f"{key}.")


def unknown_key_hint(overrides: Sequence[str], cfg: DictConfig | None) -> str:
    """"did you mean policy.num_steps?" for each override whose key the config lacks and that
    is close to one it has (difflib); "" when none is."""
    if cfg is None:
        return ""
    keys = list(config_keys(OmegaConf.to_container(cfg, resolve=False)))
    known = set(keys)
    hints = []
    for arg in overrides:
        if arg.startswith(("+", "~", "-")) or "=" not in arg:
            continue  # an addition or deletion, or a flag
        key = arg.partition("=")[0]
        if key not in known and (close := difflib.get_close_matches(key, keys, n=1)):
            hints.append(f"did you mean {close[0]}?")
    return " ".join(hints)


@contextlib.contextmanager
def suggest_keys(config_name: str, argv: Sequence[str]) -> Iterator[None]:
    """Around a Hydra app: when it fails (Hydra's "use +key" error for an unknown key, and
    exit 1), one more line, "did you mean policy.num_steps?", for each key the config lacks that
    is close to one it has. Costs nothing when the app does not fail."""
    try:
        yield
    except SystemExit as exit_:
        if exit_.code == 1:  # Hydra's own error (a run's bad setting is exit 2, said already)
            hint = unknown_key_hint(argv, _composed(config_name, argv))
            if hint:
                print(hint, file=sys.stderr)
        raise


def _composed(config_name: str, argv: Sequence[str]) -> DictConfig | None:
    """The config of the command line's group choices (``policy=cp1``: its keys are the ones
    the other overrides may name), or of none if they do not compose."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from common.paths import conf_dir

    groups = [a for a in argv if not a.startswith("-") and "=" in a and "," not in a
              and "." not in a.partition("=")[0]]
    GlobalHydra.instance().clear()
    for overrides in (groups, []):
        try:
            with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
                return compose(config_name, overrides=overrides, return_hydra_config=True)
        except CHECK_ERRORS:
            GlobalHydra.instance().clear()
    return None
