"""The model shape both backends read from conf/model/*.yaml: sizes, parameter count, KV bytes."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from common.checks import check_int, check_number, check_settings

# Hugging Face config.json key -> ModelSpec field (the keys whose names differ or that every
# Llama config.json has), for checkpoints read (real_backend) and configs written (hf_config)
HF_CONFIG_FIELDS = {
    "num_hidden_layers": "num_layers", "hidden_size": "hidden_size",
    "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads",
    "intermediate_size": "intermediate_size", "vocab_size": "vocab_size",
}

# model.mlp: the MLP's form (ModelSpec.mlp)
MLP_KINDS = ("gated", "plain")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A Llama-architecture decoder (RMSNorm, RoPE, GQA attention, SwiGLU MLP), or with
    ``mlp: plain`` an OPT-style one whose MLP is two matrices (fc1, ReLU, fc2): the simulator
    prices either; the engines run the gated MLP only (``require_gated_mlp``)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3", "factor": ..., ...}
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    tokenizer: str | None = None  # name quicktok knows; None: the workload must give lengths
    dtype_bytes: int = 2  # bf16 weights and KV cache on the GPU
    # gated: Llama's gate_proj, up_proj, down_proj (SwiGLU: 3 matrices); plain: OPT's fc1, fc2
    # (ReLU: 2 matrices). The rest of OPT (LayerNorm, biases, learned positions) is left out:
    # under 0.2% of its weights and FLOPs.
    mlp: str = "gated"
    # Derived, not a setting: the parameters of one decoder layer (attention, MLP, two RMSNorm
    # weights), computed once (the cost model reads it for every step it prices)
    params_per_layer: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads",
                     "intermediate_size", "vocab_size", "max_model_len", "dtype_bytes"):
            check_int(f"model.{name}", getattr(self, name), 1)
        check_int("model.head_dim", self.head_dim, 0)
        check_number("model.rope_theta", self.rope_theta, positive=True)
        check_number("model.rms_norm_eps", self.rms_norm_eps, positive=True)
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError("model.tie_word_embeddings must be true or false, got "
                             f"{self.tie_word_embeddings!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise ValueError(f"model.rope_scaling must be a mapping or null, got {self.rope_scaling!r}")
        if self.tokenizer is not None and not isinstance(self.tokenizer, str):
            raise ValueError(f"model.tokenizer must be a name or null, got {self.tokenizer!r}")
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"model.mlp must be one of {', '.join(MLP_KINDS)}, got {self.mlp!r}")
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads ({self.num_heads}) must be a multiple of "
                f"model.num_kv_heads ({self.num_kv_heads})")
        h = self.hidden_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        object.__setattr__(self, "params_per_layer",
                           attn + self.mlp_matrices * h * self.intermediate_size + 2 * h)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        check_settings("model", d, (f.name for f in fields(cls) if f.init))
        if not isinstance(d.get("name"), str) or not d["name"]:
            raise ValueError(f"model.name must be a non-empty name, got {d.get('name')!r}")
        return cls(**d)

    def hf_config(self, torch_dtype: str) -> dict[str, Any]:
        """This shape as a Hugging Face Llama config.json (``torch_dtype``: its weights')."""
        self.require_gated_mlp("a Hugging Face Llama config.json")
        cfg: dict[str, Any] = {hf: getattr(self, ours) for hf, ours in HF_CONFIG_FIELDS.items()}
        cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", head_dim=self.head_dim,
                   max_position_embeddings=self.max_model_len, rope_theta=self.rope_theta,
                   rope_scaling=self.rope_scaling, rms_norm_eps=self.rms_norm_eps,
                   tie_word_embeddings=self.tie_word_embeddings, torch_dtype=torch_dtype)
        return cfg

    def require_gated_mlp(self, engine: str) -> None:
        """Refuse, in one line, a shape ``engine`` cannot run: the engines build Llama's gated
        MLP only (a plain-MLP model such as OPT is priced by the simulator alone)."""
        if self.mlp != "gated":
            raise ValueError(f"model {self.name}: model.mlp={self.mlp} (a 2-matrix ReLU MLP, as "
                             f"OPT's) is simulated only: {engine} builds Llama's gated MLP "
                             "only (model.mlp=gated)")

    @property
    def mlp_matrices(self) -> int:
        """The MLP's weight matrices of size hidden x intermediate: 3 gated, 2 plain."""
        return 3 if self.mlp == "gated" else 2

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        embed = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tie_word_embeddings else embed
        return self.num_layers * self.params_per_layer + embed + lm_head + self.hidden_size

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.kv_size * self.dtype_bytes
