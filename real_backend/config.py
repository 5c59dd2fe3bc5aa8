"""The real backend's settings (the ``backend`` config group), validated into one frozen dataclass."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from common.step_sizes import PIECEWISE_GRAPH_TOKENS, PREFILL_GRAPH_TOKENS
from policies.base import check_int, check_number, check_settings
from real_backend.kernels import check_triton_runs_on
from real_backend.sampling import SamplingParams
from real_backend.speculative import SpecSettings

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, slots=True)
class BackendConfig:
    device: str = "cuda"
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    num_blocks: int | None = None  # KV blocks; None: profiled on cuda, cpu_kv_cache_gib on cpu
    cpu_kv_cache_gib: float = 1.0  # KV cache size on cpu (there is no device memory to profile)
    gpu_memory_utilization: float = 0.9
    cuda_graphs: bool = True  # decode steps replay CUDA graphs (cuda only)
    prefill_graph_max_tokens: int = 512  # prefill-only steps up to this size replay graphs too; 0: none
    # other steps (mixed prefill + decode, larger prefills) up to this size replay piecewise graphs
    piecewise_graph_max_tokens: int = 2048
    keep_runner: bool = False  # keep the runner for the next run with the same shape (sweeps)
    async_output: bool = True  # pythonize step n while step n+1 runs
    weights: str | None = None  # None: seeded random weights; else a Hugging Face directory
    seed: int = 0
    sampling: SamplingParams = field(default_factory=SamplingParams)
    save_token_ids: bool = False  # return every request's output token ids in RealResult
    kernels: str = "auto"  # auto: triton on cuda, torch (the reference ops) on cpu
    spec: SpecSettings | None = None  # speculative decoding (the spec group's engine keys)

    def __post_init__(self) -> None:
        if not isinstance(self.device, str):
            raise ValueError(f"backend.device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        try:
            dev = torch.device(self.device)
        except RuntimeError:
            raise ValueError(
                f"backend.device must be 'cpu' or 'cuda[:N]', got {self.device!r}") from None
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"backend.device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"backend.device is {self.device} but this machine has no CUDA device")
        if self.dtype != "auto" and (not isinstance(self.dtype, str) or self.dtype not in _DTYPES):
            raise ValueError(f"backend.dtype must be auto or one of {', '.join(_DTYPES)}, "
                             f"got {self.dtype!r}")
        if self.num_blocks is not None:
            check_int("backend.num_blocks", self.num_blocks, 1)
        check_number("backend.cpu_kv_cache_gib", self.cpu_kv_cache_gib, positive=True)
        check_number("backend.gpu_memory_utilization", self.gpu_memory_utilization)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("backend.gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        for name in ("cuda_graphs", "keep_runner", "async_output", "save_token_ids"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"backend.{name} must be true or false, "
                                 f"got {getattr(self, name)!r}")
        for name, sizes in (("prefill_graph_max_tokens", PREFILL_GRAPH_TOKENS),
                            ("piecewise_graph_max_tokens", PIECEWISE_GRAPH_TOKENS)):
            if check_int(f"backend.{name}", getattr(self, name), 0) > sizes[-1]:
                raise ValueError(f"backend.{name} must be in [0, {sizes[-1]}], "
                                 f"got {getattr(self, name)}")
        if self.weights is not None and not (isinstance(self.weights, str) and self.weights):
            raise ValueError("backend.weights must be null (random weights) or a directory, "
                             f"got {self.weights!r}")
        check_int("backend.seed", self.seed, 0)
        if self.kernels not in ("auto", "torch", "triton"):
            raise ValueError(f"backend.kernels must be auto, torch or triton, got {self.kernels!r}")
        if self.kernel_set == "triton":
            check_triton_runs_on(dev)
        if self.spec is not None and not isinstance(self.spec, SpecSettings):
            raise ValueError(f"backend.spec must be a mapping of the spec group's keys, "
                             f"got {self.spec!r}")
        spec = self.spec
        if (spec is not None and spec.method == "draft" and spec.draft_model != "same"
                and bool(self.weights) != bool(spec.draft_weights)):
            raise ValueError(f"spec.draft_model {spec.draft_model}: give backend.spec."
                             "draft_weights with backend.weights (both checkpoints, or both "
                             "random)")

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any] | None) -> BackendConfig:
        d = dict(d or {})
        check_settings("backend", d, (f.name for f in fields(cls)))
        if "sampling" in d:
            if not isinstance(d["sampling"], Mapping):
                raise ValueError("backend.sampling must be a mapping of temperature, top_k and "
                                 f"top_p, got {d['sampling']!r}")
            d["sampling"] = SamplingParams.from_mapping(d["sampling"])
        if isinstance(d.get("spec"), Mapping):
            d["spec"] = SpecSettings.from_mapping(d["spec"])
        return cls(**d)

    @property
    def torch_device(self) -> torch.device:
        dev = torch.device(self.device)
        if dev.type == "cuda" and dev.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return dev

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]

    @property
    def kernel_set(self) -> str:
        if self.kernels == "auto":
            return "triton" if self.torch_device.type == "cuda" else "torch"
        return self.kernels

    @property
    def use_cuda_graphs(self) -> bool:
        # The torch reference ops read lengths back to the host, which a graph cannot capture.
        return self.cuda_graphs and self.torch_device.type == "cuda" and self.kernel_set == "triton"
