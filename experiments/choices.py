"""The settings a run is made of, checked: the policy and scheduler a config names
(``PolicyChoice``, run's and serve's) and the longest request its scheduler admits
(``request_limit``), its cluster, replica groups and router (``ClusterChoice``), the keys a run
knows (``known_settings``) and the simulator backend's switches (``check_sim_settings``)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from common.checks import settings_at
from common.parallel import ParallelConfig
from common.paths import conf_dir
from experiments.run_dir import CONTROL_KEYS
from policies import (
    ModelSpec,
    Scheduler,
    SchedulerConfig,
    Speculation,
    make_policy,
    make_scheduler,
    make_speculation,
)
from policies.base import Policy, check_int, check_number

if TYPE_CHECKING:
    from simulator.hardware import HardwareSpec
    from simulator.overhead import OverheadSpec


def plain(section: Any) -> dict[str, Any]:
    return OmegaConf.to_container(section, resolve=True) if isinstance(section, DictConfig) else dict(section)


def known_settings() -> tuple[list[str], list[str]]:
    """The top-level keys a run reads (conf/config.yaml's own keys, its config groups and the
    control keys), and the sim backend's settings (conf/backend/sim.yaml's keys)."""
    top, sim = _known_settings()
    return list(top), list(sim)


@functools.cache
def _known_settings() -> tuple[tuple[str, ...], tuple[str, ...]]:
    # read once a process: a sweep's check of every job asks for them once a job
    top = OmegaConf.load(Path(conf_dir()) / "config.yaml")
    groups = [next(iter(d)) for d in top.get("defaults", []) if isinstance(d, Mapping)]
    keys = [k for k in top if k not in ("defaults", "hydra")] + groups + list(CONTROL_KEYS)
    return tuple(keys), tuple(OmegaConf.load(Path(conf_dir()) / "backend" / "sim.yaml"))


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
    from simulator.engine import MAX_TIME_SCALE

    check_number("backend.time_scale", backend.get("time_scale", 1.0), positive=True,
                 maximum=MAX_TIME_SCALE)
    check_number("gpu_memory_utilization", cfg.get("gpu_memory_utilization", 0.9))


def profile_step_time(model: Mapping[str, Any], hardware: Mapping[str, Any],
                      parallel: Mapping[str, Any] | None = None) -> Any:
    """The StepTimeFn of a hardware profile's cost model for a model (config sections as
    plain mappings): what policies that size windows by time price steps with. vLLM's engine
    core builds it by this name from its additional_config (vllm_backend/scheduler.py)."""
    from simulator.cost_model import step_time_fn
    from simulator.hardware import HardwareSpec

    spec = HardwareSpec.from_dict(dict(hardware), ParallelConfig.from_mapping(dict(parallel or {})))
    return step_time_fn(ModelSpec.from_dict(dict(model)), spec)


class PolicyChoice:
    """The policy a config names, with its settings and the scheduler limits checked, and how
    to make its scheduler over a KV cache of a given size (experiments.run and serve alike)."""

    def __init__(self, cfg: Mapping[str, Any], model: ModelSpec,
                 run: Mapping[str, Any] | None = None) -> None:
        self.settings = plain(cfg["policy"])
        self.name = self.settings.pop("name")
        self.policy: Policy = make_policy(self.name, **self.settings)  # fail fast on bad settings
        self.scheduler = SchedulerConfig.from_dict(plain(cfg["scheduler"]))
        self.max_model_len = model.max_model_len
        # speculative decoding: the run's spec section and its workload's acceptance (``run``:
        # the run's config where ``cfg`` is a replica group's sections)
        run = cfg if run is None else run
        self.speculation = speculation_choice(run, cfg, model)
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
                              self.max_model_len, self.step_time_fn, self.speculation)


def draft_model_spec(spec: Mapping[str, Any] | None, model: ModelSpec) -> ModelSpec | None:
    """The draft model ``spec.draft_model`` names (conf/model/<name>.yaml; ``same``: the
    target), where ``spec.method`` is draft; else None."""
    if not spec or spec.get("method") != "draft":
        return None
    name = spec.get("draft_model")
    if name == "same":
        return model
    if not isinstance(name, str) or not (Path(conf_dir()) / "model" / f"{name}.yaml").is_file():
        raise ValueError(f"spec.draft_model: no model config {name!r} in conf/model (or `same`: "
                         "the target itself)")
    return ModelSpec.from_dict(plain(OmegaConf.load(Path(conf_dir()) / "model" / f"{name}.yaml")))


def speculation_choice(run: Mapping[str, Any], sections: Mapping[str, Any],
                       model: ModelSpec) -> Speculation | None:
    """The run's speculative decoding (``spec``; None: off), with the workload's acceptance
    process and, for a draft model, the price of its steps on ``sections``' hardware."""
    spec = plain(run["spec"]) if run.get("spec") is not None else None
    if not spec or spec.get("method", "off") in ("off", False):
        return None
    from common.spec_acceptance import acceptance_process

    workload = plain(run["workload"]) if run.get("workload") is not None else {}
    acceptance = acceptance_process(workload.get("acceptance"), workload.get("seed", 0) or 0)
    draft = draft_model_spec(spec, model)
    draft_time = None
    if draft is not None and sections.get("hardware") is not None:
        from simulator.cost_model import step_time_fn
        from simulator.hardware import HardwareSpec

        parallel = ParallelConfig.from_mapping(plain(sections.get("parallel") or {}))
        draft_time = step_time_fn(draft, HardwareSpec.from_dict(plain(sections["hardware"]),
                                                                parallel))
    return make_speculation(spec, acceptance, draft_time, draft)


def request_limit(sched: Scheduler, where: str = "") -> tuple[int, str]:
    """The longest request (prompt + output tokens) ``sched`` admits, alone, and what sets it,
    named at ``where`` (a replica group's ``cluster.groups[i]``; "": the top level): its
    ``add_request`` checks solved for the total (model.max_model_len; the KV cache's blocks
    less the watermark, less the policy's lookahead slots; the token budget of a policy that
    does not chunk prefills). Of equal limits the first is named."""
    at, cache = (f"{where}.", f"{where}'s KV cache") if where else ("", "the KV cache")
    bm = sched.block_manager
    policy = sched.policy
    lookahead = sched.lookahead_slots
    kv = (bm.num_blocks - bm.watermark_blocks) * bm.block_size - lookahead
    limits = [(sched.max_model_len, f"{at}model.max_model_len = {sched.max_model_len}"),
              (kv, f"{kv}, what {cache} holds ({bm.num_blocks} blocks of {bm.block_size} "
                   f"tokens, less the watermark and {lookahead} lookahead slots)")]
    if not policy.chunk_prefills:
        limits.append((sched.max_num_batched_tokens,
                       f"{at}scheduler.max_num_batched_tokens = {sched.max_num_batched_tokens} "
                       f"(policy {policy.name} prefills whole)"))
    return min(limits, key=lambda limit: limit[0])


def max_request_tokens(sched: Scheduler) -> int:
    """The longest request (prompt + output tokens) ``sched`` admits, alone (``request_limit``);
    a served request without max_tokens gets this, less its prompt."""
    return request_limit(sched)[0]


@dataclass
class ReplicaGroup:
    """One replica group's engine, its settings checked: the run's sections with the group's on
    top (``sections``), its model, policy and scheduler, GPU, CPU costs and KV cache."""

    replicas: int
    where: str  # cluster.groups[i], or "" for the run's own settings
    sections: dict[str, Any]
    model: ModelSpec
    choice: PolicyChoice
    hardware: HardwareSpec
    overhead: OverheadSpec
    gpu_memory_utilization: float
    num_blocks: int  # per virtual engine
    role: str = "mixed"  # prefill, decode or mixed: disaggregation (docs/cluster.md)
    parallel: ParallelConfig = ParallelConfig()  # the run's, or the group's own over it

    @property
    def num_gpus(self) -> int:
        """GPUs its replicas take: replicas x tensor x pipeline parallel size."""
        return self.replicas * self.parallel.num_gpus

    def request_limit(self) -> tuple[int, str]:
        """The longest request one of its replicas admits, and what sets it."""
        return request_limit(self.choice.new_scheduler(self.num_blocks), self.where)


class ClusterChoice:
    """The cluster a config names (``cluster.num_replicas`` or ``cluster.groups``, docs/cluster.md)
    and its router (``router``), checked; for the simulator, each replica group's engine.

    One replica is a cluster too: a run's engine is its one group's, ``cluster.groups`` set or
    not (``groups[0]``). ``sections`` are the ones result.json names: the one replica's, or
    the run's own for several."""

    def __init__(self, cfg: Mapping[str, Any], backend: Mapping[str, Any],
                 parallel: ParallelConfig) -> None:
        from dataclasses import asdict

        from experiments.workload.footprint import check_replicas_fit
        from policies.routers import make_router
        from simulator.cluster import GROUP_KEYS, replica_groups

        self.run_cfg = cfg  # its spec and workload sections: speculative decoding
        router = plain(cfg.get("router") or {"name": "round_robin"})
        self.router_name = router.pop("name", "round_robin")
        self.router = make_router(self.router_name, **router)
        run_sections = {key: plain(cfg[key]) for key in ("model", "hardware", "overhead",
                                                         "policy", "scheduler") if key in cfg}
        run_sections["parallel"] = asdict(parallel)  # checked: a group's own goes over it
        run_sections.update(gpu_memory_utilization=cfg.get("gpu_memory_utilization", 0.9),
                            num_blocks=backend.get("num_blocks"))
        cluster = plain(cfg.get("cluster") or {})
        groups = replica_groups(cluster, run_sections, conf_section)
        grouped = cluster.get("groups") is not None
        self.size = sum(n for n, _ in groups)
        self.sections = groups[0][1] if self.size == 1 else run_sections
        self.groups: list[ReplicaGroup] = []
        self.parallel = parallel  # the parallelism result.json names (as ``sections``)
        self.run_parallel = parallel
        self.labels: list[dict[str, Any]] = []
        # disaggregation: the decode pool's router, the link its KV crosses, early rejection
        self.decode_router: Any = None
        self.link: Any = None
        self.early_rejection = False
        self.disaggregated = any(settings.get("role", "mixed") != "mixed" for _, settings in groups)
        # a group with parallel settings of its own: result.json names each replica's and the
        # cluster's GPUs (a cluster without keeps its result.json as before)
        self.own_parallel = grouped and any(g.get("parallel") is not None
                                            for g in cluster["groups"])
        if backend.get("name") != "sim":
            if grouped:
                raise ValueError("cluster.groups is simulated only (backend=sim)")
            if self.size > 1:
                raise ValueError("cluster.num_replicas > 1 is simulated only (backend=sim)")
            return
        # before any replica's state is made (a group's engine is made once for its replicas)
        splits = []
        for i, (_, sections) in enumerate(groups):
            with settings_at(f"cluster.groups[{i}]", GROUP_KEYS) if grouped else \
                    contextlib.nullcontext():
                splits.append(ParallelConfig.from_mapping(sections["parallel"]))
        check_replicas_fit([(n, split.pipeline_parallel_size)
                            for (n, _), split in zip(groups, splits, strict=True)],
                           "cluster.groups' replicas" if grouped else "cluster.num_replicas")
        for i, ((n, sections), split) in enumerate(zip(groups, splits, strict=True)):
            where = f"cluster.groups[{i}]" if grouped else ""
            with settings_at(where, GROUP_KEYS) if grouped else contextlib.nullcontext():
                self.groups.append(self._group(n, where, sections, split))
        if self.size == 1:  # result.json names the one replica's, as its sections
            self.parallel = splits[0]
        if self.disaggregated:
            self._disaggregation(cluster)
        elif cluster.get("early_rejection"):  # (decode_router and link: unused, as a sweep
            # over layouts sets them for all)
            raise ValueError("cluster.early_rejection applies to a disaggregated cluster only (a "
                             "cluster.groups entry with role: prefill or decode)")

    @property
    def num_gpus(self) -> int:
        """GPUs the cluster takes: each group's replicas x its tensor x pipeline parallel size."""
        return sum(g.num_gpus for g in self.groups)

    @property
    def layout(self) -> str:
        """The replicas per role, "1 prefill + 1 decode" (result.json's schedlab.layout); a
        group whose own parallel differs from the run's is counted apart and named with it,
        "1 prefill (tp=2) + 1 decode"."""
        count: dict[tuple[str, str], int] = {}
        for g in self.groups:
            split = ""
            if g.parallel != self.run_parallel:
                split = ", ".join(f"{name}={size}" for name, size in (
                    ("tp", g.parallel.tensor_parallel_size),
                    ("pp", g.parallel.pipeline_parallel_size)) if size != 1) or "tp=1"
            key = (g.role, f" ({split})" if split else "")
            count[key] = count.get(key, 0) + g.replicas
        return " + ".join(f"{count[key]} {key[0]}{key[1]}"
                          for r in ("prefill", "decode", "mixed")
                          for key in sorted(count) if key[0] == r)

    def _disaggregation(self, cluster: Mapping[str, Any]) -> None:
        """The decode router (``cluster.decode_router``: a router's name or its settings;
        default round_robin), the link (``cluster.link``: conf/link/<name>.yaml or settings
        over one; default rdma) and ``cluster.early_rejection``, checked with the pools."""
        from common.checks import check_bool
        from policies.routers import make_router
        from simulator.disaggregation import check_roles
        from simulator.link import LinkSpec

        router = cluster.get("decode_router") or "round_robin"
        if isinstance(router, str):  # conf/router/<name>.yaml where there is one (its module)
            try:
                router = conf_section("router", router)
            except ValueError:
                router = {"name": router}
        router = dict(router) if isinstance(router, Mapping) else {"name": router}
        name = router.pop("name", "round_robin")
        with settings_at("cluster.decode_router", ("router",)):
            self.decode_router = make_router(name, **router)
        self.decode_router_name = name
        link = cluster.get("link") or "rdma"
        if isinstance(link, str):
            link = conf_section("link", link)
        elif isinstance(link, Mapping):
            link = {**conf_section("link", link.get("name", "rdma")), **link}
        else:
            raise ValueError(f"cluster.link must be a link's name (conf/link: nvlink, pcie, "
                             f"rdma, same_gpu) or settings over one, got {link!r}")
        self.link = LinkSpec.from_dict(link)
        self.early_rejection = check_bool("cluster.early_rejection",
                                          cluster.get("early_rejection") or False)
        roles = [g.role for g in self.groups for _ in range(g.replicas)]
        check_roles(roles, self.link)
        for g in self.groups:
            if g.role == "prefill" and g.choice.scheduler.overlap:
                raise ValueError(f"{g.where}.scheduler.overlap: a prefill group's requests "
                                 "leave once prefilled; overlap is not modelled there")

    def _group(self, replicas: int, where: str, sections: dict[str, Any],
               parallel: ParallelConfig) -> ReplicaGroup:
        from simulator.hardware import HardwareSpec
        from simulator.memory import blocks_per_engine
        from simulator.overhead import OverheadSpec

        model = ModelSpec.from_dict(sections["model"])
        parallel.check_model(model)
        choice = PolicyChoice(sections, model, self.run_cfg)
        hardware = HardwareSpec.from_dict(sections["hardware"], parallel)
        overhead = OverheadSpec.from_dict(sections["overhead"])
        util = check_number("gpu_memory_utilization", sections["gpu_memory_utilization"])
        num_blocks = sections["num_blocks"]
        if num_blocks is None:  # sized now: a model too big for the GPU is refused here
            spec = choice.speculation
            num_blocks = blocks_per_engine(model, hardware,
                                           block_size=choice.scheduler.block_size,
                                           gpu_memory_utilization=util,
                                           draft=None if spec is None else spec.draft)
        else:
            check_int("num_blocks", num_blocks, 1)
        return ReplicaGroup(replicas, where, sections, model, choice, hardware, overhead,
                            float(util), num_blocks, sections.get("role", "mixed"), parallel)

    def request_limit(self) -> tuple[int, str]:
        """The longest request every replica admits, and what sets it: a request may be sent to
        any of them (the simulator's; ``workload.drop_too_long`` drops the longer ones)."""
        return min((g.request_limit() for g in self.groups), key=lambda limit: limit[0])

    def replica_specs(self, backend: Mapping[str, Any]) -> list[Any]:
        """Each replica's engine: its group's model, hardware, overhead, policy and KV cache."""
        from simulator.outcome import ReplicaSpec

        specs = []
        for g, group in enumerate(self.groups):
            choice = group.choice
            label = {"group": g, "model": group.model.name,
                     "hardware": group.sections["hardware"].get("name"),
                     "overhead": group.sections["overhead"].get("name"),
                     "policy": choice.name, "k": getattr(choice.policy, "num_steps", 1)}
            if self.disaggregated:
                label["role"] = group.role
            if self.own_parallel:
                label["tensor_parallel_size"] = group.parallel.tensor_parallel_size
                label["pipeline_parallel_size"] = group.parallel.pipeline_parallel_size
            for _ in range(group.replicas):
                specs.append(ReplicaSpec(
                    choice.new_scheduler, group.model, group.hardware, group.overhead,
                    block_size=choice.scheduler.block_size,
                    gpu_memory_utilization=group.gpu_memory_utilization,
                    num_blocks=group.num_blocks,
                    stream_per_step=bool(backend.get("stream_per_step", False)),
                    time_scale=float(backend.get("time_scale", 1.0)), group=g,
                    role=group.role))
                self.labels.append(dict(label))
        return specs


def conf_section(group: str, name: str) -> dict[str, Any]:
    """``<group>/<name>.yaml`` (a replica group's config by name) from the first directory of
    the run's config search path that has it: conf/, then ``hydra.searchpath``'s (a user's own
    configs), as Hydra finds the top-level ones."""
    sources = _config_sources()
    for source in sources:
        path = source / group / f"{name}.yaml"
        if path.is_file():
            return plain(OmegaConf.load(path))
    where = ", ".join(str(s) for s in sources)
    raise ValueError(f"cluster.groups: no {group} config {name!r} (looked for {group}/{name}.yaml "
                     f"in {where}; hydra.searchpath adds a directory of your own)")


def _config_sources() -> list[Path]:
    """The directories Hydra composed the run's config from, in its order of search: conf/
    and hydra.searchpath's ``file://`` directories (a ``pkg://`` source as its package's
    directory); conf/ alone outside a Hydra app."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return [Path(conf_dir())]
    out: list[Path] = []
    for source in HydraConfig.get().runtime.config_sources:
        if source.provider == "hydra":  # Hydra's own (hydra/launcher, ...)
            continue
        if source.schema == "file":
            out.append(Path(source.path))
        elif source.schema == "pkg":
            spec = importlib.util.find_spec(source.path.replace("/", "."))
            if spec is not None and spec.submodule_search_locations:
                out.extend(Path(p) for p in spec.submodule_search_locations)
    return out
