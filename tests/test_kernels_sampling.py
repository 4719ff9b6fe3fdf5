"""The device sampler against its reference distribution (interpreter on CPU, real vocab on the GPU)."""

import pytest
import torch
from batchinfer.kernels.sampling import sample, sample_probs_ref, sample_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


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
    tok = sample(logits, *params, filtered=False).cpu()
    assert torch.equal(tok[:8], sample(logits[:8], *[t[:8] for t in params]).cpu())  # search: no effect
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
@pytest.mark.parametrize("V", [248320, 151936])
def test_real_vocab_gpu(V):
    logits = torch.randn(32, V, device="cuda") * 3
    params = _sampling_inputs(32, V, 0.8, 50, 0.9)
    tok = sample(logits, *params)
    probs = sample_probs_ref(logits.cpu(), *[t.cpu() for t in params[:3]])
    assert (probs[torch.arange(32), tok.cpu()] > 0).all()
    assert torch.equal(tok, sample(logits, *params))
    params = _sampling_inputs(32, V, 0.8, 0, 0.95)
    probs = sample_probs_ref(logits.cpu(), *[t.cpu() for t in params[:3]])
    assert (probs[torch.arange(32), sample(logits, *params).cpu()] > 0).all()
    tok0 = sample(logits, *_sampling_inputs(32, V, 0.0, 0, 1.0), filtered=False)
    assert torch.equal(tok0, logits.argmax(-1))
