"""The real engine: runs schedlab policies on a Llama model with a paged KV cache (GPU, or CPU for tests)."""

from __future__ import annotations

import os

# Load every CUDA kernel when the context is created, not at its first launch: a lazily loaded
# kernel (say, the cuBLAS GEMM picked for a token count not seen before) is registered only once
# the GPU's queue has drained, so the step that first launches it would stall mid-run. (A
# precaution: on the H200 it did not change a served cp1 run measurably; see BENCHMARKS.md.)
# Set before torch creates the context; a value the user exported wins.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

from real_backend.config import BackendConfig  # noqa: E402
from real_backend.engine import RealResult, run_real  # noqa: E402

__all__ = ["BackendConfig", "RealResult", "run_real"]
