"""The parallelism setting both backends read (conf/config.yaml's ``parallel`` section): how many
GPUs split each layer (tensor parallelism) and how many stages split the layers (pipeline)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from common.checks import check_int, check_settings
from common.model_spec import ModelSpec


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tensor_parallel_size: int = 1  # GPUs that split every layer (Megatron-style)
    pipeline_parallel_size: int = 1  # stages that split the layers (the simulator only)

    def __post_init__(self) -> None:
        for f in fields(self):
            check_int(f"parallel.{f.name}", getattr(self, f.name), 1)

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any] | None) -> ParallelConfig:
        d = dict(d or {})
        check_settings("parallel", d, (f.name for f in fields(cls)))
        return cls(**d)

    @property
    def num_gpus(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def check_model(self, model: ModelSpec) -> None:
        """A one-line error when this split cannot cut ``model`` (vLLM's rules): the query heads
        and the MLP's columns divide among the ranks, the KV heads divide among them or are
        replicated (fewer KV heads than ranks), and every stage gets a layer."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        setting = f"parallel.tensor_parallel_size={tp}"
        if model.num_heads % tp:
            raise ValueError(f"{setting} must divide model.num_heads={model.num_heads} "
                             f"of {model.name}")
        if model.num_kv_heads % tp and tp % model.num_kv_heads:
            raise ValueError(f"{setting} must divide model.num_kv_heads={model.num_kv_heads} "
                             f"of {model.name}, or be a multiple of it")
        if model.intermediate_size % tp:
            raise ValueError(f"{setting} must divide model.intermediate_size="
                             f"{model.intermediate_size} of {model.name}")
        if pp > model.num_layers:
            raise ValueError(f"parallel.pipeline_parallel_size={pp} exceeds model.num_layers="
                             f"{model.num_layers} of {model.name}")


def kv_heads_per_rank(model: ModelSpec, tp: int) -> int:
    """KV heads each tensor-parallel rank holds: split when there are enough, else one,
    replicated on the ranks whose query heads share it."""
    return max(1, model.num_kv_heads // tp)
