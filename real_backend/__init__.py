"""The real engine: runs schedlab policies on a Llama model with a paged KV cache (GPU, or CPU for tests)."""

from __future__ import annotations

from real_backend.config import BackendConfig
from real_backend.engine import RealResult, run_real

__all__ = ["BackendConfig", "RealResult", "run_real"]
