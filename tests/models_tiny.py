"""Tiny random Hugging Face Qwen MoE models and their canonical weights, shared by the tests/test_models_*.

Weights are perturbed away from HF's init (norms at 0 or 1, dt_bias at 1) and scaled up so every
term of the forward matters and logits have a clear argmax.
"""

from __future__ import annotations

import tempfile

import torch
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

from batchinfer.checkpoint.loader import Weight, load_checkpoint
from batchinfer.models.config import ModelConfig
from batchinfer.models.qwen_moe import QwenMoeModel

FAMILIES = ("qwen3_moe", "qwen3_5_moe")
VOCAB = 320


def hf_config(family: str):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )
    if family == "qwen3_moe":
        return Qwen3MoeConfig(num_hidden_layers=2, head_dim=16, norm_topk_prob=True, **common)
    return Qwen3_5MoeTextConfig(
        num_hidden_layers=4,
        head_dim=32,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        shared_expert_intermediate_size=48,
        **common,
    )


@torch.no_grad()
def hf_model(family: str, seed: int = 0):
    """A tiny fp32 HF model in eval mode with non-trivial random weights."""
    torch.manual_seed(seed)
    cls = Qwen3MoeForCausalLM if family == "qwen3_moe" else Qwen3_5MoeForCausalLM
    model = cls(hf_config(family)).float().eval()
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if p.ndim >= 2 and "conv1d" not in name:  # linear / embedding: ~unit-variance outputs
            p.copy_(noise * (1.5 if "embed" in name else 1.0) / p.shape[-1] ** 0.5)
        elif "A_log" in name:
            p.copy_(noise * 0.5 - 1.0)
        else:  # norms (around 0 for 1+w, around 1 otherwise), dt_bias, conv taps
            p.add_(noise * 0.3)
    return model


def hf_canonical(model, dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, dict[str, Weight]]:
    """ModelConfig and canonical weights of an HF model, through `save_pretrained` and our real loader."""
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        return load_checkpoint(folder, dtype=dtype)


def tiny_model(family: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> QwenMoeModel:
    config, weights = hf_canonical(hf_model(family, seed), dtype)
    return QwenMoeModel(config, weights)
