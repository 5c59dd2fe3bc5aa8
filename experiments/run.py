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

from policies import ModelSpec, SchedulerConfig, make_policy, make_scheduler

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def plain(section: Any) -> dict[str, Any]:
    return OmegaConf.to_container(section, resolve=True) if isinstance(section, DictConfig) else dict(section)


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
    backend = plain(cfg["backend"])
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
        "model": model.name,
        "hardware": (plain(cfg["hardware"]).get("name") if backend["name"] == "sim"
                     else getattr(outcome, "stats", {}).get("device_name", backend.get("device"))),
        "overhead": plain(cfg["overhead"]).get("name") if backend["name"] == "sim" else None,
        "workload": plain(cfg["workload"]),
        "wall_seconds": wall,
        **outcome_stats(outcome),
    }
    if backend["name"] == "sim":
        extra["time_scale"] = time_scale
        extra["simulated_seconds"] = outcome.duration
        extra["simulated_seconds_per_wall_second"] = outcome.duration / max(wall, 1e-9)
    if backend.get("save_token_ids"):
        summary["output_token_ids"] = [list(r.output_token_ids) for r in requests]
    write_results(run_dir, summary, requests, extra, steps=getattr(outcome, "steps", None))
    print(format_summary(summary, extra))
    return {**summary, "schedlab": extra}


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    run_dir = HydraConfig.get().runtime.output_dir
    if cfg.get("skip_existing", False) and (Path(run_dir) / "result.json").exists():
        print(f"skipping {run_dir}: result.json exists")
        return
    try:
        run(cfg, run_dir)
    except (ValueError, OSError) as err:  # bad settings or input: one line, no traceback
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except TypeError as err:  # a setting of the wrong type (e.g. a word where a number goes)
        print(f"error: a setting has the wrong type: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
