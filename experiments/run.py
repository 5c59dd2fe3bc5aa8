"""The main run: one workload on one backend under one policy, written as vLLM-style results."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from experiments.paths import conf_dir
from experiments.run_dir import CONTROL_KEYS, STAMP_KEY, config_stamp, finished
from experiments.sweep_workers import stop_with_sweep
from policies import ModelSpec, SchedulerConfig, make_policy, make_scheduler
from policies.base import check_int, check_number, check_settings

CONF_DIR = str(conf_dir())  # one home: experiments/paths.py


def plain(section: Any) -> dict[str, Any]:
    return OmegaConf.to_container(section, resolve=True) if isinstance(section, DictConfig) else dict(section)


def known_settings() -> tuple[list[str], list[str]]:
    """The top-level keys a run reads (conf/config.yaml's own keys, its config groups and the
    control keys), and the sim backend's settings (conf/backend/sim.yaml's keys)."""
    top = OmegaConf.load(Path(CONF_DIR) / "config.yaml")
    groups = [next(iter(d)) for d in top.get("defaults", []) if isinstance(d, Mapping)]
    keys = [k for k in top if k not in ("defaults", "hydra")] + groups + list(CONTROL_KEYS)
    return keys, list(OmegaConf.load(Path(CONF_DIR) / "backend" / "sim.yaml"))


def _check_bool(setting: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{setting} must be true or false, got {value!r}")


def check_sim_settings(cfg: Mapping[str, Any], backend: Mapping[str, Any]) -> None:
    """The sim backend's settings and the top-level switches, by type: a word where
    a number goes, or 'maybe' for a switch, is a one-line error naming the setting."""
    for key in CONTROL_KEYS:
        if key in cfg:
            _check_bool(key, cfg[key])
    _check_bool("backend.stream_per_step", backend.get("stream_per_step", False))
    if backend.get("num_blocks") is not None:
        check_int("backend.num_blocks", backend["num_blocks"], 1)
    # types only: the simulator checks the ranges (simulate: time_scale; memory: utilization)
    check_number("backend.time_scale", backend.get("time_scale", 1.0))
    check_number("gpu_memory_utilization", cfg.get("gpu_memory_utilization", 0.9))


def outcome_stats(outcome: Any) -> dict[str, Any]:
    """The backend-independent counters of a run, for result.json's schedlab section."""
    st = outcome.stats
    stats = {k: getattr(st, k) for k in ("num_invocations", "num_windows", "num_steps",
                                         "num_preemptions", "num_wasted_steps")} \
        if not isinstance(st, Mapping) else dict(st)
    for key in ("num_blocks", "gpu_busy_fraction", "cpu_busy_fraction"):
        if hasattr(outcome, key):
            stats[key] = getattr(outcome, key)
    return stats


def run(cfg: Mapping[str, Any], run_dir: str | os.PathLike) -> dict[str, Any]:
    """Run one configuration and write result.json / requests.csv (/ steps.csv) into run_dir."""
    from experiments.metrics import format_summary, summarize, write_results
    from experiments.workload import build_workload, to_request

    run_dir = Path(run_dir)
    top_keys, sim_keys = known_settings()
    check_settings("the config's top level", cfg, top_keys)  # +gpu_memory_utilisation=0.5
    backend = plain(cfg["backend"])
    if backend.get("name") == "sim":  # the real backend's settings are checked by run_real
        check_settings("backend", backend, sim_keys)
        check_sim_settings(cfg, backend)
    model = ModelSpec.from_dict(plain(cfg["model"]))
    policy_cfg = plain(cfg["policy"])
    policy_name = policy_cfg.pop("name")
    policy = make_policy(policy_name, **policy_cfg)  # fail fast on bad settings
    sched_cfg = SchedulerConfig.from_dict(plain(cfg["scheduler"]))
    with_ids = backend["name"] == "real"  # the simulator needs lengths only
    specs = build_workload(plain(cfg["workload"]), vocab_size=model.vocab_size if with_ids else None,
                           max_model_len=model.max_model_len)
    requests = [to_request(spec, i, with_token_ids=with_ids) for i, spec in enumerate(specs)]

    def new_scheduler(num_blocks: int):
        return make_scheduler(policy_name, policy_cfg, sched_cfg, num_blocks, model.max_model_len)

    time_scale = float(backend.get("time_scale", 1.0))  # the simulator's
    wall0 = time.perf_counter()
    if backend["name"] == "sim":
        from simulator.engine import simulate
        from simulator.hardware import HardwareSpec
        from simulator.overhead import OverheadSpec

        outcome = simulate(requests, new_scheduler, model, HardwareSpec.from_dict(plain(cfg["hardware"])),
                           OverheadSpec.from_dict(plain(cfg["overhead"])),
                           block_size=sched_cfg.block_size,
                           gpu_memory_utilization=float(cfg["gpu_memory_utilization"]),
                           stream_per_step=bool(backend.get("stream_per_step", False)),
                           num_blocks=backend.get("num_blocks"),
                           time_scale=time_scale,
                           progress=bool(cfg.get("progress", True)))
    elif backend["name"] == "real":
        from real_backend.engine import run_real

        settings = {k: v for k, v in backend.items() if k != "name"}
        outcome = run_real(requests, new_scheduler, model, settings,
                           progress=bool(cfg.get("progress", True)))
    else:
        raise ValueError(f"backend.name must be sim or real, got {backend['name']!r}")
    wall = time.perf_counter() - wall0

    summary = summarize(requests, outcome.duration)
    extra = {
        "backend": backend["name"],
        "policy": policy_name,
        "policy_settings": policy.describe(),
        "k": getattr(policy, "num_steps", 1),
        "overlap": bool(getattr(policy, "overlap", False)),
        "model": model.name,
        "hardware": (plain(cfg["hardware"]).get("name") if backend["name"] == "sim"
                     else getattr(outcome, "stats", {}).get("device_name", backend.get("device"))),
        "overhead": plain(cfg["overhead"]).get("name") if backend["name"] == "sim" else None,
        "workload": plain(cfg["workload"]),
        "wall_seconds": wall,
        **outcome_stats(outcome),
        STAMP_KEY: config_stamp(cfg),
    }
    if backend["name"] == "sim":
        extra["time_scale"] = time_scale
        extra["simulated_seconds"] = outcome.duration
        extra["simulated_seconds_per_wall_second"] = outcome.duration / max(wall, 1e-9)
    if backend.get("save_token_ids"):
        summary["output_token_ids"] = [list(r.output_token_ids) for r in requests]
    write_results(run_dir, summary, requests, extra, steps=getattr(outcome, "steps", None))
    print(format_summary(summary, {k: v for k, v in extra.items() if k != STAMP_KEY}))
    return {**summary, "schedlab": extra}


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def _app(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from experiments.metrics import clear_results

    stop_with_sweep()
    run_dir = HydraConfig.get().runtime.output_dir
    if cfg.get("skip_existing", False) and finished(run_dir, config_stamp(cfg)):
        print(f"skipping {run_dir}: result.json of this configuration exists")
        return
    try:
        # Hydra has written this run's .hydra files already; a previous run's results go now,
        # so a failure or a kill below never leaves them beside this run's config.
        clear_results(run_dir)
        run(cfg, run_dir)
    except (ValueError, OSError) as err:  # bad settings or input: one line, no traceback
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except TypeError as err:  # a setting of the wrong type (e.g. a word where a number goes)
        print(f"error: a setting has the wrong type: {err}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    """``python -m experiments.run`` / ``schedlab-run``: the Hydra app; Ctrl-C is one line."""
    try:
        _app()
    except KeyboardInterrupt:
        # The run's result files are written as one unit, so none of them is left.
        print("interrupted: no result written", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
