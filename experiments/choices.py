"""The settings a run is made of, checked: the policy and scheduler a config names
(``PolicyChoice``, run's and serve's), its cluster and router (``ClusterChoice``), the keys a
run knows (``known_settings``) and the simulator backend's switches (``check_sim_settings``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from common.parallel import ParallelConfig
from common.paths import conf_dir
from experiments.run_dir import CONTROL_KEYS
from policies import ModelSpec, Scheduler, SchedulerConfig, make_policy, make_scheduler
from policies.base import Policy, check_int, check_number


def plain(section: Any) -> dict[str, Any]:
    return OmegaConf.to_container(section, resolve=True) if isinstance(section, DictConfig) else dict(section)


def known_settings() -> tuple[list[str], list[str]]:
    """The top-level keys a run reads (conf/config.yaml's own keys, its config groups and the
    control keys), and the sim backend's settings (conf/backend/sim.yaml's keys)."""
    top = OmegaConf.load(Path(conf_dir()) / "config.yaml")
    groups = [next(iter(d)) for d in top.get("defaults", []) if isinstance(d, Mapping)]
    keys = [k for k in top if k not in ("defaults", "hydra")] + groups + list(CONTROL_KEYS)
    return keys, list(OmegaConf.load(Path(conf_dir()) / "backend" / "sim.yaml"))


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
    # the utilization's range is checked with the KV cache's size (simulator/memory.py)
    check_number("backend.time_scale", backend.get("time_scale", 1.0), positive=True)
    check_number("gpu_memory_utilization", cfg.get("gpu_memory_utilization", 0.9))


class PolicyChoice:
    """The policy a config names, with its settings and the scheduler limits checked, and how
    to make its scheduler over a KV cache of a given size (experiments.run and serve alike)."""

    def __init__(self, cfg: Mapping[str, Any], model: ModelSpec) -> None:
        self.settings = plain(cfg["policy"])
        self.name = self.settings.pop("name")
        self.policy: Policy = make_policy(self.name, **self.settings)  # fail fast on bad settings
        self.scheduler = SchedulerConfig.from_dict(plain(cfg["scheduler"]))
        self.max_model_len = model.max_model_len
        # Policies that size windows by time price them with the hardware profile's cost model,
        # on either backend (for the real engine: the profile of its GPU, e.g. hardware=h200_ops)
        # (and slowdown's service time alone)
        self.step_time_fn = self.service_time_fn = None
        if cfg.get("hardware") is not None:
            from simulator.cost_model import service_time_fn, step_time_fn
            from simulator.hardware import HardwareSpec

            parallel = ParallelConfig.from_mapping(plain(cfg.get("parallel") or {}))
            hardware = HardwareSpec.from_dict(plain(cfg["hardware"]), parallel)
            self.step_time_fn = step_time_fn(model, hardware)
            self.service_time_fn = service_time_fn(model, hardware)

    def new_scheduler(self, num_blocks: int) -> Scheduler:
        return make_scheduler(self.name, self.settings, self.scheduler, num_blocks,
                              self.max_model_len, self.step_time_fn)


class ClusterChoice:
    """The cluster a config names (``cluster.num_replicas`` or ``cluster.groups``, docs/cluster.md)
    and its router (``router``), checked; the replicas' engines for the simulator."""

    def __init__(self, cfg: Mapping[str, Any], backend: Mapping[str, Any], model: ModelSpec,
                 parallel: ParallelConfig) -> None:
        from policies.routers import make_router
        from simulator.cluster import replica_groups

        router = plain(cfg.get("router") or {"name": "round_robin"})
        self.router_name = router.pop("name", "round_robin")
        self.router = make_router(self.router_name, **router)
        run_sections = {key: plain(cfg[key]) for key in ("model", "hardware", "overhead",
                                                         "policy", "scheduler") if key in cfg}
        run_sections.update(gpu_memory_utilization=cfg.get("gpu_memory_utilization", 0.9),
                            num_blocks=backend.get("num_blocks"))
        self.groups = replica_groups(plain(cfg.get("cluster") or {}), run_sections,
                                     _conf_section)
        self.size = sum(n for n, _ in self.groups)
        if self.size > 1 and backend.get("name") != "sim":
            raise ValueError("cluster.num_replicas > 1 is simulated only (backend=sim)")
        self.parallel = parallel
        self.labels: list[dict[str, Any]] = []

    def replica_specs(self, cfg: Mapping[str, Any], backend: Mapping[str, Any]) -> list[Any]:
        """Each replica's engine: its group's model, hardware, overhead, policy and KV cache."""
        from simulator.hardware import HardwareSpec
        from simulator.memory import blocks_per_engine
        from simulator.outcome import ReplicaSpec
        from simulator.overhead import OverheadSpec

        specs = []
        for g, (n, sections) in enumerate(self.groups):
            model = ModelSpec.from_dict(sections["model"])
            self.parallel.check_model(model)
            choice = PolicyChoice({**cfg, **sections}, model)
            hardware = HardwareSpec.from_dict(sections["hardware"], self.parallel)
            overhead = OverheadSpec.from_dict(sections["overhead"])
            util = float(sections["gpu_memory_utilization"])
            num_blocks = sections["num_blocks"]
            if num_blocks is None:
                num_blocks = blocks_per_engine(model, hardware,
                                               block_size=choice.scheduler.block_size,
                                               gpu_memory_utilization=util)
            for _ in range(n):
                specs.append(ReplicaSpec(
                    choice.new_scheduler, model, hardware, overhead,
                    block_size=choice.scheduler.block_size, gpu_memory_utilization=util,
                    num_blocks=num_blocks,
                    stream_per_step=bool(backend.get("stream_per_step", False)),
                    time_scale=float(backend.get("time_scale", 1.0)), group=g))
                self.labels.append({"group": g, "model": model.name,
                                    "hardware": sections["hardware"].get("name"),
                                    "overhead": sections["overhead"].get("name"),
                                    "policy": choice.name,
                                    "k": getattr(choice.policy, "num_steps", 1)})
        return specs


def _conf_section(group: str, name: str) -> dict[str, Any]:
    """conf/<group>/<name>.yaml (a replica group's config by name)."""
    path = Path(conf_dir()) / group / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"cluster.groups: no {group} config {name!r} ({path})")
    return plain(OmegaConf.load(path))
