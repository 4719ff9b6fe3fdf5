"""MoE routing and the expert loop against a per-token dense computation."""

import math
from dataclasses import replace

import torch
from models_tiny import hf_canonical, hf_model

from batchinfer.models.moe import expert_mlp, route, sparse_moe

PROBS = [0.5, 0.3, 0.2]


def test_route_top_k_with_and_without_renormalisation():
    x = torch.tensor([PROBS]).log()  # with an identity router the logits are log-probabilities
    router = torch.eye(3)
    w, ids = route(x, router, top_k=2, renormalize=True)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(w, torch.tensor([[0.625, 0.375]]))
    w, _ = route(x, router, top_k=2, renormalize=False)
    torch.testing.assert_close(w, torch.tensor([[0.5, 0.3]]))
    w, _ = route(x.bfloat16(), router.bfloat16(), top_k=2, renormalize=True)
    assert w.dtype == torch.bfloat16


def test_expert_mlp_is_swiglu():
    x = torch.tensor([[1.0, -2.0]])
    gate, up, down = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]]), torch.tensor([[3.0]])
    silu_1 = 1.0 / (1.0 + math.exp(-1.0))
    torch.testing.assert_close(expert_mlp(x, (gate, up, down)), torch.tensor([[3.0 * silu_1 * -2.0]]))


def _dense_reference(x, lw, experts, config, shared):
    """Every token through every expert, weighted by its renormalised top-k routing weight (0 if unrouted)."""
    probs = torch.softmax(x @ lw["gate"].T, dim=-1)
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        top = torch.topk(probs[n], config.num_experts_per_tok)
        weights = top.values / top.values.sum() if config.norm_topk_prob else top.values
        for e, wgt in zip(top.indices.tolist(), weights, strict=True):
            out[n] += wgt * expert_mlp(x[n : n + 1], experts[e])[0]
        if shared is not None:
            out[n] += torch.sigmoid(x[n] @ lw["shared_expert_gate"][0]) * expert_mlp(x[n : n + 1], shared)[0]
    return out


def test_sparse_moe_equals_dense_per_token_computation():
    for family in ("qwen3_moe", "qwen3_5_moe"):
        config, weights = hf_canonical(hf_model(family))
        lw = {"gate": weights["layers.0.mlp.gate"]}
        experts = [
            tuple(weights[f"layers.0.mlp.experts.{e}.{n}"] for n in ("gate_proj", "up_proj", "down_proj"))
            for e in range(config.num_experts)
        ]
        shared = None
        if config.shared_expert_intermediate_size:
            shared = tuple(
                weights[f"layers.0.mlp.shared_expert.{n}"] for n in ("gate_proj", "up_proj", "down_proj")
            )
            lw["shared_expert_gate"] = weights["layers.0.mlp.shared_expert_gate"]
        x = torch.randn(11, config.hidden_size, generator=torch.Generator().manual_seed(0))
        for cfg in (config, replace(config, norm_topk_prob=False)):
            got = sparse_moe(x, lw, experts, cfg, shared)
            torch.testing.assert_close(
                got, _dense_reference(x, lw, experts, cfg, shared), rtol=1e-5, atol=1e-5
            )
