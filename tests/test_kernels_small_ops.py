"""small_ops kernels (norms, SiLU x mul, embedding) against their fp32 references."""

import pytest
import torch
from batchinfer.kernels.small_ops import (
    add_rmsnorm,
    add_rmsnorm_ref,
    embedding,
    embedding_ref,
    rmsnorm,
    silu_mul,
    silu_mul_ref,
    sum_slots,
)
from kernel_checks import DEV, rel_err
from test_kernels_gdn import poison_empty


def poison(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-1)


@pytest.mark.parametrize("one_plus", [True, False])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("T,D", [(3, 96), (5, 256), (4, 192)])  # 192: the demo model's hidden size
def test_add_rmsnorm(monkeypatch, T, D, one_plus, with_residual):
    poison_empty(monkeypatch)
    g = torch.Generator().manual_seed(T * D)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16).to(DEV)
    res = torch.randn(T, D, generator=g).to(torch.bfloat16).to(DEV) if with_residual else None
    w = (torch.randn(D, generator=g) * 0.5).to(torch.bfloat16).to(DEV)
    out, r = add_rmsnorm(x, res, w, 1e-6, one_plus)
    ref, r_ref = add_rmsnorm_ref(x, res, w, 1e-6, one_plus)
    assert rel_err(out, ref) < 1e-2
    # bf16 sum: exact up to one rounding step (the interpreter truncates where the GPU rounds to nearest)
    torch.testing.assert_close(r.float().cpu(), r_ref.float().cpu(), rtol=8e-3, atol=0)
    assert rel_err(rmsnorm(r, w, 1e-6, one_plus), ref) < 1e-2


def test_add_rmsnorm_keeps_an_fp32_residual(monkeypatch):
    """The fp32 residual stream: the first layer widens x exactly, later sums are fp32 (no bf16 rounding)."""
    poison_empty(monkeypatch)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 96, generator=g).to(torch.bfloat16).to(DEV)
    h = (torch.randn(4, 96, generator=g) * 1e-3).to(torch.bfloat16).to(DEV)  # small, as a branch output
    w = (torch.randn(96, generator=g) * 0.5).to(torch.bfloat16).to(DEV)
    out0, r0 = add_rmsnorm(x, None, w, 1e-6, True, residual_dtype=torch.float32)
    assert r0.dtype == torch.float32 and torch.equal(r0.cpu(), x.float().cpu())
    assert rel_err(out0, add_rmsnorm_ref(x, None, w, 1e-6, True)[0]) < 1e-2
    out1, r1 = add_rmsnorm(h, r0, w, 1e-6, True)
    assert r1.dtype == torch.float32
    torch.testing.assert_close(r1.cpu(), (h.float() + r0).cpu(), rtol=1e-6, atol=0)
    assert not torch.equal(r1.cpu(), (h.float() + r0).to(torch.bfloat16).float().cpu())  # would be in bf16
    ref, r_ref = add_rmsnorm_ref(h, r0, w, 1e-6, True)
    assert r_ref.dtype == torch.float32 and rel_err(out1, ref) < 1e-2
    with pytest.raises(ValueError, match="residual: expected dtype"):
        add_rmsnorm(h, r0.half(), w, 1e-6, True)


def test_add_rmsnorm_one_plus_differs():
    """The (1+w) and w forms must not collapse into one another."""
    x = torch.randn(2, 64).to(DEV)
    w = torch.full((64,), 0.5, device=DEV)
    assert torch.allclose(rmsnorm(x, w, 1e-6, True).cpu(), 3 * rmsnorm(x, w, 1e-6, False).cpu(), rtol=1e-5)


def test_add_rmsnorm_rejects_bad_weight():
    with pytest.raises(ValueError, match="weight: expected shape"):
        rmsnorm(torch.randn(2, 64, device=DEV), torch.ones(32, device=DEV), 1e-6, False)


@pytest.mark.parametrize("T,I", [(3, 40), (4, 1500), (2, 192)])
def test_silu_mul(monkeypatch, T, I):
    poison_empty(monkeypatch)
    x = torch.randn(T, 2 * I).to(torch.bfloat16).to(DEV)
    assert rel_err(silu_mul(x), silu_mul_ref(x)) < 1e-2


def test_embedding():
    table = torch.randn(50, 72).to(torch.bfloat16).to(DEV)
    ids = torch.tensor([7, 0, 49, 7, 13], device=DEV)
    assert torch.equal(embedding(ids, table), embedding_ref(ids, table))


@pytest.mark.parametrize("T,A,D", [(3, 9, 96), (2, 8, 100), (1, 1, 2048), (4, 3, 5000)])
def test_sum_slots(monkeypatch, T, A, D):
    """Each token's A rows summed in fp32 and rounded once: within one bf16 rounding of the fp32 sum, which
    needs A_PAD > A (masked slots), a D that is not a block multiple and D wider than one block."""
    poison_empty(monkeypatch)
    y = torch.randn(T * A, D).to(torch.bfloat16).to(DEV)
    want = y.view(T, A, D).float().sum(1)
    got = sum_slots(y, A)
    assert got.dtype == torch.bfloat16 and got.shape == (T, D) and not got.isnan().any()
    assert torch.all((got.float() - want).abs() <= want.abs() * 2**-8 + 1e-6)
    if A > 1:
        with pytest.raises(ValueError, match=f"multiple of {A} rows"):
            sum_slots(y[1:], A)


@pytest.mark.gpu
def test_real_shapes_gpu():
    x = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    out, res = add_rmsnorm(x, r, w, 1e-6, True)
    assert rel_err(out, add_rmsnorm_ref(x, r, w, 1e-6, True)[0]) < 1e-2
    gu = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    assert rel_err(silu_mul(gu), silu_mul_ref(gu)) < 1e-2
    y = torch.randn(32 * 9, 2048, device="cuda", dtype=torch.bfloat16)  # conc32's experts, Qwen3.6
    assert rel_err(sum_slots(y, 9), y.view(32, 9, 2048).float().sum(1)) < 1e-2
    table = torch.randn(248320, 2048, device="cuda", dtype=torch.bfloat16)  # Qwen3.6's embedding table
    ids = torch.randint(0, 248320, (4096,), device="cuda", dtype=torch.int32)
    ids[:2] = torch.tensor([0, 248319])
    assert torch.equal(embedding(ids, table), embedding_ref(ids, table))
