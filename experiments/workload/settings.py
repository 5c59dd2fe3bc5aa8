"""Reading the ``workload`` section's settings: integers, numbers and file paths, checked."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np


def get_int(cfg: Mapping[str, Any], key: str, default: int | None, minimum: int, *,
            prefix: str = "workload") -> int:
    v = cfg.get(key, default)
    if v is None:
        raise ValueError(f"{prefix}.{key} must be set")
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) \
            or not math.isfinite(v) or v != int(v):
        raise ValueError(f"{prefix}.{key} must be an integer, got {v!r}")
    v = int(v)
    if v < minimum:
        raise ValueError(f"{prefix}.{key} must be >= {minimum}, got {v}")
    return v


def get_float(cfg: Mapping[str, Any], key: str, default: float | None, *,
              prefix: str = "workload") -> float:
    v = cfg.get(key, default)
    if v is None:
        raise ValueError(f"{prefix}.{key} must be set")
    if isinstance(v, str):  # "inf" from a command line
        try:
            return float(v)
        except ValueError:
            raise ValueError(f"{prefix}.{key} must be a number, got {v!r}") from None
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise ValueError(f"{prefix}.{key} must be a number, got {v!r}")
    return float(v)


def get_path(cfg: Mapping[str, Any], key: str) -> Path | None:
    v = cfg.get(key)
    if v is None:
        return None
    if not isinstance(v, (str, os.PathLike)) or os.fspath(v) in ("", "???"):
        raise ValueError(f"workload.{key} must be set to a file path, got {v!r}")
    p = Path(os.path.expanduser(os.fspath(v)))
    if not p.is_file():
        raise ValueError(f"workload.{key}: no such file {p}")
    return p
