"""Gated DeltaNet kernels against their fp32 references (tiny shapes in the interpreter, real ones on GPU)."""

import pytest
import torch
from batchinfer.kernels import gdn
from batchinfer.kernels.causal_conv1d import causal_conv1d, causal_conv1d_ref
from batchinfer.kernels.gdn import (
    gated_delta_rule,
    gated_delta_rule_ref,
    gated_rmsnorm,
    gated_rmsnorm_ref,
)
from kernel_checks import DEV, rel_err

BF16 = torch.bfloat16


def rnd(*shape, scale=1.0, dtype=BF16):
    return (torch.randn(*shape) * scale).to(dtype).to(DEV)


def poison_empty(monkeypatch):
    """Launchers allocate their outputs with torch.empty(_like): make those start as NaN, so that an element
    the kernel never writes fails `rel_err` instead of passing on whatever the allocator left there."""
    for name in ("empty", "empty_like"):
        alloc = getattr(torch, name)

        def nan_alloc(*args, _alloc=alloc, **kwargs):
            t = _alloc(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t

        monkeypatch.setattr(torch, name, nan_alloc)


def _gdn_inputs(T, Hk, Hv, Dk, Dv):
    """q, k, v as views of one conv output [T, q | k | v], like the model produces them."""
    mixed = rnd(T, 2 * Hk * Dk + Hv * Dv)
    q = mixed[:, : Hk * Dk].view(T, Hk, Dk)
    k = mixed[:, Hk * Dk : 2 * Hk * Dk].view(T, Hk, Dk)
    v = mixed[:, 2 * Hk * Dk :].view(T, Hv, Dv)
    ab = rnd(T, 2 * Hv)
    a, b = ab[:, :Hv], ab[:, Hv:]
    A_log = (torch.rand(Hv) * 2 - 1).to(DEV)
    dt_bias = rnd(Hv, dtype=torch.float32)
    return q, k, v, a, b, A_log, dt_bias


@pytest.mark.parametrize("Hk,Hv,D", [(2, 4, 32), (1, 1, 16), (2, 4, 48)])  # 48: the demo model's heads
def test_gated_delta_rule_prefill(monkeypatch, Hk, Hv, D):
    poison_empty(monkeypatch)
    cu = torch.tensor([0, 1, 13, 20], dtype=torch.int32, device=DEV)
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(20, Hk, Hv, D, D)
    state = torch.full((4, Hv, D, D), float("nan"), device=DEV)
    slots = torch.tensor([2, 0, 3], device=DEV)
    out = gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, slots, cu_seqlens=cu)
    ref, ref_final = gated_delta_rule_ref(q, k, v, a, b, A_log, dt_bias, cu)
    assert rel_err(out, ref) < 1e-2
    assert rel_err(state[slots], ref_final) < 1e-4  # fp32 state, fp32 math
    assert torch.isnan(state[1]).all()


@pytest.mark.parametrize("D", [32, 48])
@pytest.mark.parametrize("state_dtype,tol", [(torch.float32, 1e-4), (BF16, 1e-2), (torch.float16, 2e-3)])
def test_gated_delta_rule_decode(monkeypatch, state_dtype, tol, D):
    poison_empty(monkeypatch)
    Hk, Hv, B = 2, 4, 3
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(B, Hk, Hv, D, D)
    state = rnd(5, Hv, D, D, scale=0.3, dtype=state_dtype)
    before = state.clone()
    slots = torch.tensor([4, 1, 2], device=DEV)
    init = state[slots].clone()
    out = gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, slots)
    ref, ref_final = gated_delta_rule_ref(
        q, k, v, a, b, A_log, dt_bias, torch.arange(B + 1, dtype=torch.int32), initial_state=init
    )
    assert rel_err(out, ref) < 1e-2
    assert rel_err(state[slots], ref_final) < tol
    others = torch.tensor([0, 3], device=DEV)
    assert torch.equal(state[others], before[others])  # no write past a slot's [Hv, D, D] block


def test_fp16_state_saturates_instead_of_overflowing(monkeypatch):
    """An fp16 state whose update passes 65504 is stored clipped to +-65504, never inf (which would turn
    every later token of the sequence to NaN); entries in range are stored as the fp32 math gives them."""
    poison_empty(monkeypatch)
    Hk, Hv, D = 1, 2, 16
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(1, Hk, Hv, D, D)
    v = v * 4e5  # delta ~ 1e5 * beta, added onto a state near the fp16 limit
    A_log = torch.full((Hv,), -20.0, device=DEV)  # exp(g) = 1: no decay
    state = (torch.rand(1, Hv, D, D) * 6e4).to(torch.float16).to(DEV)
    init = state.clone()
    gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, torch.tensor([0], device=DEV))
    _, ref_final = gated_delta_rule_ref(
        q, k, v, a, b, A_log, dt_bias, torch.tensor([0, 1], dtype=torch.int32), initial_state=init
    )
    assert (ref_final.abs() > 65504).any()  # the case this test is for
    assert torch.isfinite(state).all()
    assert rel_err(state, ref_final.clamp(-65504, 65504)) < 2e-3
    # a NaN in the state is not clipped into a finite value
    state[0, 0, 0, 0] = float("nan")
    gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, torch.tensor([0], device=DEV))
    assert torch.isnan(state[0, 0]).any() and not torch.isnan(state[0, 1]).any()


@pytest.mark.parametrize("D", [16, 48])
def test_gated_delta_rule_padded_row_leaves_state(monkeypatch, D):
    poison_empty(monkeypatch)
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(2, 1, 2, D, D)
    state = rnd(1, 2, D, D, dtype=torch.float32)
    before = state.clone()
    out = gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, torch.tensor([0, -1], device=DEV))
    assert torch.equal(out[1].float().cpu(), torch.zeros(2, D)) and not torch.equal(state, before)
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("D", [64, 48])
def test_gated_rmsnorm(monkeypatch, D):
    poison_empty(monkeypatch)
    x = rnd(5, 4, D)
    z = rnd(5, 8, D)[:, 4:]  # z may be a view, read in place (the engine's slice of the in-projection)
    w = rnd(D, scale=0.5)
    ref = gated_rmsnorm_ref(x, z, w, 1e-6)
    assert rel_err(gated_rmsnorm(x, z, w, 1e-6), ref) < 1e-2
    assert torch.equal(gated_rmsnorm(x, z, w, 1e-6), gated_rmsnorm(x, z.contiguous(), w, 1e-6))
    flat = gated_rmsnorm(x.reshape(20, D), z.reshape(20, D), w, 1e-6)  # 2-D rows
    assert flat.shape == (20, D) and torch.equal(flat.view(5, 4, D), gated_rmsnorm(x, z, w, 1e-6))
    assert torch.equal(gated_rmsnorm(x[0, 0], z[0, 0], w, 1e-6), flat[0])  # one row
    with pytest.raises(ValueError, match="z/weight"):
        gated_rmsnorm(x, z[:, :2], w, 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("Hk,Hv,D", [(16, 32, 128), (2, 4, 48)])  # Qwen3.5, the demo model (padded heads)
def test_real_shapes_gpu(monkeypatch, Hk, Hv, D):
    """conv_dim 2 Hk D + Hv D (8192 for Qwen3.5), K 4, Dk = Dv = D; prefill then decode steps."""
    poison_empty(monkeypatch)
    C, K = 2 * Hk * D + Hv * D, 4
    lens = [700, 1, 300]
    cu = torch.tensor([0, 700, 701, 1001], dtype=torch.int32, device=DEV)
    T = 1001
    x = rnd(T, C)
    w = rnd(C, K, scale=0.5)
    conv_state = torch.empty(8, K - 1, C, dtype=BF16, device=DEV)
    slots = torch.tensor([5, 0, 7], device=DEV)
    mixed = causal_conv1d(x, w, cu, max(lens), conv_state, slots)
    ref_mixed, ref_cs = causal_conv1d_ref(x, w, cu)
    assert rel_err(mixed, ref_mixed) < 1e-2 and torch.equal(conv_state[slots].float(), ref_cs)
    q = mixed[:, : Hk * D].view(T, Hk, D)
    k = mixed[:, Hk * D : 2 * Hk * D].view(T, Hk, D)
    v = mixed[:, 2 * Hk * D :].view(T, Hv, D)
    _, _, _, a, b, A_log, dt_bias = _gdn_inputs(T, 1, Hv, 1, 1)
    state = torch.empty(8, Hv, D, D, device=DEV)
    out = gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, slots, cu_seqlens=cu)
    ref, ref_final = gated_delta_rule_ref(q, k, v, a, b, A_log, dt_bias, cu)
    assert rel_err(out, ref) < 1e-2 and rel_err(state[slots], ref_final) < 1e-3
    B = 64
    qd, kd, vd, ad, bd, _, _ = _gdn_inputs(B, Hk, Hv, D, D)
    dstate = torch.randn(B + 4, Hv, D, D, device=DEV) * 0.1
    dslots = torch.randperm(B + 4, device=DEV)[:B]
    init = dstate[dslots].clone()
    out = gated_delta_rule(qd, kd, vd, ad, bd, A_log, dt_bias, dstate, dslots)
    ref, ref_final = gated_delta_rule_ref(
        qd, kd, vd, ad, bd, A_log, dt_bias, torch.arange(B + 1, dtype=torch.int32), initial_state=init
    )
    assert rel_err(out, ref) < 1e-2 and rel_err(dstate[dslots], ref_final) < 1e-4
    z = rnd(B, Hv, D)
    nw = rnd(D)
    assert rel_err(gated_rmsnorm(out, z, nw, 1e-6), gated_rmsnorm_ref(out, z, nw, 1e-6)) < 1e-2


@pytest.mark.parametrize("D", [64, 48])  # 48: padded to 64-wide k rows, 32-wide v tiles cross Dv
def test_production_tiles(monkeypatch, D):
    """The H200 v-tiles (not the small interpreter ones): decode and the prefill recurrence."""
    monkeypatch.setattr(gdn, "_interpreted", lambda: False)
    poison_empty(monkeypatch)
    Hk, Hv = 1, 2
    cu = torch.tensor([0, 9, 30], dtype=torch.int32, device=DEV)
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(30, Hk, Hv, D, D)
    state = torch.empty(2, Hv, D, D, device=DEV)
    slots = torch.tensor([1, 0], device=DEV)
    out = gated_delta_rule(
        q, k, v, a, b, A_log, dt_bias, state, slots, cu_seqlens=cu, config=gdn._delta_rule_configs(False)
    )
    ref, ref_final = gated_delta_rule_ref(q, k, v, a, b, A_log, dt_bias, cu)
    assert rel_err(out, ref) < 1e-2 and rel_err(state[slots], ref_final) < 1e-4
    init = state.clone()
    out = gated_delta_rule(
        q[:2], k[:2], v[:2], a[:2], b[:2], A_log, dt_bias, state, slots, config=gdn._delta_rule_configs(True)
    )
    ref, ref_final = gated_delta_rule_ref(
        q[:2],
        k[:2],
        v[:2],
        a[:2],
        b[:2],
        A_log,
        dt_bias,
        torch.arange(3, dtype=torch.int32),
        initial_state=init[slots],
    )
    assert rel_err(out, ref) < 1e-2 and rel_err(state[slots], ref_final) < 1e-4


@pytest.mark.parametrize("D", [64, 48])
def test_production_tiles_bf16_state(monkeypatch, D):
    monkeypatch.setattr(gdn, "_interpreted", lambda: False)
    poison_empty(monkeypatch)
    assert gdn._delta_rule_configs(True, 2)["BLOCK_V"] == 64  # 128-byte state rows
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(2, 1, 2, D, D)
    state = rnd(2, 2, D, D, scale=0.3)
    init = state.clone()
    slots = torch.tensor([1, 0], device=DEV)
    out = gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, slots)
    ref, ref_final = gated_delta_rule_ref(
        q, k, v, a, b, A_log, dt_bias, torch.arange(3, dtype=torch.int32), initial_state=init[slots]
    )
    assert rel_err(out, ref) < 1e-2 and rel_err(state[slots], ref_final) < 1e-2


@pytest.mark.parametrize("D", [64, 48])  # 48: one 64-wide v tile, 16 lanes masked
def test_production_decode_tiles_from_32_rows(monkeypatch, D):
    """From 32 decode rows the production tile is 64 values wide (fp32 state): outputs and written
    states match the reference; the slot left out keeps its state."""
    monkeypatch.setattr(gdn, "_interpreted", lambda: False)
    poison_empty(monkeypatch)
    B, Hk, Hv = 32, 1, 2
    assert gdn._delta_rule_configs(True, 4, B)["BLOCK_V"] == 64
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(B, Hk, Hv, D, D)
    state = rnd(B + 1, Hv, D, D, scale=0.3, dtype=torch.float32)
    init = state.clone()
    slots = torch.randperm(B + 1, device=DEV)[:B]
    out = gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, slots)
    ref, ref_final = gated_delta_rule_ref(  # each row a one-token sequence from its slot's state
        q, k, v, a, b, A_log, dt_bias, torch.arange(B + 1, dtype=torch.int32), initial_state=init[slots]
    )
    assert rel_err(out, ref) < 1e-2 and rel_err(state[slots], ref_final) < 1e-4
    left = ({*range(B + 1)} - {*slots.tolist()}).pop()
    assert torch.equal(state[left], init[left])
