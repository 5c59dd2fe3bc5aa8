"""Model weights: seeded random init, and loading/saving Hugging Face Llama checkpoints."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from policies.model_spec import ModelSpec
from real_backend.model import LayerWeights, Llama, rope_table

# config.json key -> ModelSpec field, checked on load so a checkpoint never silently mismatches.
_HF_CONFIG = {
    "num_hidden_layers": "num_layers", "hidden_size": "hidden_size",
    "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads",
    "intermediate_size": "intermediate_size", "vocab_size": "vocab_size",
}


def _empty_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> Llama:
    def t(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    h, inter = spec.hidden_size, spec.intermediate_size
    layers = [LayerWeights(t(h), t(spec.q_size + 2 * spec.kv_size, h), t(h, spec.q_size), t(h),
                           t(2 * inter, h), t(h, inter)) for _ in range(spec.num_layers)]
    embed = t(spec.vocab_size, h)
    lm_head = embed if spec.tie_word_embeddings else t(spec.vocab_size, h)
    return Llama(spec, embed, layers, t(h), lm_head, rope_table(spec, device))


def random_model(spec: ModelSpec, device: torch.device | str, dtype: torch.dtype,
                 seed: int = 0) -> Llama:
    """Gaussian weights scaled so activations keep unit scale through any depth (bf16-safe):
    projections into the residual stream shrink with 1/sqrt(2 * num_layers)."""
    device = torch.device(device)
    model = _empty_model(spec, device, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    depth = math.sqrt(2 * spec.num_layers)

    def fill(w: torch.Tensor, std: float) -> None:
        w.normal_(0.0, std, generator=gen)

    fill(model.embed, 1.0)
    for w in model.layers:
        w.input_norm.fill_(1.0)
        w.post_norm.fill_(1.0)
        fill(w.qkv, spec.hidden_size ** -0.5)
        fill(w.o, spec.q_size ** -0.5 / depth)
        fill(w.gate_up, spec.hidden_size ** -0.5)
        fill(w.down, spec.intermediate_size ** -0.5 / depth)
    model.norm.fill_(1.0)
    if not spec.tie_word_embeddings:
        fill(model.lm_head, spec.hidden_size ** -0.5)
    return model


def _hf_names(spec: ModelSpec, model: Llama) -> dict[str, tuple[torch.Tensor, int, int]]:
    """HF tensor name -> (our tensor, first row, row count): fused tensors take row slices."""
    q, kv, inter = spec.q_size, spec.kv_size, spec.intermediate_size
    names: dict[str, tuple[torch.Tensor, int, int]] = {
        "model.embed_tokens.weight": (model.embed, 0, spec.vocab_size),
        "model.norm.weight": (model.norm, 0, spec.hidden_size),
    }
    if not spec.tie_word_embeddings:
        names["lm_head.weight"] = (model.lm_head, 0, spec.vocab_size)
    for i, w in enumerate(model.layers):
        p = f"model.layers.{i}."
        names.update({
            p + "input_layernorm.weight": (w.input_norm, 0, spec.hidden_size),
            p + "post_attention_layernorm.weight": (w.post_norm, 0, spec.hidden_size),
            p + "self_attn.q_proj.weight": (w.qkv, 0, q),
            p + "self_attn.k_proj.weight": (w.qkv, q, kv),
            p + "self_attn.v_proj.weight": (w.qkv, q + kv, kv),
            p + "self_attn.o_proj.weight": (w.o, 0, spec.hidden_size),
            p + "mlp.gate_proj.weight": (w.gate_up, 0, inter),
            p + "mlp.up_proj.weight": (w.gate_up, inter, inter),
            p + "mlp.down_proj.weight": (w.down, 0, spec.hidden_size),
        })
    return names


def _check_config(spec: ModelSpec, path: Path) -> None:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"backend.weights {path} has no config.json")
    cfg = json.loads(cfg_file.read_text())
    for hf_key, field in _HF_CONFIG.items():
        if hf_key in cfg and cfg[hf_key] != getattr(spec, field):
            raise ValueError(f"backend.weights {path}: config.json has {hf_key} {cfg[hf_key]} "
                             f"but model {spec.name} has {field} {getattr(spec, field)}")


def load_hf_model(spec: ModelSpec, path: str | Path, device: torch.device | str,
                  dtype: torch.dtype) -> Llama:
    """Load a local Hugging Face Llama directory: config.json plus model.safetensors or shards
    listed in model.safetensors.index.json; q/k/v and gate/up are fused on the way in."""
    from safetensors import safe_open

    path, device = Path(path), torch.device(device)
    _check_config(spec, path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"backend.weights {path} has neither model.safetensors nor "
                         "model.safetensors.index.json")
    model = _empty_model(spec, device, dtype)
    targets = _hf_names(spec, model)
    missing = set(targets)
    for name_of_file in files:
        with safe_open(str(path / name_of_file), framework="pt", device=str(device)) as f:
            for name in f.keys():
                if name not in targets:
                    continue  # e.g. rotary_emb.inv_freq, which we compute ourselves
                dst, row, rows = targets[name]
                src = f.get_tensor(name)
                expect = (rows,) + tuple(dst.shape[1:])
                if tuple(src.shape) != expect:
                    raise ValueError(f"backend.weights {path}: {name} has shape "
                                     f"{tuple(src.shape)}, model {spec.name} needs {expect}")
                dst[row:row + rows].copy_(src)
                missing.discard(name)
    if missing:
        raise ValueError(f"backend.weights {path} lacks {len(missing)} tensors, e.g. "
                         f"{sorted(missing)[0]}")
    return model


def save_hf_model(model: Llama, path: str | Path, num_shards: int = 1) -> None:
    """Write ``model`` as a Hugging Face Llama directory (config.json, safetensors shards, index)."""
    from safetensors.torch import save_file

    spec, path = model.spec, Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = {hf: getattr(spec, ours) for hf, ours in _HF_CONFIG.items()}
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", head_dim=spec.head_dim,
               max_position_embeddings=spec.max_model_len, rope_theta=spec.rope_theta,
               rope_scaling=spec.rope_scaling, rms_norm_eps=spec.rms_norm_eps,
               tie_word_embeddings=spec.tie_word_embeddings,
               torch_dtype=str(model.dtype).removeprefix("torch."))
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    names = list(_hf_names(spec, model).items())
    weight_map: dict[str, str] = {}
    for shard in range(num_shards):
        fname = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {name: src[row:row + rows].contiguous().cpu()
                for name, (src, row, rows) in names[shard::num_shards]}
        save_file(part, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
