"""Shared helpers of the real-backend tests: the device, model specs, the no-cache oracle."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from common.model_spec import ModelSpec
from real_backend.model import Llama, forward_dense

CONF = Path(__file__).resolve().parents[2] / "conf" / "model"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (policy, its settings, token budget, overlap): single steps, multi-step windows, prefills
# inside windows and overlap, which the per-request sampling tests run each request through
WINDOW_KINDS = [
    ("single_step", {}, None, False),
    ("multi_step", {"num_steps": 4}, None, False),
    ("cp2", {"num_steps": 4}, 16, True),
    ("multi_step", {"num_steps": 8}, None, True),
]
WINDOW_KIND_IDS = ["single_step", "multi_step4", "cp2_overlap", "multi_step8_overlap"]


def load_spec(config: str, **overrides) -> ModelSpec:
    d = yaml.safe_load((CONF / f"{config}.yaml").read_text())
    return ModelSpec.from_dict({**d, **overrides})


def greedy_dense(model: Llama, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy generation recomputing the whole sequence every token, no KV cache."""
    ids = list(prompt)
    for _ in range(num_tokens):
        logits = forward_dense(model, torch.tensor(ids, device=model.device))
        ids.append(int(logits[-1].argmax()))
    return ids[len(prompt):]
