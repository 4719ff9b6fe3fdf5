"""The direct MoE path (`moe_direct`: tensor cores, one tile an entry) against the fp32 reference and the
decode path; CPU (interpreter) and real GPU shapes."""

import dataclasses

import pytest
import torch
from batchinfer.kernels import moe
from batchinfer.kernels.moe import (
    MoEDecodeConfig,
    moe_experts,
    moe_experts_add_rmsnorm,
    moe_experts_ref,
    moe_route,
    router_logits,
)
from batchinfer.kernels.moe_direct import MoEDirectConfig, direct_config
from batchinfer.kernels.moe_tc import MoETCConfig, fit_steps, pair_moe_weights
from batchinfer.kernels.small_ops import add_rmsnorm
from test_kernels_moe import (
    DEVICE,
    GPU_MODELS,
    _counted_norm_rows,
    _counters_zero,
    _poisoned_empty,
    _rel,
    _route,
    _weights,
)

DECODE = MoEDecodeConfig((16, 2, 4, 1), (16, 2, 4, 1))
# (gate_up, down): K splits of one and several iterations, one block an iteration (STEPS 1: the scale word
# halves) and two; 96 and 160 intermediate rows: ragged last row tiles (and down's K 160: STEPS 1 only)
CFGS = [
    MoEDirectConfig((16, 4, 1, 2, 2), (16, 4, 1, 2)),
    MoEDirectConfig((32, 4, 1, 1, 4), (64, 4, 1, 1)),
    MoEDirectConfig((64, 4, 1, 4, 1), (32, 4, 1, 4)),
]


@pytest.mark.parametrize("cfg", CFGS)
@pytest.mark.parametrize(("t", "shared", "i"), [(1, True, 96), (2, False, 160), (8, True, 64)])
def test_direct_path_matches_reference(monkeypatch, cfg, t, shared, i):
    """Every entry its own tile, its column of x alone read; outputs rounded once after the slot sum, as
    the decode path's: both within bf16 rounding of the reference, the same up to summation order, the
    same again on a second call (split and slot counters reset; launched with the tuner's register cap).
    One expert serving several tokens."""
    w = _weights(6, 128, i, True, shared, seed=11 * t + i)
    a = 2 + shared
    ids, route_w, g = _route(t, a, 6 + shared, seed=12 * t)
    ids[1:, 0] = ids[0, 0]
    h = torch.randn(t, 128, generator=g).to(torch.bfloat16).to(DEVICE)
    paired = pair_moe_weights(w)
    with monkeypatch.context() as m:
        _poisoned_empty(m)
        out = moe_experts(h, ids, route_w, paired, config=cfg)
    assert out.shape == (t, 128) and out.dtype == torch.bfloat16
    assert _rel(out, moe_experts_ref(h, ids, route_w, w)) < 5e-3
    assert _rel(out, moe_experts(h, ids, route_w, paired, config=DECODE)) < 1e-3
    capped = dataclasses.replace(cfg, max_regs=80)
    assert torch.equal(moe_experts(h, ids, route_w, paired, config=capped), out)
    assert _counters_zero(h.device)


def test_splits_and_blocks_fit_k():
    """K splits, then blocks an iteration, halve until K is a multiple of 32 STEPS SPLIT."""
    assert fit_steps(2048, 4, 4) == (4, 4)
    assert fit_steps(512, 4, 8) == (4, 4)
    assert fit_steps(96, 4, 2) == (1, 1)
    assert fit_steps(64, 2, 2) == (2, 1)
    assert fit_steps(768, 4) == (4, 1)


@pytest.mark.parametrize(("t", "one_plus"), [(1, True), (3, False)])
def test_direct_path_fuses_add_rmsnorm_bit_exact(monkeypatch, t, one_plus):
    """The down kernel's add + RMSNorm equals `add_rmsnorm` after `moe_experts` bit for bit, runs once a
    token, leaves the residual it reads alone and every counter at zero."""
    w = pair_moe_weights(_weights(5, 64, 32, True, True, seed=21 + t))
    ids, route_w, g = _route(t, 3, 6, seed=22 + t)
    h = torch.randn(t, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    residual = (torch.randn(t, 64, generator=g) * 4).to(DEVICE)
    norm_w = (torch.randn(64, generator=g) * 0.5).to(torch.bfloat16).to(DEVICE)
    cfg = MoEDirectConfig((32, 4, 1, 2, 2), (16, 4, 1, 2))  # 4 row tiles of the token's row
    kept = residual.clone()
    with monkeypatch.context() as m:
        _poisoned_empty(m)
        rows = _counted_norm_rows(m)
        normed, new_res = moe_experts_add_rmsnorm(h, ids, route_w, w, residual, norm_w, 1e-6, one_plus, cfg)
    assert len(rows) == t
    moe_out = moe_experts(h, ids, route_w, w, config=cfg)
    ref_h, ref_res = add_rmsnorm(moe_out, residual, norm_w, 1e-6, one_plus)
    assert torch.equal(new_res, ref_res) and torch.equal(normed, ref_h)
    assert torch.equal(residual, kept)
    assert _counters_zero(h.device)


def test_a_few_tokens_of_paired_experts_take_the_direct_path(monkeypatch):
    """Paired experts: the direct path up to DIRECT_MAX_ENTRIES entries (8 tokens of either model),
    `moe_tc` above; the standard layout never takes it (it reads the paired words)."""
    monkeypatch.setattr(moe, "interpreting", lambda: False)
    assert moe._moe_configs(9, 257, paired=True) == direct_config()  # Qwen3.6, one token
    assert isinstance(moe._moe_configs(72, 257, paired=True), MoEDirectConfig)  # 8 tokens
    assert isinstance(moe._moe_configs(81, 257, paired=True), MoETCConfig)  # 9 tokens
    assert isinstance(moe._moe_configs(64, 128, paired=True), MoEDirectConfig)  # Qwen3-30B, 8 tokens
    assert isinstance(moe._moe_configs(80, 128, paired=True), MoETCConfig)  # 10 tokens
    assert isinstance(moe._moe_configs(9, 257), MoEDecodeConfig)  # standard layout
    w = _weights(4, 64, 32, True, False, seed=31)
    ids, route_w, g = _route(2, 2, 4, seed=32)
    h = torch.randn(2, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    with pytest.raises(ValueError, match="MoEDirectConfig: expected experts in the paired layout"):
        moe_experts(h, ids, route_w, w, config=CFGS[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 2, 4, 8])
@pytest.mark.parametrize(("e", "d", "i", "shared"), GPU_MODELS)
def test_direct_path_real_shapes_under_cuda_graph(t, e, d, i, shared):
    """The default path for up to 8 tokens of paired experts at the models' shapes against the reference
    and the decode path, then with its add + RMSNorm replayed from a CUDA graph on new inputs."""
    w = _weights(e, d, i, True, shared, seed=5 * t + e)
    paired = pair_moe_weights(w)
    g = torch.Generator().manual_seed(t)
    h = torch.randn(t, d, generator=g).to(torch.bfloat16).to(DEVICE)
    ids, route_w = moe_route(router_logits(h, w), e, 8, True, shared)
    assert isinstance(moe._moe_configs(ids.numel(), paired.w13.shape[0], paired=True), MoEDirectConfig)
    out = moe_experts(h, ids, route_w, paired)
    assert _rel(out, moe_experts_ref(h, ids, route_w, w)) < 5e-3
    assert _rel(out, moe_experts(h, ids, route_w, paired, config=moe._decode_config(ids.numel()))) < 2e-3
    residual = (torch.randn(t, d, generator=g) * 4).to(DEVICE)
    norm_w = (torch.randn(d, generator=g) * 0.1).to(torch.bfloat16).to(DEVICE)
    moe_experts_add_rmsnorm(h, ids, route_w, paired, residual, norm_w, 1e-6, True)  # compile outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused = moe_experts_add_rmsnorm(h, ids, route_w, paired, residual, norm_w, 1e-6, True)
    for _ in range(2):
        h.copy_(torch.randn(t, d, generator=g).to(torch.bfloat16))
        residual.copy_(torch.randn(t, d, generator=g) * 4)
        fused[0].fill_(float("nan"))
        graph.replay()
        moe_ref = moe_experts_ref(h, ids, route_w, w).to(torch.bfloat16)
        ref = add_rmsnorm(moe_ref, residual, norm_w, 1e-6, True)
        assert _rel(fused[1], ref[1]) < 1e-3 and _rel(fused[0], ref[0]) < 1e-2
    assert _counters_zero(h.device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("e", "d", "i", "shared"), GPU_MODELS)
def test_register_cap_changes_no_output_bit(e, d, i, shared):
    """`max_regs` (the tuner's register cap; 80 in `direct_config`) only changes register allocation: the
    direct path at one and 8 tokens and `moe_tc` at 32 give the same bits capped at 80 as uncapped."""
    w = _weights(e, d, i, True, shared, seed=e)
    paired = pair_moe_weights(w)
    g = torch.Generator().manual_seed(e)
    for t, cfg in ((1, direct_config()), (8, direct_config()), (32, moe.tc_config(16))):
        h = torch.randn(t, d, generator=g).to(torch.bfloat16).to(DEVICE)
        ids, route_w = moe_route(router_logits(h, w), e, 8, True, shared)
        free = moe_experts(h, ids, route_w, paired, config=dataclasses.replace(cfg, max_regs=0))
        capped = moe_experts(h, ids, route_w, paired, config=dataclasses.replace(cfg, max_regs=80))
        assert torch.equal(free, capped), (t, cfg)
