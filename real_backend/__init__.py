"""The real engine: runs schedlab policies on a Llama model with a paged KV cache (GPU, or CPU for tests)."""

from __future__ import annotations

import os

# Load every CUDA kernel when the context is created, not at its first launch: a lazily loaded
# kernel (say, the cuBLAS GEMM picked for a token count not seen before) is registered only once
# the GPU's queue has drained, so the step that first launches it would stall mid-run. (A
# precaution: on the H200 it did not change a served cp1 run measurably; see BENCHMARKS.md.)
# Set before torch creates the context; a value the user exported wins.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

__all__ = ["BackendConfig", "RealResult", "run_real"]


def __getattr__(name: str):
    """The engine's names, imported at first use: a process that needs only part of the
    package (the server's front end: HTTP and tokenization) never imports torch."""
    if name == "BackendConfig":
        from real_backend.config import BackendConfig
        return BackendConfig
    if name in ("RealResult", "run_real"):
        from real_backend import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'real_backend' has no attribute {name!r}")
