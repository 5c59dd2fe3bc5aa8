"""The real engine: runs schedlab policies on a Llama model with a paged KV cache (GPU, or CPU for tests)."""

from __future__ import annotations

import os

# Load every CUDA kernel when the context is created, not at its first launch. A lazily loaded
# kernel (say, the cuBLAS GEMM picked for a token count not seen before) is registered only once
# the GPU's queue has drained, so the step that first launches it stalls: launch-bound mixed
# steps took 1.5-3.5x their usual launch time in served runs. Set before torch creates the
# context; a value the user exported wins.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

from real_backend.config import BackendConfig  # noqa: E402
from real_backend.engine import RealResult, run_real  # noqa: E402

__all__ = ["BackendConfig", "RealResult", "run_real"]
