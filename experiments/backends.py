"""The executors a run can use, behind one small interface: build (every setting checked, before
the run directory is touched), run a workload, return the result and what result.json says of
the backend. ``BACKENDS`` maps ``backend.name`` to each; experiments/run.py asks no name."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from common.model_spec import ModelSpec
from common.parallel import ParallelConfig
from experiments.choices import (
    ClusterChoice,
    PolicyChoice,
    check_sim_settings,
    known_settings,
    plain,
)
from policies.base import check_settings
from policies.request import Request
from policies.speculation import Speculation


class Backend:
    """One run's executor. ``__init__`` checks the settings and builds what the run needs
    short of running; ``run`` serves the requests and returns the outcome (``duration``,
    ``stats``, ``steps``: steps.csv's rows, one window record each); the rest says what
    result.json and the printout carry of it."""

    name: ClassVar[str] = ""
    # the requests carry prompt token ids (an engine runs them; the simulator needs lengths)
    needs_token_ids: ClassVar[bool] = False

    def __init__(self, cfg: Mapping[str, Any], choice: PolicyChoice, model: ModelSpec,
                 parallel: ParallelConfig, cluster: ClusterChoice) -> None:
        self.cfg, self.choice = cfg, choice
        self.settings = {k: v for k, v in plain(cfg["backend"]).items() if k != "name"}
        self.model, self.parallel, self.cluster = model, parallel, cluster
        self.streamed: Any = None  # requests.csv and steps.csv written as the run goes
        self.cluster_outcome: Any = None  # a cluster's run: every replica's

    @classmethod
    def check(cls, cfg: Mapping[str, Any]) -> None:
        """The settings checked before the run's other choices are made (where they need none
        of them); the rest when it is built."""

    def run(self, requests: list[Request], run_dir: Path, *, max_concurrency: int | None,
            progress: bool) -> Any:
        raise NotImplementedError

    def times(self, requests: Sequence[Request]) -> Any:
        """Every request's times (experiments/request_times.py), once the run is over."""
        from experiments.request_times import TimesTable

        return TimesTable.of_requests(requests)

    def labels(self, outcome: Any) -> dict[str, Any]:
        """result.json's hardware, overhead and host of the run."""
        return {"hardware": getattr(outcome, "stats", {}).get("device_name",
                                                              self.settings.get("device")),
                "overhead": None, "host": None}

    def run_fields(self, outcome: Any, wall: float) -> dict[str, Any]:
        """result.json's fields of this backend alone (after the others)."""
        return {}

    @property
    def request_columns(self) -> list[tuple[str, Any]]:
        """requests.csv's columns after its own (name, a value per request)."""
        return []

    def cluster_fields(self, times: Any
                       ) -> tuple[dict[str, Any], dict[str, Any], Any]:
        """A run of several replicas behind a router: result.json's router and replica count
        (schedlab section; a disaggregated cluster's layout too), its entries of the cluster
        (``replicas``: per-replica summaries; ``disaggregation``) and each request's replica
        (requests.csv); a run of one engine has none of them."""
        return {}, {}, None

    def discard(self) -> None:
        """After a failed run: the result files it wrote as it went removed (their temporary
        copies), their workers stopped; an OS error doing so is not raised (the run's own
        error is the one to report)."""
        if self.streamed is not None:
            with contextlib.suppress(OSError):
                self.streamed.discard()


class SimBackend(Backend):
    """The discrete-event simulator (simulator/): one replica, or a cluster behind a router."""

    name = "sim"

    @classmethod
    def check(cls, cfg: Mapping[str, Any]) -> None:
        from simulator.processes import user_processes

        backend = plain(cfg["backend"])
        check_settings("backend", backend, known_settings()[1])
        check_sim_settings(cfg, backend)
        user_processes(backend.get("processes"))  # imported and checked (once) before the run

    def __init__(self, *args: Any) -> None:
        import experiments.finished_requests  # noqa: F401  (pyarrow loaded before a run is timed)
        from simulator.processes import user_processes

        super().__init__(*args)
        # the user's SimPy processes (backend.processes)
        self.processes = user_processes(self.settings.get("processes"))
        self.time_scale = float(self.settings.get("time_scale", 1.0))
        self.replica_specs = self.cluster.replica_specs(plain(self.cfg["backend"]))
        self.finishes: Any = None
        self.handoffs: Any = None  # a disaggregated cluster's per-request hand-offs

    def run(self, requests: list[Request], run_dir: Path, *, max_concurrency: int | None,
            progress: bool) -> Any:
        from experiments.finished_requests import FinishedRequests
        from simulator.engine import simulate_cluster
        from simulator.outcome import StepRows

        cluster = self.cluster
        # one replica's steps.csv rows are written as the run goes, with requests.csv's
        steps = StepRows(False) if cluster.size == 1 else None
        pd: dict[str, Any] = {}
        if cluster.disaggregated:
            from simulator.disaggregation import HandoffLog

            self.handoffs = HandoffLog(requests)
            goodput = plain(self.cfg.get("goodput") or {})
            pd = {"decode_router": cluster.decode_router, "link": cluster.link,
                  "handoffs": self.handoffs,
                  "early_rejection": (goodput.get("ttft_ms"), goodput.get("tpot_ms"))
                  if cluster.early_rejection else None}
        self.finishes = FinishedRequests(requests, run_dir, cluster=cluster.size > 1,
                                         steps=steps, extra_columns=self.request_columns)
        self.streamed = self.finishes.streamed
        self.cluster_outcome = simulate_cluster(requests, self.replica_specs, cluster.router,
                                                max_concurrency=max_concurrency,
                                                progress=progress, on_finish=self.finishes,
                                                steps=None if steps is None else [steps],
                                                processes=self.processes, **pd)
        if self.streamed is not None:  # no more rows as the run goes: the rest at the end
            self.streamed.finish()
        return self.cluster_outcome.total

    def times(self, requests: Sequence[Request]) -> Any:
        return self.finishes.table()  # taken as each request finished

    @property
    def request_columns(self) -> list[tuple[str, Any]]:
        """requests.csv's columns after its own: a disaggregated cluster's hand-offs."""
        return self.handoffs.columns() if self.handoffs is not None else []

    def cluster_fields(self, times: Any
                       ) -> tuple[dict[str, Any], dict[str, Any], Any]:
        from simulator.cluster import disaggregation_summary, replica_summaries

        cluster = self.cluster
        if cluster.size == 1:
            return {}, {}, None
        outcome = self.cluster_outcome
        fields = {"router": cluster.router_name, "num_replicas": cluster.size}
        if cluster.own_parallel:  # GPUs differ from replicas x the run's parallel
            fields["num_gpus"] = cluster.num_gpus
        entries = {"replicas": replica_summaries(outcome, times.ttft, times.output_len,
                                                 times.completed, cluster.labels)}
        if cluster.disaggregated:
            fields["layout"] = cluster.layout
            entries["disaggregation"] = disaggregation_summary(
                entries["replicas"], self.handoffs, cluster.link, cluster.decode_router_name,
                cluster.early_rejection)
        return fields, entries, outcome.replica_of

    def labels(self, outcome: Any) -> dict[str, Any]:
        sections = self.cluster.sections  # the run's, or its one replica's (its group's)
        # the host profile (conf/host) the overhead's CPU costs were scaled by, if any
        return {"hardware": sections["hardware"].get("name"),
                "overhead": sections["overhead"].get("name"),
                "host": (sections["overhead"].get("host") or {}).get("name")}

    def run_fields(self, outcome: Any, wall: float) -> dict[str, Any]:
        return {"time_scale": self.time_scale, "simulated_seconds": outcome.duration,
                "simulated_seconds_per_wall_second": outcome.duration / max(wall, 1e-9)}


def real_settings(settings: dict[str, Any], spec: Speculation | None) -> dict[str, Any]:
    """The real engine's ``backend`` settings with the run's speculation (the spec section's
    method, length and draft model) in ``backend.spec``, beside the engine's own keys there
    (draft_weights, the n-gram sizes)."""
    if spec is None:
        if settings.get("spec"):
            raise ValueError("backend.spec is set but speculation is off (spec=off): choose a "
                             "spec config, e.g. spec=spec_fixed")
        return settings
    own = settings.get("spec") or {}
    return {**settings, "spec": {**own, "method": spec.method, "num_tokens": spec.num_tokens,
                                 "draft_model": spec.draft_model or "same"}}


class RealBackend(Backend):
    """schedlab's PyTorch/Triton engine (real_backend/); its settings are checked by run_real."""

    name = "real"
    needs_token_ids = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.model.require_gated_mlp("the real engine")
        from real_backend.config import BackendConfig

        self.settings = real_settings(self.settings, self.choice.speculation)
        from real_backend.engine import check_overlap_backend

        check_overlap_backend(self.choice.new_scheduler(1),
                              BackendConfig.from_mapping(self.settings))

    def run(self, requests: list[Request], run_dir: Path, *, max_concurrency: int | None,
            progress: bool) -> Any:
        from real_backend.engine import run_real

        return run_real(requests, self.choice.new_scheduler, self.model, self.settings,
                        max_concurrency=max_concurrency, progress=progress,
                        parallel=self.parallel)


class VllmBackend(Backend):
    """vLLM's engine (vllm_backend/), the policy in its scheduler (docs/vllm.md)."""

    name = "vllm"
    needs_token_ids = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.model.require_gated_mlp("vLLM's backend (a Llama config.json)")
        from vllm_backend import require_vllm
        from vllm_backend.engine import check_vllm_settings
        from vllm_backend.mapping import vllm_policy

        check_vllm_settings(self.settings, self.model)
        if self.parallel.tensor_parallel_size > 1 or self.parallel.pipeline_parallel_size > 1:
            raise ValueError("backend=vllm runs on one device: parallel.tensor_parallel_size "
                             "and parallel.pipeline_parallel_size must be 1")
        if self.choice.scheduler.overlap:
            raise ValueError("scheduler.overlap: backend=vllm schedules synchronously (vLLM's "
                             "CPU platform; VllmPolicyScheduler has no AsyncScheduler variant)")
        if self.choice.speculation is not None:  # rather than a run without it, silently
            raise ValueError("spec: backend=vllm does not pass speculative decoding to vLLM's "
                             "engine; spec=off there (the simulator and the real engine take it)")
        vllm_policy(self.choice.policy)  # a policy vLLM cannot run: one line, now
        require_vllm()
        self.block_size = self.choice.scheduler.block_size
        if self.settings.get("device", "cpu") == "cpu" and self.block_size % CPU_BLOCK:
            self.block_size = -(-self.block_size // CPU_BLOCK) * CPU_BLOCK
            warnings.warn(f"backend=vllm: scheduler.block_size {self.choice.scheduler.block_size}"
                          f" is not a multiple of {CPU_BLOCK}, which vLLM's CPU attention "
                          f"needs; the run's blocks hold {self.block_size} tokens", stacklevel=2)

    def run(self, requests: list[Request], run_dir: Path, *, max_concurrency: int | None,
            progress: bool) -> Any:
        from vllm_backend.engine import run_vllm

        return run_vllm(requests, self.model, self.settings, self.schedlab_section(),
                        max_concurrency=max_concurrency, progress=progress)

    def schedlab_section(self) -> dict[str, Any]:
        """additional_config's ``schedlab`` section of this run's engine: the policy, schedlab's
        scheduler limits (the block size vLLM runs), the cost model of a policy that needs one
        (vllm_backend/scheduler.py's SETTINGS)."""
        choice = self.choice
        step_time = None
        if choice.policy.needs_step_time and self.cfg.get("hardware") is not None:
            step_time = {"factory": "experiments.choices:profile_step_time",
                         "kwargs": {"model": plain(self.cfg["model"]),
                                    "hardware": plain(self.cfg["hardware"]),
                                    "parallel": plain(self.cfg.get("parallel") or {})}}
        schedlab = {"policy": {"name": choice.name, **choice.settings},
                    "scheduler": {**{k: getattr(choice.scheduler, k)
                                     for k in choice.scheduler.__dataclass_fields__},
                                  "block_size": self.block_size},
                    "step_time": step_time}
        return schedlab

    def labels(self, outcome: Any) -> dict[str, Any]:
        return {"hardware": outcome.stats.get("device_name"), "overhead": None, "host": None}


# vLLM's CPU attention takes KV blocks of a multiple of this many tokens
CPU_BLOCK = 32

BACKENDS: dict[str, type[Backend]] = {b.name: b for b in (SimBackend, RealBackend, VllmBackend)}


def backend_class(cfg: Mapping[str, Any]) -> type[Backend]:
    """The run's backend by ``backend.name`` (built with the run's choices: its settings are
    checked then); an unknown name is one line."""
    name = plain(cfg["backend"]).get("name")
    cls = BACKENDS.get(name)
    if cls is None:
        raise ValueError(f"backend.name must be one of {', '.join(BACKENDS)}, got {name!r}")
    return cls
