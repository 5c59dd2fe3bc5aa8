"""Checkpoints and backend settings that must be refused with a one-line error naming the file or
setting: a config.json that disagrees with the model conf, damaged files, files outside the
weights directory, wrong tensors, and backend settings of the wrong type or range."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from real_backend.config import BackendConfig
from real_backend.model import forward_dense
from real_backend.weights import load_hf_model, random_model, save_hf_model
from tests.real_backend.rb_util import load_spec

ROOT = Path(__file__).resolve().parents[2]
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """The tiny model saved as a two-shard Hugging Face checkpoint."""
    path = tmp_path / "ckpt"
    save_hf_model(random_model(load_spec("tiny"), "cpu", torch.float32, seed=3), path, 2)
    return path


def load(path: Path, **spec_overrides) -> None:
    load_hf_model(load_spec("tiny", **spec_overrides), path, "cpu", torch.float32)


def refused(path: Path, *fragments: str, **spec_overrides) -> str:
    """The error loading ``path`` raises; it is one line and holds every fragment."""
    with pytest.raises(ValueError) as err:
        load(path, **spec_overrides)
    msg = str(err.value)
    assert "\n" not in msg
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)
    return msg


def edit_json(file: Path, edit) -> None:
    d = json.loads(file.read_text())
    edit(d)
    file.write_text(json.dumps(d))


def edit_shard(file: Path, edit) -> None:
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file))


# --- config.json against the model conf -------------------------------------------------------

@pytest.mark.parametrize("key, theirs, ours", [
    ("rope_theta", 10000.0, "500000.0"),
    ("rms_norm_eps", 1e-06, "1e-05"),
    ("tie_word_embeddings", True, "False"),
    ("rope_scaling", None, "'factor': 8.0"),
    ("head_dim", 64, "32"),
    ("num_hidden_layers", 3, "2"),
    ("vocab_size", 1024, "512"),
])
def test_config_json_that_disagrees_is_refused(ckpt: Path, key: str, theirs, ours: str) -> None:
    edit_json(ckpt / "config.json", lambda d: d.update({key: theirs}))
    refused(ckpt, str(ckpt / "config.json"), f"has {key} {theirs} but model tiny", ours)


def test_config_json_rope_scaling_factor_is_compared(ckpt: Path) -> None:
    edit_json(ckpt / "config.json", lambda d: d["rope_scaling"].update(factor=4.0))
    refused(ckpt, "config.json has rope_scaling", "'factor': 4.0", "'factor': 8.0")


@pytest.mark.parametrize("key, default", [("rms_norm_eps", "1e-06"), ("rope_theta", "10000.0")])
def test_config_json_omitted_key_means_transformers_default(ckpt: Path, key: str,
                                                           default: str) -> None:
    # transformers would run the checkpoint with its default, not with the model conf's value
    edit_json(ckpt / "config.json", lambda d: d.pop(key))
    refused(ckpt, f"has {key} {default} but model tiny")


def test_config_json_other_spellings_of_the_same_model_load(ckpt: Path) -> None:
    def respell(d: dict) -> None:
        # the older "type" key, an integer theta, and the newer rope_parameters object
        scaling = d.pop("rope_scaling")
        scaling["type"] = scaling.pop("rope_type")
        d["rope_parameters"] = {**scaling, "rope_theta": int(d.pop("rope_theta"))}
        d["rms_norm_eps"] = 1.0e-5 * (1 + 1e-12)

    edit_json(ckpt / "config.json", respell)
    load(ckpt)
    # a model conf without rope scaling matches a config.json whose scaling is "default"
    edit_json(ckpt / "config.json", lambda d: d.update(rope_parameters={
        "rope_type": "default", "rope_theta": 500000.0}))
    load(ckpt, rope_scaling=None)


def test_config_json_other_activation_is_refused(ckpt: Path) -> None:
    edit_json(ckpt / "config.json", lambda d: d.update(hidden_act="gelu"))
    refused(ckpt, "config.json has hidden_act gelu")


@pytest.mark.parametrize("text, fragment", [("{not json", "is not readable JSON"),
                                            ("[1, 2]", "must hold a JSON object")])
def test_config_json_unreadable_is_refused(ckpt: Path, text: str, fragment: str) -> None:
    (ckpt / "config.json").write_text(text)
    refused(ckpt, str(ckpt / "config.json"), fragment)


# --- damaged files ----------------------------------------------------------------------------

@pytest.mark.parametrize("damage", [
    lambda b: b[:-7],  # truncated data
    lambda b: b[:20],  # truncated header
    lambda b: b"",
    lambda b: b[:8] + b"\x00" + b[9:],  # header JSON broken
    lambda b: b"not a safetensors file at all" * 4,
], ids=["truncated", "truncated-header", "empty", "bad-header", "garbage"])
def test_damaged_safetensors_file_is_refused(ckpt: Path, damage) -> None:
    shard = ckpt / SHARD2
    shard.write_bytes(damage(shard.read_bytes()))
    refused(ckpt, str(shard), "is not a readable safetensors file")


@pytest.mark.parametrize("index, fragment", [
    ("{truncated", "is not readable JSON"),
    (json.dumps({"metadata": {}}), "needs a weight_map"),
    (json.dumps({"weight_map": ["a", "b"]}), "needs a weight_map"),
    (json.dumps({"weight_map": {"model.norm.weight": 3}}), "needs a weight_map"),
    (json.dumps({"weight_map": {"model.norm.weight": "gone.safetensors"}}),
     "names gone.safetensors, which does not exist"),
], ids=["not-json", "no-weight-map", "list", "number", "missing-file"])
def test_bad_index_is_refused(ckpt: Path, index: str, fragment: str) -> None:
    (ckpt / INDEX).write_text(index)
    refused(ckpt, str(ckpt / INDEX), fragment)


# --- files outside the weights directory ------------------------------------------------------

def _point_index_at(ckpt: Path, name: str) -> None:
    edit_json(ckpt / INDEX, lambda d: d.update(weight_map={
        k: (name if v == SHARD2 else v) for k, v in d["weight_map"].items()}))


def test_index_path_outside_the_directory_is_refused(ckpt: Path) -> None:
    # a complete, valid shard lies there: only containment can refuse it
    (ckpt.parent / SHARD2).write_bytes((ckpt / SHARD2).read_bytes())
    _point_index_at(ckpt, f"../{SHARD2}")
    refused(ckpt, str(ckpt / INDEX), f"names '../{SHARD2}'", "outside")
    _point_index_at(ckpt, str(ckpt.parent / SHARD2))  # an absolute path
    refused(ckpt, str(ckpt / INDEX), "outside")


def test_symlink_escaping_the_directory_is_refused(ckpt: Path) -> None:
    outside = ckpt.parent / "elsewhere.safetensors"
    (ckpt / SHARD2).rename(outside)
    (ckpt / SHARD2).symlink_to(outside)
    refused(ckpt, str(ckpt / INDEX), SHARD2, "outside")
    # the single-file layout: model.safetensors itself a link out of the directory
    (ckpt / INDEX).unlink()
    (ckpt / "model.safetensors").symlink_to(outside)
    refused(ckpt, str(ckpt / "model.safetensors"), "outside")


def test_symlink_inside_the_directory_loads(ckpt: Path) -> None:
    (ckpt / "blobs").mkdir()
    (ckpt / SHARD2).rename(ckpt / "blobs" / "b2")
    (ckpt / SHARD2).symlink_to(Path("blobs") / "b2")
    load(ckpt)


def test_hub_cache_snapshot_loads(ckpt: Path, tmp_path: Path) -> None:
    # Hugging Face's cache: snapshots/<rev>/<file> are links into the model's ../../blobs
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(ckpt.iterdir())):
        file.rename(repo / "blobs" / f"blob{i}")
        (snapshot / file.name).symlink_to(Path("../../blobs") / f"blob{i}")
    spec = load_spec("tiny")
    loaded = load_hf_model(spec, snapshot, "cpu", torch.float32)
    ids = torch.arange(12) * 5 % spec.vocab_size
    expect = forward_dense(random_model(spec, "cpu", torch.float32, seed=3), ids)
    assert torch.equal(forward_dense(loaded, ids), expect)


# --- tensors ----------------------------------------------------------------------------------

def test_missing_tensor_names_tensor_and_file(ckpt: Path) -> None:
    dropped = sorted(load_file(str(ckpt / SHARD1)))[0]
    edit_shard(ckpt / SHARD1, lambda t: t.pop(dropped))
    refused(ckpt, f"lacks 1 tensors, e.g. {dropped}", f"{INDEX} puts it in {SHARD1}")


def test_missing_tensor_of_a_single_file_checkpoint(ckpt: Path) -> None:
    tensors = {**load_file(str(ckpt / SHARD1)), **load_file(str(ckpt / SHARD2))}
    del tensors["model.norm.weight"]
    for name in (INDEX, SHARD1, SHARD2):
        (ckpt / name).unlink()
    save_file(tensors, str(ckpt / "model.safetensors"))
    refused(ckpt, "e.g. model.norm.weight (not in model.safetensors)")


def test_extra_tensor_names_tensor_and_file(ckpt: Path) -> None:
    # e.g. a checkpoint with attention biases, which this Llama has no place for
    edit_shard(ckpt / SHARD2, lambda t: t.update(
        {"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    refused(ckpt, str(ckpt / SHARD2), "model.layers.0.self_attn.q_proj.bias", "no place")


def test_recomputed_buffers_and_tied_lm_head_are_skipped(tmp_path: Path) -> None:
    spec = load_spec("tiny", tie_word_embeddings=True)
    model = random_model(spec, "cpu", torch.float32, seed=5)
    save_hf_model(model, tmp_path, 2)
    # transformers drops a tied checkpoint's lm_head and recomputes RoPE's inv_freq too
    edit_shard(tmp_path / SHARD1, lambda t: t.update({
        "lm_head.weight": torch.ones(spec.vocab_size, spec.hidden_size),
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    loaded = load_hf_model(spec, tmp_path, "cpu", torch.float32)
    assert loaded.lm_head is loaded.embed
    assert torch.equal(loaded.embed, model.embed)


def shard_of(ckpt: Path, name: str) -> Path:
    return ckpt / json.loads((ckpt / INDEX).read_text())["weight_map"][name]


def test_repeated_tensor_names_both_files(ckpt: Path) -> None:
    norm = load_file(str(shard_of(ckpt, "model.norm.weight")))["model.norm.weight"]
    other = ({ckpt / SHARD1, ckpt / SHARD2} - {shard_of(ckpt, "model.norm.weight")}).pop()
    edit_shard(other, lambda t: t.update({"model.norm.weight": norm}))
    refused(ckpt, "model.norm.weight is in both", SHARD1, SHARD2)


def test_wrong_shape_names_tensor_and_file(ckpt: Path) -> None:
    shard = shard_of(ckpt, "model.norm.weight")
    edit_shard(shard, lambda t: t.update({"model.norm.weight": torch.ones(129)}))
    refused(ckpt, str(shard), "model.norm.weight of shape (129,)", "needs (128,)")


def test_integer_tensor_is_refused(ckpt: Path) -> None:
    shard = shard_of(ckpt, "model.norm.weight")
    edit_shard(shard, lambda t: t.update({"model.norm.weight": torch.ones(128, dtype=torch.int32)}))
    refused(ckpt, str(shard), "model.norm.weight of dtype torch.int32")


# --- backend settings -------------------------------------------------------------------------

@pytest.mark.parametrize("settings, fragment", [
    ({"foo": 1}, "backend has no setting 'foo'"),
    ({"sampling": {"top_k": 2.5}}, "backend.sampling.top_k must be an integer >= -1, got 2.5"),
    ({"sampling": {"temperature": float("nan")}}, "backend.sampling.temperature must be a fin"),
    ({"sampling": {"temperature": "abc"}}, "backend.sampling.temperature must be a finite"),
    ({"sampling": {"top_p": float("inf")}}, "backend.sampling.top_p must be a finite"),
    ({"seed": 1.5}, "backend.seed must be an integer"),
    ({"seed": -1}, "backend.seed must be an integer >= 0"),
    ({"cuda_graphs": "yes"}, "backend.cuda_graphs must be true or false"),
    ({"async_output": 1}, "backend.async_output must be true or false"),
    ({"keep_runner": "false"}, "backend.keep_runner must be true or false"),
    ({"save_token_ids": None}, "backend.save_token_ids must be true or false"),
    ({"prefill_graph_max_tokens": -1}, "backend.prefill_graph_max_tokens must be an integer"),
    ({"prefill_graph_max_tokens": 8.0}, "backend.prefill_graph_max_tokens must be an integer"),
    ({"prefill_graph_max_tokens": 10**6}, "backend.prefill_graph_max_tokens must be in [0,"),
    ({"piecewise_graph_max_tokens": "big"}, "backend.piecewise_graph_max_tokens must be"),
    ({"gpu_memory_utilization": 0}, "backend.gpu_memory_utilization must be in (0, 1]"),
    ({"gpu_memory_utilization": 1.5}, "backend.gpu_memory_utilization must be in (0, 1]"),
    ({"gpu_memory_utilization": "0.5"}, "backend.gpu_memory_utilization must be a finite"),
    ({"gpu_memory_utilization": float("nan")}, "backend.gpu_memory_utilization must be a fin"),
    ({"cpu_kv_cache_gib": 0}, "backend.cpu_kv_cache_gib must be > 0"),
    ({"num_blocks": 2.5}, "backend.num_blocks must be an integer >= 1"),
    ({"num_blocks": 0}, "backend.num_blocks must be an integer >= 1"),
    ({"weights": ""}, "backend.weights must be null"),
    ({"weights": 3}, "backend.weights must be null"),
    ({"device": 0}, "backend.device must be"),
    ({"dtype": ["bf16"]}, "backend.dtype must be"),
    ({"kernels": "cuda"}, "backend.kernels must be auto, torch or triton"),
    ({"sampling": 3}, "backend.sampling must be a mapping"),
    ({"sampling": {"temperature": -0.5}}, "backend.sampling.temperature must be >= 0"),
    ({"sampling": {"top_p": 0.0}}, "backend.sampling.top_p must be in (0, 1]"),
    ({"sampling": {"top_p": 1.5}}, "backend.sampling.top_p must be in (0, 1]"),
    ({"sampling": {"top_k": 0}}, "backend.sampling.top_k must be -1 or >= 1"),
    ({"sampling": {"top_n": 5}}, "backend.sampling has no setting 'top_n'"),
])
def test_bad_backend_setting_is_refused(settings: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as err:
        BackendConfig.from_mapping({"device": "cpu", **settings})
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_triton_kernels_on_cpu_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"backend.kernels=triton on device cpu needs Triton's "
                                         r"interpreter \(set TRITON_INTERPRET=1\)"):
        BackendConfig.from_mapping({"device": "cpu", "kernels": "triton"})
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert BackendConfig.from_mapping({"device": "cpu", "kernels": "triton"}).kernel_set == "triton"


# --- through the command line -----------------------------------------------------------------

@pytest.mark.parametrize("case", ["truncated-shard", "triton-without-interpreter"])
def test_cli_prints_one_line_and_exits_2(ckpt: Path, tmp_path: Path, case: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [f"hydra.run.dir={tmp_path / 'run'}"]
    if case == "truncated-shard":
        shard = ckpt / SHARD2
        shard.write_bytes(shard.read_bytes()[:-100])
        args.append(f"backend.weights={ckpt}")
        expect = f"error: backend.weights: {shard} is not a readable safetensors file"
    else:
        args.append("backend.kernels=triton")
        expect = "error: backend.kernels=triton on device cpu needs Triton's interpreter"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.run", "backend=real", "model=tiny",
         "backend.device=cpu", "workload=synthetic", "workload.num_prompts=2", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(expect), proc.stderr
    assert not (tmp_path / "run" / "result.json").exists()
