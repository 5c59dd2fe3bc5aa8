"""The paged KV cache: per-layer K/V block tensors and how many blocks the device's memory allows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.model_spec import ModelSpec

GB = 1e9


@dataclass(slots=True)
class KVCache:
    """``k[layer]``, ``v[layer]``: [num_blocks, block_size, num_kv_heads, head_dim]."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[1]


def block_bytes(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block's K and V over all layers."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * block_size * spec.kv_size * itemsize


def allocate_kv_cache(spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device | str) -> KVCache:
    shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    # Zeros, not empty: a stale NaN in a never-written slot must not leak through a 0 weight.
    return KVCache([torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)])


def weight_bytes(spec: ModelSpec, dtype: torch.dtype) -> int:
    return spec.num_params * torch.empty((), dtype=dtype).element_size()


def check_weights_fit(spec: ModelSpec, device: torch.device, dtype: torch.dtype,
                      utilization: float) -> None:
    """Fail before allocating anything when the weights alone exceed the memory budget."""
    need = weight_bytes(spec, dtype)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if need > free * utilization:
            raise ValueError(
                f"model {spec.name} needs {need / GB:.0f} GB of weights but backend.device "
                f"{device} has {free / GB:.0f} GB free x gpu_memory_utilization {utilization}")
        return
    free = host_available_bytes()
    if free is not None and need > free * utilization:
        raise ValueError(
            f"model {spec.name} needs {need / GB:.1f} GB of {str(dtype).removeprefix('torch.')} "
            f"weights but backend.device cpu has {free / GB:.1f} GB of memory available x "
            f"gpu_memory_utilization {utilization}")


def host_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def profile_num_blocks(spec: ModelSpec, device: torch.device, dtype: torch.dtype,
                       utilization: float, block_size: int,
                       profile: Callable[[], None], draft_block_bytes: int = 0,
                       graph_profile: Callable[[], None] | None = None) -> int:
    """Blocks that fit in total memory x utilization once weights, the peak activations of
    ``profile`` (the largest eager steps, drafting windows included), the CUDA graphs' pool
    (the peak of ``graph_profile``: the largest captured steps run eagerly, whose transient
    memory the pool keeps beside the allocator's own) and memory held by others are taken
    out; each block also holds ``draft_block_bytes`` of a draft model's cache (speculative
    decoding)."""
    activations = _profiled_peak(device, profile)
    graph_pool = _profiled_peak(device, graph_profile) if graph_profile is not None else 0
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used = total - free  # weights, static buffers, CUDA context, other processes
    return kv_blocks_that_fit(spec, dtype, block_size, total, used, activations + graph_pool,
                              utilization, draft_block_bytes, device)


def _profiled_peak(device: torch.device, run: Callable[[], None]) -> int:
    """Bytes ``run`` allocates at its peak beyond what was allocated before it."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def kv_blocks_that_fit(spec: ModelSpec, dtype: torch.dtype, block_size: int, total: float,
                       used: float, activations: float, utilization: float,
                       draft_block_bytes: int = 0, device: torch.device | str = "cuda") -> int:
    """KV blocks (the target's, plus ``draft_block_bytes`` each of a draft model's) in
    ``total`` x ``utilization`` less ``used`` and the profiled ``activations``."""
    budget = total * utilization - used - activations
    num_blocks = int(budget // (block_bytes(spec, block_size, dtype) + draft_block_bytes))
    if num_blocks < 1:
        raise ValueError(
            f"backend.gpu_memory_utilization {utilization} leaves no room for model {spec.name}'s "
            f"KV cache on {device}: {total / GB:.1f} GB total, {used / GB:.1f} GB in use "
            f"(weights {weight_bytes(spec, dtype) / GB:.1f} GB), activations "
            f"{activations / GB:.1f} GB")
    return num_blocks
