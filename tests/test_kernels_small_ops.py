"""small_ops kernels against their fp32 references (interpreter on CPU, real shapes on the GPU)."""

import pytest
import torch
from batchinfer.kernels.small_ops import (
    add_rmsnorm,
    add_rmsnorm_ref,
    embedding,
    embedding_ref,
    rmsnorm,
    sample,
    sample_probs_ref,
    sample_ref,
    silu_mul,
    silu_mul_ref,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float().cpu(), ref.float().cpu()
    assert not torch.isnan(out).any(), "output has NaN (unwritten or broken)"
    return float((out - ref).norm() / ref.norm())


def poison(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-1)


@pytest.mark.parametrize("one_plus", [True, False])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("T,D", [(3, 96), (5, 256)])
def test_add_rmsnorm(T, D, one_plus, with_residual):
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


def test_add_rmsnorm_one_plus_differs():
    """The (1+w) and w forms must not collapse into one another."""
    x = torch.randn(2, 64).to(DEV)
    w = torch.full((64,), 0.5, device=DEV)
    assert torch.allclose(rmsnorm(x, w, 1e-6, True).cpu(), 3 * rmsnorm(x, w, 1e-6, False).cpu(), rtol=1e-5)


def test_add_rmsnorm_rejects_bad_weight():
    with pytest.raises(ValueError, match="weight: expected shape"):
        rmsnorm(torch.randn(2, 64, device=DEV), torch.ones(32, device=DEV), 1e-6, False)


@pytest.mark.parametrize("T,I", [(3, 40), (4, 1500)])
def test_silu_mul(T, I):
    x = torch.randn(T, 2 * I).to(torch.bfloat16).to(DEV)
    assert rel_err(silu_mul(x), silu_mul_ref(x)) < 1e-2


def test_embedding():
    table = torch.randn(50, 72).to(torch.bfloat16).to(DEV)
    ids = torch.tensor([7, 0, 49, 7, 13], device=DEV)
    assert torch.equal(embedding(ids, table), embedding_ref(ids, table))


def _sampling_inputs(B, V, temp, k, p, seed0=0):
    return (
        torch.full((B,), temp, device=DEV),
        torch.full((B,), k, dtype=torch.int32, device=DEV),
        torch.full((B,), p, device=DEV),
        torch.arange(seed0, seed0 + B, dtype=torch.int64, device=DEV),
        torch.zeros(B, dtype=torch.int64, device=DEV),
    )


def test_sample_greedy_is_argmax():
    logits = torch.randn(4, 3000, device=DEV)
    tok = sample(logits, *_sampling_inputs(4, 3000, 0.0, 0, 1.0))
    assert torch.equal(tok.cpu(), logits.argmax(-1).cpu())


@pytest.mark.parametrize("k,p", [(5, 1.0), (0, 0.6), (20, 0.8)])
def test_sample_stays_in_allowed_set_and_is_reproducible(k, p):
    B, V = 16, 700
    logits = (torch.randn(B, V) * 3).to(DEV)
    params = _sampling_inputs(B, V, 0.8, k, p)
    tok = sample(logits, *params)
    probs = sample_probs_ref(logits.cpu(), *[t.cpu() for t in params[:3]])
    assert (probs[torch.arange(B), tok.cpu()] > 0).all()
    assert torch.equal(tok, sample(logits, *params))  # same (seed, step) -> same token
    allowed = (probs > 0).sum(-1)
    if k and p == 1:
        assert (allowed == k).all()  # random logits have no ties
    if p < 1:
        base = sample_probs_ref(logits.cpu(), params[0].cpu(), params[1].cpu(), torch.ones(B))
        mass = base.sort(-1, descending=True).values.cumsum(-1)
        assert (mass.gather(1, (allowed - 1)[:, None]) >= p - 1e-6).all()  # the kept set reaches p
        without_last = mass.gather(1, (allowed - 2).clamp(min=0)[:, None])[:, 0]
        assert (allowed == 1).logical_or(without_last < p).all()  # and is the smallest that does


def test_sample_distribution_matches_reference():
    """Many rows with one logit vector and distinct seeds: the token histogram follows the reference.

    Temperature only (the top-k / top-p sets are checked above; their bisection is slow in the interpreter).
    """
    B, V = 2048, 12
    logits = torch.linspace(-1.5, 1.5, V).repeat(B, 1).to(DEV)
    params = _sampling_inputs(B, V, 0.7, 0, 1.0)
    tok = sample(logits, *params).cpu()
    probs = sample_probs_ref(logits[:1].cpu(), *[t[:1].cpu() for t in params[:3]])[0]
    freq = torch.bincount(tok, minlength=V).float() / B
    assert (freq - probs).abs().max() < 0.035  # ~3.5 sigma of a binomial at B=2048
    ref_tok = sample_ref(logits.cpu(), *[t.cpu() for t in params])
    ref_freq = torch.bincount(ref_tok, minlength=V).float() / B
    assert (ref_freq - probs).abs().max() < 0.035


def test_sample_cold_temperature_is_argmax_across_chunks():
    """Per-chunk Gumbel winners combine into the row's winner: at T -> 0 that is the argmax."""
    logits = torch.randn(3, 5000, device=DEV) * 2
    tok = sample(logits, *_sampling_inputs(3, 5000, 1e-4, 0, 1.0))
    assert torch.equal(tok.cpu(), logits.argmax(-1).cpu())


def test_sample_steps_change_the_draw():
    B, V = 64, 50
    logits = torch.zeros(B, V, device=DEV) + torch.randn(V, device=DEV) * 0.1
    temp, k, p, seeds, steps = _sampling_inputs(B, V, 1.0, 0, 1.0)
    a = sample(logits, temp, k, p, seeds, steps)
    b = sample(logits, temp, k, p, seeds, steps + 1)
    assert (a != b).float().mean() > 0.5


@pytest.mark.gpu
def test_real_shapes_gpu():
    x = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    out, res = add_rmsnorm(x, r, w, 1e-6, True)
    assert rel_err(out, add_rmsnorm_ref(x, r, w, 1e-6, True)[0]) < 1e-2
    gu = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    assert rel_err(silu_mul(gu), silu_mul_ref(gu)) < 1e-2
    logits = torch.randn(32, 248320, device="cuda")
    params = _sampling_inputs(32, 248320, 0.8, 50, 0.9)
    tok = sample(logits, *params)
    probs = sample_probs_ref(logits.cpu(), *[t.cpu() for t in params[:3]])
    assert (probs[torch.arange(32), tok.cpu()] > 0).all()
    tok0 = sample(logits, *_sampling_inputs(32, 248320, 0.0, 0, 1.0))
    assert torch.equal(tok0, logits.argmax(-1))
