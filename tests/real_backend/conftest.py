"""Real-backend test setup: without a GPU, Triton kernels run in the interpreter on CPU tensors."""

from __future__ import annotations

import os

import torch

# Read by triton.jit when a kernel module is imported, so it must be set before any test
# module imports real_backend.triton_ops.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The tiny test model gains nothing from intra-op threads, and on a small shared machine
# OpenMP workers that spin against other processes slow each matmul down by 10x or more.
torch.set_num_threads(1)
