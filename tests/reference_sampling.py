"""Plain references of the engine's sampling rules for the tests: vLLM's penalties token by
token, and greedy generation under them recomputing the whole sequence every token."""

from __future__ import annotations

from collections import Counter

import torch

from policies.sampling_params import SamplingParams
from real_backend.model import Llama, forward_dense


def reference_penalties(logits: torch.Tensor, prompt: list[int], output: list[int],
                        p: SamplingParams) -> torch.Tensor:
    """vLLM's penalties on one row, token by token: a prompt or output token's logit divided by
    the repetition penalty if positive, else multiplied; then each output token's logit less
    frequency x its count and presence once."""
    x = logits.clone()
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(output).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x


def dense_logits(model: Llama, ids: list[int]) -> torch.Tensor:
    """fp32 logits [len(ids), vocab] of the whole sequence, with no KV cache (the oracle)."""
    with torch.inference_mode():
        return forward_dense(model, torch.tensor(ids, device=model.device)).float().cpu()


def penalized_greedy(model: Llama, prompt: list[int], n: int, p: SamplingParams) -> list[int]:
    """Greedy generation recomputing the whole sequence every token, each token's logits
    penalized by the reference."""
    out: list[int] = []
    for _ in range(n):
        logits = reference_penalties(dense_logits(model, prompt + out)[-1], prompt, out, p)
        out.append(int(logits.argmax()))
    return out
