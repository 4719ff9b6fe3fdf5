"""Causal conv1d (prefill and rolling decode state) against its fp32 reference."""

import pytest
import torch
from batchinfer.kernels import causal_conv1d as conv
from batchinfer.kernels.causal_conv1d import (
    causal_conv1d,
    causal_conv1d_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
)
from kernel_checks import DEV, rel_err
from test_kernels_gdn import poison_empty

BF16 = torch.bfloat16


def rnd(*shape, scale=1.0, dtype=BF16):
    return (torch.randn(*shape) * scale).to(dtype).to(DEV)


@pytest.mark.parametrize("C,K", [(80, 4), (64, 2), (384, 4)])  # 384: the demo model's q|k|v width
def test_causal_conv1d_prefill(monkeypatch, C, K):
    poison_empty(monkeypatch)
    lens = [1, 2, 21]
    cu = torch.tensor([0, 1, 3, 24], dtype=torch.int32, device=DEV)
    x = rnd(24, 2 * C)[:, :C]  # a strided view, like q|k|v out of a wider projection
    w = rnd(C, K, scale=0.5)
    state = torch.full((5, K - 1, C), float("nan"), dtype=BF16, device=DEV)
    slots = torch.tensor([3, 0, 4], device=DEV)
    out = causal_conv1d(x, w, cu, max(lens), state, slots)
    ref, ref_state = causal_conv1d_ref(x, w, cu)
    assert rel_err(out, ref) < 1e-2
    assert torch.equal(state[slots].float().cpu(), ref_state.cpu())  # exact input copies, zeros before start
    assert torch.isnan(state[1].float()).all()  # untouched slots stay untouched


@pytest.mark.parametrize("C,K", [(80, 4), (64, 2)])
def test_later_pieces_continue_from_the_conv_state(monkeypatch, C, K):
    """Chunked prefill: a 23-token sequence as 20 + 2 + 1 tokens (pieces shorter than K - 1 keep part of the
    old state), beside fresh sequences in later passes whose stale slot state must not leak in; outputs
    and final states as one whole prefill gives."""
    poison_empty(monkeypatch)
    x = rnd(30, C)
    w = rnd(C, K, scale=0.5)
    ref, ref_state = causal_conv1d_ref(x, w, torch.tensor([0, 23, 30], dtype=torch.int32))
    state = torch.full((3, K - 1, C), float("nan"), dtype=BF16, device=DEV)  # stale: NaN
    outs = []
    for rows, cu, slots, past in [
        (range(0, 20), [0, 20], [0], None),
        (range(20, 22), [0, 2], [0], [20]),
        ([22, *range(23, 30)], [0, 1, 8], [0, 2], [22, 0]),
    ]:
        cu = torch.tensor(cu, dtype=torch.int32, device=DEV)
        past = None if past is None else torch.tensor(past, dtype=torch.int32, device=DEV)
        slots = torch.tensor(slots, device=DEV)
        outs.append(causal_conv1d(x[list(rows)], w, cu, int((cu[1:] - cu[:-1]).max()), state, slots, past))
    assert rel_err(torch.cat(outs), ref) < 1e-2
    assert torch.equal(state[[0, 2]].float().cpu(), ref_state.cpu())
    assert torch.isnan(state[1].float()).all()


def test_causal_conv1d_update_matches_prefill():
    """Decoding token by token from a prefilled state gives the same outputs as one long prefill."""
    C, K, L, P = 48, 4, 9, 5
    x = rnd(L, C)
    w = rnd(C, K, scale=0.5)
    state = rnd(2, K - 1, C)
    slot = torch.tensor([1], device=DEV)
    causal_conv1d(x[:P], w, torch.tensor([0, P], dtype=torch.int32, device=DEV), P, state, slot)
    full, _ = causal_conv1d_ref(x, w, torch.tensor([0, L], dtype=torch.int32))
    for t in range(P, L):
        ref_out, ref_state = causal_conv1d_update_ref(x[t : t + 1], w, state, slot)
        out = causal_conv1d_update(x[t : t + 1], w, state, slot)
        assert rel_err(out, ref_out) < 1e-2 and rel_err(out, full[t : t + 1]) < 1e-2
        assert torch.equal(state.float().cpu(), ref_state.float().cpu())


def test_causal_conv1d_update_padded_row():
    C, K = 32, 4
    state = rnd(1, K - 1, C)
    before = state.clone()
    out = causal_conv1d_update(rnd(2, C), rnd(C, K), state, torch.tensor([-1, -1], device=DEV))
    assert torch.equal(out.float().cpu(), torch.zeros(2, C)) and torch.equal(state, before)


def test_production_tiles_demo_width(monkeypatch):
    """The H200 tiles (32 x 256 prefill, 1024-wide decode) across the demo model's C = 384."""
    monkeypatch.setattr(conv, "_interpreted", lambda: False)
    poison_empty(monkeypatch)
    C, K = 384, 4
    cu = torch.tensor([0, 2, 40], dtype=torch.int32, device=DEV)
    x, w = rnd(41, C), rnd(C, K, scale=0.5)
    state = torch.full((3, K - 1, C), float("nan"), dtype=BF16, device=DEV)
    slots = torch.tensor([2, 0], device=DEV)
    out = causal_conv1d(x[:40], w, cu, 38, state, slots)
    ref, ref_state = causal_conv1d_ref(x[:40], w, cu)
    assert rel_err(out, ref) < 1e-2 and torch.equal(state[slots].float().cpu(), ref_state.cpu())
    ref_out, ref_state = causal_conv1d_update_ref(x[40:], w, state, slots[:1])
    out = causal_conv1d_update(x[40:], w, state, slots[:1])
    assert rel_err(out, ref_out) < 1e-2 and torch.equal(state[slots].cpu(), ref_state[slots].cpu())
    assert torch.isnan(state[1].float()).all()  # untouched slots stay untouched


@pytest.mark.gpu
def test_real_shapes_gpu():
    C, K, B = 8192, 4, 64
    x, w = rnd(B, C), rnd(C, K, scale=0.5)
    state = rnd(B + 5, K - 1, C)
    slots = torch.randperm(B + 5, device=DEV)[:B]
    ref_out, ref_state = causal_conv1d_update_ref(x, w, state, slots)
    out = causal_conv1d_update(x, w, state, slots)
    assert rel_err(out, ref_out) < 1e-2 and torch.equal(state.float(), ref_state.float())
