"""The memory model: how many KV-cache blocks fit beside the weights on each GPU."""

from __future__ import annotations

from common.model_spec import ModelSpec
from common.parallel import kv_heads_per_rank
from simulator.hardware import HardwareSpec, check_parallelism, layers_per_stage

_GIB = 1 << 30


def weight_bytes_per_gpu(model: ModelSpec, hw: HardwareSpec) -> int:
    """Weights on one GPU of the largest pipeline stage.

    TP splits every matrix, the embedding and the LM head included; PP gives each stage its
    layers, the first stage the embedding and the last the LM head, so with pp > 1 a stage
    holds one vocabulary matrix (with pp == 1 it holds both unless they are tied).
    """
    vocab_matrix = model.vocab_size * model.hidden_size
    if hw.pp == 1:
        vocab = vocab_matrix * (1 if model.tie_word_embeddings else 2)
    else:
        vocab = vocab_matrix
    params = layers_per_stage(model, hw.pp) * model.params_per_layer + vocab
    return params * model.dtype_bytes // hw.tp + model.hidden_size * model.dtype_bytes


def kv_bytes_per_token_per_gpu(model: ModelSpec, hw: HardwareSpec) -> int:
    """K and V of one token over the largest stage's layers, for one TP rank's KV heads."""
    return (2 * layers_per_stage(model, hw.pp) * kv_heads_per_rank(model, hw.tp)
            * model.head_dim * model.dtype_bytes)


def _split(hw: HardwareSpec) -> str:
    return f"parallel.tensor_parallel_size={hw.tp}, pipeline_parallel_size={hw.pp}"


def num_gpu_blocks(model: ModelSpec, hw: HardwareSpec, *, block_size: int = 16,
                   gpu_memory_utilization: float = 0.9, draft: ModelSpec | None = None) -> int:
    """KV blocks one GPU holds, as vLLM sizes its cache after profiling.

    floor((hbm * gpu_memory_utilization - weights - activation reserve) / block bytes).
    A speculative decoding ``draft`` model on the same GPU adds its weights, and its KV to each
    block (every token is cached by both models); the target drafting for itself adds nothing.
    """
    if block_size < 1:
        raise ValueError(f"scheduler.block_size must be >= 1, got {block_size}")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(
            f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    check_parallelism(model, hw)
    budget = hw.hbm_gib * _GIB * gpu_memory_utilization
    weights = weight_bytes_per_gpu(model, hw)
    kv_token = kv_bytes_per_token_per_gpu(model, hw)
    if draft is not None and draft is not model:
        weights += weight_bytes_per_gpu(draft, hw)
        kv_token += kv_bytes_per_token_per_gpu(draft, hw)
    reserve = hw.activation_reserve_gib * _GIB
    free = budget - weights - reserve
    blocks = int(free // (block_size * kv_token)) if free > 0 else 0
    if blocks <= 0:
        raise ValueError(
            f"model {model.name} does not fit on hardware {hw.name} ({_split(hw)}) at "
            f"gpu_memory_utilization={gpu_memory_utilization}: weights take "
            f"{weights / _GIB:.1f} GiB and activations {hw.activation_reserve_gib:.1f} GiB of "
            f"the {budget / _GIB:.1f} GiB allowed per GPU, leaving nothing for the KV cache")
    return blocks


def blocks_per_engine(model: ModelSpec, hw: HardwareSpec, *, block_size: int = 16,
                      gpu_memory_utilization: float = 0.9,
                      max_model_len: int | None = None, draft: ModelSpec | None = None) -> int:
    """KV blocks each of the ``pp`` virtual engines' schedulers manages (vLLM splits the cache).

    Raises when that cache cannot hold one request of ``max_model_len`` tokens.
    """
    max_len = model.max_model_len if max_model_len is None else max_model_len
    blocks = num_gpu_blocks(model, hw, block_size=block_size,
                            gpu_memory_utilization=gpu_memory_utilization, draft=draft) // hw.pp
    if blocks * block_size < max_len:
        raise ValueError(
            f"model {model.name} on hardware {hw.name} ({_split(hw)}) at "
            f"gpu_memory_utilization={gpu_memory_utilization} has KV room for "
            f"{blocks * block_size} tokens per engine, less than one max_model_len={max_len} "
            "request; raise gpu_memory_utilization, add GPUs or lower max_model_len")
    return blocks
