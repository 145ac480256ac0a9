"""A Llama model's configuration, read as real checkpoints write it, and its rotary frequencies.

:meth:`ModelConfig.from_hf` reads a Hugging Face ``config.json`` in the layouts transformers 4
and 5 write: RoPE's base as a top-level ``rope_theta`` with an optional ``rope_scaling`` (4.x), or
inside ``rope_parameters`` (5.x). It computes what it can exactly — ``rope_type`` ``default`` and
``llama3`` (the Llama 3.x family: :func:`rope_inv_freq` reproduces transformers'
``_compute_llama3_parameters`` operation for operation), an explicit ``head_dim`` (which may differ
from ``hidden_size / num_attention_heads``) — and refuses, with a one-line message naming the
field, anything it would compute wrong: other RoPE types, a partial rotary factor, sliding
windows, attention or MLP biases, another activation, another architecture. A checkpoint is never
loaded and computed wrong silently (the RoPE base of 10,000 a transformers-5 config once got).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

#: RoPE types computed exactly (anything else is refused at load).
ROPE_TYPES = ("default", "llama3")
#: Architectures whose math this implementation is (Mistral's without a sliding window is Llama's).
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True)
class Llama3Rope:
    """``rope_type: llama3``'s parameters (Llama 3.1+: frequency-dependent context extension)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 320
    hidden_size: int = 128
    intermediate_size: int = 352
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    name: str = "kvflow-tiny-llama"
    #: Dimension of one attention head; 0: ``hidden_size // num_attention_heads``.
    head_dim: int = 0
    #: ``llama3`` RoPE's parameters; None: plain RoPE (``rope_type: default``).
    rope_llama3: Llama3Rope | None = None
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.head_dim:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError("hidden_size must be a multiple of num_attention_heads (or head_dim given)")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even (rotary embeddings)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def from_hf(cls, data: dict[str, Any], name: str) -> ModelConfig:
        """From a Hugging Face ``config.json`` (LlamaConfig keys, transformers 4 or 5 layout)."""
        arch = data.get("architectures") or []
        if arch and not any(a in ARCHITECTURES for a in arch):
            raise ValueError(f"unsupported architectures {arch}: a Llama-family model is required "
                             f"({', '.join(ARCHITECTURES)})")
        model_type = data.get("model_type")
        if model_type not in (None, "llama", "mistral"):
            raise ValueError(f"unsupported model_type {model_type!r}: a Llama-family model is required")
        # Features this implementation does not compute must refuse, not load and compute wrongly.
        if data.get("sliding_window") and data.get("use_sliding_window", True):
            raise ValueError(f"sliding_window {data['sliding_window']} is not supported (full attention only)")
        for flag in ("attention_bias", "mlp_bias"):
            if data.get(flag):
                raise ValueError(f"{flag} true is not supported (Llama projections have no bias)")
        act = data.get("hidden_act") or data.get("hidden_activation") or "silu"
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (SwiGLU with silu only)")
        heads = int(data["num_attention_heads"])
        theta, llama3 = _rope(data)
        return cls(
            vocab_size=int(data["vocab_size"]),
            hidden_size=int(data["hidden_size"]),
            intermediate_size=int(data["intermediate_size"]),
            num_hidden_layers=int(data["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(data.get("num_key_value_heads") or heads),
            max_position_embeddings=int(data.get("max_position_embeddings") or 4096),
            rope_theta=theta,
            rms_norm_eps=float(data.get("rms_norm_eps") or 1e-5),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            name=name,
            head_dim=int(data.get("head_dim") or 0),
            rope_llama3=llama3,
        )

    def to_hf(self) -> dict[str, object]:
        """``config.json`` as transformers 4 writes it (transformers 5 reads it too)."""
        d = asdict(self)
        for k in ("extra", "name", "rope_llama3"):
            d.pop(k)
        if self.rope_llama3 is not None:
            d["rope_scaling"] = {"rope_type": "llama3", **asdict(self.rope_llama3)}
        d.update({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                  "torch_dtype": "float32", "attention_bias": False, "mlp_bias": False})
        return d


def _rope(data: dict[str, Any]) -> tuple[float, Llama3Rope | None]:
    """RoPE's base and scaling from either layout: ``rope_parameters`` (transformers 5: the base
    inside it) or a top-level ``rope_theta`` and ``rope_scaling`` (transformers 4)."""
    params = data.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"rope_parameters {params!r} is not supported (one set for all layers expected)")
    scaling = params if params is not None else data.get("rope_scaling")
    theta_value = (params or {}).get("rope_theta", data.get("rope_theta"))
    if theta_value is None:
        theta_value = 10000.0  # transformers' LlamaConfig default
    theta = float(theta_value)
    if not theta > 0:
        raise ValueError(f"rope_theta {theta_value!r} must be positive")
    if not scaling:
        return theta, None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported (computed exactly: {', '.join(ROPE_TYPES)})")
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"partial_rotary_factor {scaling['partial_rotary_factor']} is not supported")
    if rope_type == "default":
        return theta, None
    try:
        llama3 = Llama3Rope(float(scaling["factor"]), float(scaling["low_freq_factor"]),
                            float(scaling["high_freq_factor"]), int(scaling["original_max_position_embeddings"]))
    except KeyError as exc:
        raise ValueError(f"rope_type 'llama3' needs {exc.args[0]} in its parameters") from None
    if llama3.high_freq_factor == llama3.low_freq_factor:
        raise ValueError("rope_type 'llama3': high_freq_factor must differ from low_freq_factor")
    return theta, llama3


def rope_inv_freq(cfg: ModelConfig, device: torch.device | None = None) -> Tensor:
    """The inverse frequencies of the rotary embedding, ``[head_dim / 2]`` float32, as transformers
    computes them (``_compute_default_rope_parameters``, ``_compute_llama3_parameters``)."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device,
                                                                                      dtype=torch.float) / dim))
    r = cfg.rope_llama3
    if r is None:
        return inv_freq
    old_context_len = r.original_max_position_embeddings
    low_freq_wavelen = old_context_len / r.low_freq_factor
    high_freq_wavelen = old_context_len / r.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / r.factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / r.factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)
