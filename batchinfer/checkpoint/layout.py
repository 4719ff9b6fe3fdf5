"""The canonical weight names and shapes of a `ModelConfig`, and the Hugging Face names around them.

`weight_specs` is the single list every loader checks against and every writer produces: one
entry per canonical weight (docs/ARCHITECTURE.md), with its shape and whether it is a linear
(which may be stored quantized). The helpers here translate between that list and the
prefixed names real checkpoints use; they know nothing about file formats.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from batchinfer.models.config import ModelConfig

PREFIX_VL = "model.language_model."  # Qwen3.5/3.6 vision-language checkpoints
PREFIX_TEXT = "model."  # Qwen3-MoE and text-only Qwen3.5 (transformers' Qwen3_5MoeForCausalLM)
LINEAR_FIELDS = (
    "weight",
    "weight_scale",
    "weight_scale_2",
    "input_scale",
    "weight_packed",
    "weight_global_scale",
    "input_global_scale",
)
_FUSED = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_SKIPPED = re.compile(r"^(mtp\.|model\.mtp\.|model\.visual\.|visual\.|model\.language_model\.mtp\.)")
# FP8 KV-cache scales of ModelOpt exports: not used; our FP8 KV cache (`kv_cache=fp8`) sets a scale per
# token and head as it writes, so it needs no calibrated per-tensor scales.
_KV_SCALE = re.compile(r"\.(k_scale|v_scale|k_proj\.output_scale|v_proj\.output_scale)$")


@dataclass(frozen=True, slots=True)
class WeightSpec:
    shape: tuple[int, ...]
    linear: bool  # a [out, in] matmul weight: dense, NVFP4Weight or FP8Weight


def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
    """Canonical name -> expected shape, in a stable order (embeddings, layers, final norm, lm_head)."""
    d, v = cfg.hidden_size, cfg.vocab_size
    specs: dict[str, WeightSpec] = {"embed_tokens": WeightSpec((v, d), False)}

    def lin(name: str, out: int, inp: int) -> None:
        specs[name] = WeightSpec((out, inp), True)

    def vec(name: str, *shape: int) -> None:
        specs[name] = WeightSpec(tuple(shape), False)

    for i, kind in enumerate(cfg.layer_types):
        p = f"layers.{i}."
        vec(p + "input_layernorm", d)
        if kind == "full_attention":
            q_width = cfg.num_attention_heads * cfg.head_dim
            kv_width = cfg.num_key_value_heads * cfg.head_dim
            lin(p + "self_attn.q_proj", q_width * (2 if cfg.attn_output_gate else 1), d)
            lin(p + "self_attn.k_proj", kv_width, d)
            lin(p + "self_attn.v_proj", kv_width, d)
            lin(p + "self_attn.o_proj", d, q_width)
            vec(p + "self_attn.q_norm", cfg.head_dim)
            vec(p + "self_attn.k_norm", cfg.head_dim)
        else:
            key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
            value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
            conv_dim = 2 * key_dim + value_dim
            nv = cfg.linear_num_value_heads
            lin(p + "linear_attn.in_proj_qkv", conv_dim, d)
            lin(p + "linear_attn.in_proj_z", value_dim, d)
            lin(p + "linear_attn.in_proj_b", nv, d)
            lin(p + "linear_attn.in_proj_a", nv, d)
            vec(p + "linear_attn.conv1d", conv_dim, 1, cfg.linear_conv_kernel_dim)
            vec(p + "linear_attn.A_log", nv)
            vec(p + "linear_attn.dt_bias", nv)
            vec(p + "linear_attn.norm", cfg.linear_value_head_dim)
            lin(p + "linear_attn.out_proj", d, value_dim)
        vec(p + "post_attention_layernorm", d)
        lin(p + "mlp.gate", cfg.num_experts, d)
        moe = cfg.moe_intermediate_size
        for e in range(cfg.num_experts):
            lin(p + f"mlp.experts.{e}.gate_proj", moe, d)
            lin(p + f"mlp.experts.{e}.up_proj", moe, d)
            lin(p + f"mlp.experts.{e}.down_proj", d, moe)
        if cfg.shared_expert_intermediate_size:
            s = cfg.shared_expert_intermediate_size
            lin(p + "mlp.shared_expert.gate_proj", s, d)
            lin(p + "mlp.shared_expert.up_proj", s, d)
            lin(p + "mlp.shared_expert.down_proj", d, s)
            lin(p + "mlp.shared_expert_gate", 1, d)
    vec("norm", d)
    lin("lm_head", v, d)
    return specs


def hf_prefix(name: str) -> str:
    """The `model.`-style prefix in front of a canonical name ('' for `lm_head`)."""
    if name.startswith(PREFIX_VL):
        return PREFIX_VL
    if name.startswith(PREFIX_TEXT):
        return PREFIX_TEXT
    return ""


def is_skipped(name: str) -> bool:
    """MTP, vision and KV-cache-scale tensors: present in real checkpoints, unused by our model."""
    return bool(_SKIPPED.match(name) or _KV_SCALE.search(name))


def fused_expert(rest: str) -> tuple[int, str] | None:
    """`layers.N.mlp.experts.gate_up_proj` -> (N, 'gate_up_proj'); None for any other name."""
    m = _FUSED.match(rest)
    return (int(m.group(1)), m.group(2)) if m else None


def split_field(rest: str, specs: dict[str, WeightSpec]) -> tuple[str, str] | None:
    """Unprefixed HF name -> (canonical name, field), e.g. 'layers.0.mlp.gate.weight' -> ('layers.0.mlp.gate',
    'weight'); 'layers.0.linear_attn.A_log' -> (.., ''). None if it names no canonical weight."""
    if is_bare(rest):
        return (rest, "") if rest in specs else None  # A_log, dt_bias: bare parameters
    module, _, field = rest.rpartition(".")
    if module not in specs:
        return None
    if specs[module].linear:
        return (module, field) if field in LINEAR_FIELDS else None
    return (module, field) if field == "weight" else None


def hf_name(prefix: str, canonical: str, field: str) -> str:
    """Inverse of `split_field`, e.g.
    ('model.', 'layers.0.mlp.gate', 'weight') -> 'model.layers.0.mlp.gate.weight'."""
    base = canonical if canonical == "lm_head" else prefix + canonical
    return f"{base}.{field}" if field else base


def is_bare(canonical: str) -> bool:
    """Parameters stored without a `.weight` suffix."""
    return canonical.endswith((".A_log", ".dt_bias"))
