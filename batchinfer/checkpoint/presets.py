"""Seeded random checkpoints at real or tiny shapes, in memory or on disk (`make-checkpoint`).

Real-shape presets copy the configs of Qwen3.6-35B-A3B and Qwen3-30B-A3B (see
shared/notes/qwen-models-and-nvfp4.md), except that the token ids follow our small built-in
tokenizer and no MTP/vision weights exist. Weights are drawn on the target device (same seed and
device -> same weights) at realistic scales, so forwards stay finite; quantized presets quantize
one layer at a time, so the full-precision model never exists in memory at once.

The init is GPT-2's: unit-variance token embeddings, linears N(0, 0.02), and the projections that
write into the residual stream (o_proj, out_proj, every down_proj) scaled by 1 / sqrt(2 * layers).
With plain N(0, 0.02) everywhere the residual stream is made of the blocks' outputs alone, and a
40-layer, 256-expert random model is chaotic: top-8 routing flips on bf16 rounding and compound, so
the bf16 PyTorch forward itself drifts 34% (relative L2, 16 layers, 64 experts) from the fp32 one and
no bf16 engine can be checked against fp32. With this init the same comparison gives 1.3e-2 (top-1 98%) at 40
layers and 256 experts (hidden 512; `docs/ACCURACY.md`).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import torch

from batchinfer.checkpoint.layout import weight_specs
from batchinfer.checkpoint.loader import Weight, model_config_from_hf
from batchinfer.checkpoint.quant_config import NVFP4
from batchinfer.checkpoint.quantize import quantize_weight, scheme_format
from batchinfer.checkpoint.tokenizer_files import BUILTIN_CORPUS, build_tokenizer, builtin_special_ids
from batchinfer.checkpoint.writer import save_checkpoint, to_hf_checkpoint
from batchinfer.errors import ConfigError
from batchinfer.kernels.nvfp4 import quantize_nvfp4_stack
from batchinfer.models.config import ModelConfig

QUANTS = ("bf16", "nvfp4", "mixed")


def _qwen35(
    vocab: int,
    hidden: int,
    layers: int,
    heads: int,
    kv: int,
    head_dim: int,
    lin: tuple[int, ...],
    experts: int,
    topk: int,
    moe: int,
    mrope: list[int],
    max_pos: int,
) -> dict[str, Any]:
    text = {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        "full_attention_interval": 4,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "attn_output_gate": True,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": mrope,
            "mrope_interleaved": True,
        },
        "linear_num_key_heads": lin[0],
        "linear_num_value_heads": lin[1],
        "linear_key_head_dim": lin[2],
        "linear_value_head_dim": lin[3],
        "linear_conv_kernel_dim": 4,
        "mamba_ssm_dtype": "float32",
        "num_experts": experts,
        "num_experts_per_tok": topk,
        "moe_intermediate_size": moe,
        "shared_expert_intermediate_size": moe,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": max_pos,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "mtp_num_hidden_layers": 0,  # the real model has 1; generated checkpoints carry no MTP weights
        "dtype": "bfloat16",
    }
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "text_config": text,
    }


def _qwen3(
    vocab: int,
    hidden: int,
    layers: int,
    heads: int,
    kv: int,
    head_dim: int,
    experts: int,
    topk: int,
    moe: int,
    max_pos: int,
) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 6144 if hidden == 2048 else 4 * hidden,  # unused: every layer is MoE
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "num_experts": experts,
        "num_experts_per_tok": topk,
        "moe_intermediate_size": moe,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": max_pos,
        "sliding_window": None,
        "attention_bias": False,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }


PRESETS: dict[str, dict[str, Any]] = {
    "qwen3.6-35b-a3b": _qwen35(
        248320, 2048, 40, 16, 2, 256, (16, 32, 128, 128), 256, 8, 512, [11, 11, 10], 262144
    ),
    "qwen3-30b-a3b": _qwen3(151936, 2048, 48, 32, 4, 128, 128, 8, 768, 40960),
    "tiny-qwen3.5-moe": _qwen35(512, 64, 4, 4, 2, 32, (2, 4, 16, 16), 8, 2, 32, [2, 1, 1], 4096),
    "tiny-qwen3-moe": _qwen3(512, 64, 4, 4, 2, 16, 8, 2, 32, 4096),
}


def preset_config(preset: str) -> dict[str, Any]:
    """The preset's `config.json` dict, with BOS/EOS/pad ids of the built-in tokenizer."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; available: {', '.join(PRESETS)}")
    raw = copy.deepcopy(PRESETS[preset])
    text = raw.get("text_config", raw)
    ids = builtin_special_ids(text["vocab_size"])
    text.update(
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"]
    )
    return raw


def _init(
    canon: str, shape: tuple[int, ...], cfg: ModelConfig, g: torch.Generator, device: str
) -> torch.Tensor:
    """One fp32 weight: embeddings N(0, 1), linears N(0, 0.02) (residual-branch outputs scaled down),
    norms near neutral, DeltaNet params as in HF."""
    rand = lambda: torch.randn(shape, generator=g, device=device)
    leaf = canon.rsplit(".", 1)[-1]
    if canon.endswith("linear_attn.norm"):
        return 1.0 + 0.02 * rand()  # gated RMSNorm of DeltaNet: plain weight
    if leaf in ("input_layernorm", "post_attention_layernorm", "norm", "q_norm", "k_norm"):
        neutral = 0.0 if cfg.one_plus_norm else 1.0  # Qwen3.5 norms scale by (1 + w)
        return neutral + 0.02 * rand()
    if leaf == "conv1d":
        bound = 1 / math.sqrt(shape[-1])
        return (torch.rand(shape, generator=g, device=device) * 2 - 1) * bound
    if leaf == "A_log":
        return torch.log(1 + 15 * torch.rand(shape, generator=g, device=device))
    if leaf == "dt_bias":
        return torch.ones(shape, device=device)
    if leaf == "embed_tokens":
        return rand()
    if leaf in RESIDUAL_OUTPUTS:
        return residual_output_std(cfg) * rand()
    return 0.02 * rand()


RESIDUAL_OUTPUTS = ("o_proj", "out_proj", "down_proj")


def residual_output_std(cfg: ModelConfig) -> float:
    """GPT-2's std for projections into the residual stream: 0.02 / sqrt(2 * layers)."""
    return 0.02 / math.sqrt(2 * cfg.num_hidden_layers)


def random_weights(
    cfg: ModelConfig,
    *,
    seed: int = 0,
    device: str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    scheme: str = "bf16",
) -> dict[str, Weight]:
    """Canonical weights for `cfg`, drawn in spec order from one seeded generator on `device`.

    Each layer's experts are drawn as fused `[E, 2I, D]` / `[E, D, I]` tensors whose per-expert views
    fill the dict, so BF16 Qwen3.5 checkpoints are written without a copy. `scheme` (`nvfp4`, `mixed`)
    quantizes layer by layer as `batchinfer quantize` would.
    """
    if scheme not in QUANTS:
        raise ConfigError(f"unknown quantization {scheme!r}; available: {', '.join(QUANTS)}")
    g = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, Weight] = {}
    e, i, d = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    for canon, spec in weight_specs(cfg).items():
        if ".mlp.experts." in canon:
            layer = canon.split(".mlp.experts.")[0]
            if f"{layer}.mlp.experts.0.gate_proj" not in out:
                gate_up = (0.02 * torch.randn((e, 2 * i, d), generator=g, device=device)).to(dtype)
                down = (residual_output_std(cfg) * torch.randn((e, d, i), generator=g, device=device)).to(
                    dtype
                )
                stacks = (("gate_proj", gate_up[:, :i]), ("up_proj", gate_up[:, i:]), ("down_proj", down))
                for name, stack in stacks:
                    keys = [f"{layer}.mlp.experts.{x}.{name}" for x in range(e)]
                    if scheme_format(keys[0], scheme) == NVFP4:  # all experts at once: same bits, one pass
                        out.update(zip(keys, quantize_nvfp4_stack(stack), strict=True))
                    else:
                        out.update(
                            (key, quantize_weight(key, w, scheme, cfg))
                            for key, w in zip(keys, stack, strict=True)
                        )
            continue
        w = _init(canon, spec.shape, cfg, g, device).to(dtype)
        out[canon] = quantize_weight(canon, w, scheme, cfg) if spec.linear else w
    return out


def build_checkpoint(
    preset: str, *, quant: str = "bf16", seed: int = 0, device: str = "cpu"
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A preset checkpoint in memory: its `config.json` dict and HF-named tensors, exactly what
    `make-checkpoint` would write. Load with `load_checkpoint(tensors, config=config)`."""
    raw = preset_config(preset)
    cfg = model_config_from_hf(raw, source=f"preset {preset}")
    return to_hf_checkpoint(raw, random_weights(cfg, seed=seed, device=device, scheme=quant))


def write_preset(
    preset: str,
    out_dir: str | Path,
    *,
    quant: str = "bf16",
    seed: int = 0,
    device: str = "cpu",
) -> Path:
    """Write a complete HF checkpoint folder for `preset`: configs, safetensors and tokenizer files."""
    raw = preset_config(preset)
    cfg = model_config_from_hf(raw, source=f"preset {preset}")
    weights = random_weights(cfg, seed=seed, device=device, scheme=quant)
    out = save_checkpoint(out_dir, raw, weights)
    build_tokenizer(BUILTIN_CORPUS, cfg.vocab_size, out)
    return out
