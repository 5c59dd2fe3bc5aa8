"""Model weights: seeded random init, and loading/saving Hugging Face Llama checkpoints (whole, or
one tensor-parallel rank's share)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from common.model_spec import HF_CONFIG_FIELDS, ModelSpec
from real_backend.model import LayerWeights, Llama, rope_table

if TYPE_CHECKING:
    from real_backend.tp_group import TPGroup

# config.json key -> ModelSpec field, checked on load so a checkpoint never silently mismatches.
_HF_CONFIG = HF_CONFIG_FIELDS


def _empty_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype,
                 tp: TPGroup | None = None) -> Llama:
    """Zeroed weights of the whole model, or with ``tp`` of one rank's share (zeros: a
    vocabulary shard's padding rows must hold finite values)."""
    def t(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    local = tp.local_spec(spec) if tp else spec
    h, inter = spec.hidden_size, local.intermediate_size
    layers = [LayerWeights(t(h), t(local.q_size + 2 * local.kv_size, h), t(h, local.q_size), t(h),
                           t(2 * inter, h), t(h, inter)) for _ in range(spec.num_layers)]
    vocab = tp.vocab_rows(spec)[1] if tp else spec.vocab_size
    embed = t(vocab, h)
    lm_head = embed if spec.tie_word_embeddings else t(vocab, h)
    return Llama(local, embed, layers, t(h), lm_head, rope_table(spec, device), tp)


def random_model(spec: ModelSpec, device: torch.device | str, dtype: torch.dtype,
                 seed: int = 0, tp: TPGroup | None = None) -> Llama:
    """Gaussian weights scaled so activations keep unit scale through any depth (bf16-safe):
    projections into the residual stream shrink with 1/sqrt(2 * num_layers). With ``tp``, this
    rank's share of the very same model (each checkpoint tensor drawn whole, then cut)."""
    device = torch.device(device)
    model = _empty_model(spec, device, dtype, tp)
    gen = torch.Generator(device=device).manual_seed(seed)
    depth = math.sqrt(2 * spec.num_layers)
    stds = {"embed_tokens": 1.0, "q_proj": spec.hidden_size ** -0.5,
            "k_proj": spec.hidden_size ** -0.5, "v_proj": spec.hidden_size ** -0.5,
            "o_proj": spec.q_size ** -0.5 / depth, "gate_proj": spec.hidden_size ** -0.5,
            "up_proj": spec.hidden_size ** -0.5, "down_proj": spec.intermediate_size ** -0.5 / depth,
            "lm_head": spec.hidden_size ** -0.5}
    for name, place in _placements(spec, model).items():
        kind = name.split(".")[-2]
        if kind.endswith("norm"):
            place.dst.fill_(1.0)
            continue
        full = torch.empty(place.shape, dtype=dtype, device=device)
        place.put(full.normal_(0.0, stds[kind], generator=gen))
    return model


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a checkpoint tensor (of the whole model's ``shape``) goes: its slice from
    ``start`` along ``dim`` (this rank's share; all of it without tp) is copied into ``dst``."""

    dst: torch.Tensor
    shape: tuple[int, ...]
    dim: int = 0
    start: int = 0

    def put(self, src: torch.Tensor) -> None:
        self.dst.copy_(src.narrow(self.dim, self.start, self.dst.shape[self.dim]))


def _placements(spec: ModelSpec, model: Llama) -> dict[str, Placement]:
    """HF tensor name -> its placement in ``model`` (this rank's share with ``model.tp``):
    fused tensors take row slices; column-parallel weights (q/k/v, gate/up) this rank's rows,
    row-parallel ones (o, down) its columns, the vocabulary matrices its vocabulary rows."""
    tp, local = model.tp, model.spec
    h, q, kv, inter = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size
    ql, kvl, il = local.q_size, local.kv_size, local.intermediate_size
    rank = tp.rank if tp else 0
    q0, i0 = rank * ql, rank * il
    kv0 = tp.kv_head_start(spec) * spec.head_dim if tp else 0
    v0, vocab = (tp.vocab_rows(spec)[0], tp.vocab_rows(spec)[2]) if tp else (0, spec.vocab_size)
    names = {"model.embed_tokens.weight": Placement(model.embed[:vocab], (spec.vocab_size, h),
                                                    0, v0),
             "model.norm.weight": Placement(model.norm, (h,))}
    for i, w in enumerate(model.layers):
        p = f"model.layers.{i}."
        names.update({
            p + "input_layernorm.weight": Placement(w.input_norm, (h,)),
            p + "self_attn.q_proj.weight": Placement(w.qkv[:ql], (q, h), 0, q0),
            p + "self_attn.k_proj.weight": Placement(w.qkv[ql:ql + kvl], (kv, h), 0, kv0),
            p + "self_attn.v_proj.weight": Placement(w.qkv[ql + kvl:], (kv, h), 0, kv0),
            p + "self_attn.o_proj.weight": Placement(w.o, (h, q), 1, q0),
            p + "post_attention_layernorm.weight": Placement(w.post_norm, (h,)),
            p + "mlp.gate_proj.weight": Placement(w.gate_up[:il], (inter, h), 0, i0),
            p + "mlp.up_proj.weight": Placement(w.gate_up[il:], (inter, h), 0, i0),
            p + "mlp.down_proj.weight": Placement(w.down, (h, inter), 1, i0),
        })
    if not spec.tie_word_embeddings:
        names["lm_head.weight"] = Placement(model.lm_head[:vocab], (spec.vocab_size, h), 0, v0)
    return names


# What transformers' LlamaConfig assumes when config.json omits a key: the checkpoint was
# trained with these, so an omitted key is compared as its default, not skipped.
_HF_DEFAULTS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                "rope_scaling": None}
# Buffers some checkpoints carry that the model computes itself (as transformers and vLLM skip).
_RECOMPUTED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def _containment_root(path: Path) -> Path:
    """The directory no checkpoint file may leave: ``path`` itself, or for a Hugging Face hub
    cache snapshot (``models--org--name/snapshots/<rev>``, whose files are symlinks into
    ``../../blobs``) the model's cache directory."""
    path = path.resolve()
    if path.parent.name == "snapshots" and (path.parent.parent / "blobs").is_dir():
        return path.parent.parent
    return path


def _inside(path: Path, name: str, named_by: Path | None = None) -> Path:
    """``path / name`` if it stays inside the checkpoint's directory once ``..`` and symlinks are
    resolved: an index or a link must not make the loader read files elsewhere."""
    target = path / name
    resolved = target.resolve()
    if Path(name).is_absolute() or not resolved.is_relative_to(_containment_root(path)):
        what = f"{named_by} names {name!r}, which" if named_by else f"{target}"
        raise ValueError(f"backend.weights: {what} resolves to {resolved}, outside {path}")
    return target


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"backend.weights: {file} is not readable JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"backend.weights: {file} must hold a JSON object, "
                         f"got {type(data).__name__}")
    return data


def _rope(cfg: dict[str, Any]) -> tuple[Any, Any]:
    """(rope_theta, rope_scaling) of a config.json; newer transformers write both as one
    ``rope_parameters`` object, older ones as two keys (``type`` is the old ``rope_type``)."""
    if isinstance(cfg.get("rope_parameters"), dict):
        scaling = dict(cfg["rope_parameters"])
        theta = scaling.pop("rope_theta", cfg.get("rope_theta", _HF_DEFAULTS["rope_theta"]))
    else:
        theta = cfg.get("rope_theta", _HF_DEFAULTS["rope_theta"])
        scaling = cfg.get("rope_scaling", _HF_DEFAULTS["rope_scaling"])
    return theta, _normal_rope_scaling(scaling)


def _normal_rope_scaling(scaling: Any) -> Any:
    """One spelling of "no scaling" (None) and of the scaling's kind (``rope_type``)."""
    if not isinstance(scaling, dict):
        return scaling
    scaling = dict(scaling)
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    return None if scaling in ({}, {"rope_type": "default"}) else scaling


def _same(theirs: Any, ours: Any) -> bool:
    """Equal, with floats compared to rounding (1e-05 in JSON is 1e-5 in YAML) and booleans
    never equal to numbers."""
    if isinstance(theirs, dict) and isinstance(ours, dict):
        return theirs.keys() == ours.keys() and all(_same(theirs[k], ours[k]) for k in theirs)
    if isinstance(theirs, bool) or isinstance(ours, bool):
        return type(theirs) is type(ours) and theirs == ours
    if isinstance(theirs, (int, float)) and isinstance(ours, (int, float)):
        return math.isclose(theirs, ours, rel_tol=1e-9)
    return theirs == ours


def _check_config(spec: ModelSpec, path: Path) -> None:
    """Refuse a checkpoint whose config.json disagrees with the model conf on any setting the
    forward pass reads: a mismatch would run, silently, a different model than the one named."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"backend.weights {path} has no config.json")
    cfg_file = _inside(path, "config.json")
    cfg = _read_json(cfg_file)
    theirs = {hf: cfg[hf] for hf in _HF_CONFIG if hf in cfg}
    if cfg.get("head_dim") is not None:  # null: hidden_size // num_attention_heads
        theirs["head_dim"] = cfg["head_dim"]
    theirs.update({key: cfg.get(key, default) for key, default in _HF_DEFAULTS.items()})
    theirs["rope_theta"], theirs["rope_scaling"] = _rope(cfg)
    for hf_key, value in theirs.items():
        field = _HF_CONFIG.get(hf_key, hf_key)
        ours = getattr(spec, field)
        if field == "rope_scaling":
            ours = _normal_rope_scaling(ours)
        if not _same(value, ours):
            raise ValueError(f"backend.weights: {cfg_file} has {hf_key} {value} "
                             f"but model {spec.name} has {field} {ours}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"backend.weights: {cfg_file} has hidden_act {cfg['hidden_act']} "
                         "but the engine's MLP is SwiGLU (silu)")


def _weight_files(path: Path) -> tuple[list[Path], dict[str, str], Path]:
    """The safetensors files of a checkpoint, the index's tensor -> file map (empty without an
    index) and the file that lists them (the index, or the single model.safetensors)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        index = _inside(path, index.name)
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise ValueError(f"backend.weights: {index} needs a weight_map object of tensor "
                             "name -> file name")
        files = [_inside(path, name, index) for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ValueError(f"backend.weights: {index} names {file.name}, which does "
                                 "not exist")
        return files, weight_map, index
    single = path / "model.safetensors"
    if single.is_file():
        return [_inside(path, single.name)], {}, single
    raise ValueError(f"backend.weights {path} has neither model.safetensors nor "
                     "model.safetensors.index.json")


def _tensors(file: Path, device: torch.device) -> Iterator[tuple[str, Any]]:
    """Every tensor of one safetensors file as a lazy slice (``_read`` reads a rank's part);
    a damaged file is a one-line error naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for name in f.keys():
                yield name, f.get_slice(name)
    except (SafetensorError, OSError) as err:
        raise ValueError(f"backend.weights: {file} is not a readable safetensors file "
                         f"({err})") from None


def _read(file: Path, name: str, tensor: Any, place: Placement) -> torch.Tensor:
    """The part of a checkpoint tensor ``place`` takes (its rank's share: only those bytes
    are read)."""
    from safetensors import SafetensorError

    index = [slice(None)] * len(place.shape)
    index[place.dim] = slice(place.start, place.start + place.dst.shape[place.dim])
    try:
        return tensor[tuple(index)]
    except (SafetensorError, OSError) as err:
        raise ValueError(f"backend.weights: {file} has an unreadable {name} ({err})") from None


def load_hf_model(spec: ModelSpec, path: str | Path, device: torch.device | str,
                  dtype: torch.dtype, tp: TPGroup | None = None) -> Llama:
    """Load a local Hugging Face Llama directory: config.json plus model.safetensors or shards
    listed in model.safetensors.index.json; q/k/v and gate/up are fused on the way in. With
    ``tp``, this rank's share of every tensor (the checkpoint is the whole model's).

    Refused, each with a one-line ValueError naming the file: a config.json that disagrees with
    ``spec``, a damaged file, a file outside the directory, and a tensor that is missing, extra,
    repeated, not floating point or of the wrong shape."""
    path, device = Path(path), torch.device(device)
    _check_config(spec, path)
    files, weight_map, listing = _weight_files(path)
    model = _empty_model(spec, device, dtype, tp)
    targets = _placements(spec, model)
    found: dict[str, Path] = {}
    for file in files:
        for name, tensor in _tensors(file, device):
            if name.endswith(_RECOMPUTED) or (name == "lm_head.weight"
                                              and spec.tie_word_embeddings):
                continue  # tied: transformers, too, ties lm_head to the embedding and drops it
            if name in found:
                raise ValueError(f"backend.weights: tensor {name} is in both {found[name]} "
                                 f"and {file}")
            found[name] = file
            if name not in targets:
                raise ValueError(f"backend.weights: {file} has tensor {name}, which model "
                                 f"{spec.name} has no place for")
            place = targets[name]
            shape = tuple(tensor.get_shape())
            if shape != place.shape:
                raise ValueError(f"backend.weights: {file} has {name} of shape "
                                 f"{shape}, model {spec.name} needs {place.shape}")
            src = _read(file, name, tensor, place)
            if not src.is_floating_point():
                raise ValueError(f"backend.weights: {file} has {name} of dtype {src.dtype}, "
                                 "a model weight must be floating point")
            place.dst.copy_(src)
    missing = sorted(set(targets) - set(found))
    if missing:
        where = (f"{listing.name} puts it in {weight_map[missing[0]]}"
                 if missing[0] in weight_map else f"not in {listing.name}")
        raise ValueError(f"backend.weights {path} lacks {len(missing)} tensors, e.g. "
                         f"{missing[0]} ({where})")
    return model


def save_hf_model(model: Llama, path: str | Path, num_shards: int = 1) -> None:
    """Write ``model`` (a whole one, not a rank's share) as a Hugging Face Llama directory
    (config.json, safetensors shards, index)."""
    from safetensors.torch import save_file

    if model.tp is not None:
        raise ValueError("save_hf_model writes a whole model, not a tensor-parallel rank's share")
    spec, path = model.spec, Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = spec.hf_config(str(model.dtype).removeprefix("torch."))
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    names = list(_placements(spec, model).items())
    weight_map: dict[str, str] = {}
    for shard in range(num_shards):
        fname = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {name: place.dst.contiguous().cpu() for name, place in names[shard::num_shards]}
        save_file(part, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
