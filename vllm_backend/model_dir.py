"""The model directory vLLM loads: a conf/model shape written as a Hugging Face config.json
(vLLM's dummy weights fill it), or a local checkpoint directory as it is."""

from __future__ import annotations

import json
from pathlib import Path

from common.model_spec import ModelSpec

# the weights' dtype from the shape's bytes per value (conf/model's dtype_bytes)
TORCH_DTYPES = {4: "float32", 2: "bfloat16"}


def write_model_dir(model: ModelSpec, path: str | Path) -> Path:
    """Write ``model``'s config.json into ``path`` (made if missing) and return ``path``."""
    dtype = TORCH_DTYPES.get(model.dtype_bytes)
    if dtype is None:
        raise ValueError(f"model.dtype_bytes {model.dtype_bytes}: vLLM runs float32 (4) or "
                         "bfloat16 (2) weights")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.hf_config(dtype), indent=2))
    return path
