"""The engine's kernel set, chosen once: the PyTorch reference ops or their Triton twins."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from real_backend import ops


@dataclass(frozen=True, slots=True)
class Kernels:
    """Every hot op a forward step needs; ``ops`` and ``triton_ops`` share the signatures."""

    name: str
    add_rms_norm: Callable
    rotary_embedding: Callable
    silu_and_mul: Callable
    reshape_and_cache: Callable
    prefill_attention: Callable
    decode_attention: Callable
    advance_step: Callable


def select_kernels(kind: str) -> Kernels:
    """``torch``: the reference ops (the CPU default); ``triton``: the kernels (GPU default)."""
    if kind == "torch":
        mod = ops
    elif kind == "triton":
        from real_backend import triton_ops as mod  # imported late: TRITON_INTERPRET is read then
    else:
        raise ValueError(f"backend.kernels must be 'torch' or 'triton', got {kind!r}")
    return Kernels(kind, mod.add_rms_norm, mod.rotary_embedding, mod.silu_and_mul,
                   mod.reshape_and_cache, mod.paged_prefill_attention,
                   mod.paged_decode_attention, mod.advance_step)


def check_triton_runs_on(device: torch.device) -> None:
    """A one-line error naming backend.kernels when Triton kernels cannot run on ``device``:
    without the triton package, or on CPU tensors outside Triton's interpreter (which would
    otherwise fail at the first launch, deep inside Triton, for want of a GPU driver)."""
    try:
        import triton
    except ImportError:
        raise ValueError("backend.kernels=triton needs the triton package; "
                         "use backend.kernels=torch") from None
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4; earlier ones read the variable as "1"
    interpret = knobs.runtime.interpret if knobs else os.environ.get("TRITON_INTERPRET") == "1"
    if device.type == "cpu" and not interpret:
        raise ValueError("backend.kernels=triton on device cpu needs Triton's interpreter "
                         "(set TRITON_INTERPRET=1), or use backend.kernels=torch")


TORCH_KERNELS = select_kernels("torch")
