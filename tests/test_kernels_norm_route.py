"""`norm_route` (one decode row's add_rmsnorm + router GEMV + moe_route in one launch) against the three
launches it replaces: bit for bit at small shapes under the interpreter, within a bf16 step at real shapes on
the GPU (cuBLAS sums the router dots in another order)."""

import pytest
import torch
from batchinfer.kernels.moe import moe_route, router_logits
from batchinfer.kernels.moe_weights import stack_moe_weights
from batchinfer.kernels.norm_route import NormRouteConfig, norm_route, norm_route_ref
from batchinfer.kernels.nvfp4_gemm import split_k_locks
from batchinfer.kernels.small_ops import add_rmsnorm
from kernel_checks import DEV, rel_err
from test_kernels_gdn import poison_empty

EPS = 1e-6


def _weights(e: int, d: int, shared: bool, g: torch.Generator, scale: float = 1.0):
    """A stack whose router is random (norm_route reads nothing else; one small zero expert stands in)."""
    router = (torch.randn(e, d, generator=g) * scale).to(torch.bfloat16).to(DEV)
    zero = torch.zeros(16, d, dtype=torch.bfloat16, device=DEV)
    experts = [(zero, zero, zero.t())] * e
    if not shared:
        return stack_moe_weights(router, experts)
    gate = (torch.randn(1, d, generator=g) * scale).to(torch.bfloat16).to(DEV)
    return stack_moe_weights(router, experts, experts[0], gate)


def _inputs(d: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x bf16 (the mixer's output), the fp32 residual stream, a bf16 norm weight."""
    x = torch.randn(1, d, generator=g).to(torch.bfloat16).to(DEV)
    residual = (torch.randn(1, d, generator=g) * 3).to(DEV)
    norm_w = (torch.randn(d, generator=g) * 0.5).to(torch.bfloat16).to(DEV)
    return x, residual, norm_w


def _unfused(x, residual, norm_w, one_plus, w, top_k, renorm):
    """The bits norm_route must reproduce under the interpreter: add_rmsnorm, then the router dots of the bf16
    h in fp32 rounded to bf16 (cuBLAS's output), then moe_route."""
    h, r = add_rmsnorm(x, residual, norm_w, EPS, one_plus)
    logits = (h.float() @ w.router.float().t()).to(torch.bfloat16)
    return (h, r, *moe_route(logits, w.num_experts, top_k, renorm, w.has_shared))


def _counter(device: torch.device) -> int:
    """The counter norm_route used (`split_k_locks` keys its buffers by the tensors' device: cuda:0, not
    cuda)."""
    return int(split_k_locks(device, 1)[0])


# (D, E, shared, top_k, config): rows dividing E' and not (E' = 9, 25, 17, 65: a last program with fewer
# rows), one row a program (64 programs), the interpreter's default (None), warps 1 to 4.
CASES = [
    (64, 8, True, 2, NormRouteConfig(rows=2, warps=1)),
    (96, 8, False, 4, NormRouteConfig(rows=4, warps=1)),
    (192, 24, True, 4, NormRouteConfig(rows=4, warps=2)),
    (128, 16, True, 16, NormRouteConfig(rows=8, warps=4)),
    (256, 64, False, 8, NormRouteConfig(rows=1, warps=1)),
    (256, 64, True, 8, None),
]


@pytest.mark.parametrize(("d", "e", "shared", "top_k", "cfg"), CASES)
@pytest.mark.parametrize(("one_plus", "renorm"), [(True, True), (False, False)])
def test_matches_the_three_launches_bit_for_bit(monkeypatch, d, e, shared, top_k, cfg, one_plus, renorm):
    poison_empty(monkeypatch)  # outputs and the logits workspace start as NaN: an unwritten element fails
    g = torch.Generator().manual_seed(d + e + shared)
    w = _weights(e, d, shared, g)
    x, residual, norm_w = _inputs(d, g)
    h, r, ids, route_w = norm_route(x, residual, norm_w, EPS, one_plus, w, top_k, renorm, config=cfg)
    h0, r0, ids0, route_w0 = _unfused(x, residual, norm_w, one_plus, w, top_k, renorm)
    assert h.dtype == torch.bfloat16 and r.dtype == torch.float32 and h.shape == r.shape == (1, d)
    assert torch.equal(r, r0) and torch.equal(h, h0)
    assert ids.dtype == torch.int32 and ids.shape == route_w.shape == (1, top_k + shared)
    assert torch.equal(ids, ids0) and torch.equal(route_w, route_w0)
    assert _counter(x.device) == 0  # the last program reset it for the next launch (and graph replays)


@pytest.mark.parametrize("shared", [True, False])
def test_matches_the_fp32_reference(shared):
    g = torch.Generator().manual_seed(7)
    w = _weights(24, 160, shared, g)
    x, residual, norm_w = _inputs(160, g)
    h, r, ids, route_w = norm_route(x, residual, norm_w, EPS, True, w, 4, True)
    h_ref, r_ref, ids_ref, route_w_ref = norm_route_ref(x, residual, norm_w, EPS, True, w, 4, True)
    assert rel_err(h, h_ref) < 1e-2
    torch.testing.assert_close(r, r_ref, rtol=1e-6, atol=0)
    assert torch.equal(ids, ids_ref)  # random fp32-scale logits: no ties in the top 4
    torch.testing.assert_close(route_w, route_w_ref, rtol=1e-5, atol=1e-6)
    assert not shared or (ids[0, -1] == 24 and 0 < route_w[0, -1] < 1)  # the shared expert, its sigmoid gate


def test_two_calls_in_a_row_reuse_the_counter(monkeypatch):
    """A second launch finds the counter at 0 again: had the last program not reset it, no program of the
    second launch would count itself last and its weights would stay NaN."""
    poison_empty(monkeypatch)
    g = torch.Generator().manual_seed(3)
    w = _weights(8, 64, True, g)
    cfg = NormRouteConfig(rows=2, warps=1)
    for _ in range(2):
        x, residual, norm_w = _inputs(64, g)
        out = norm_route(x, residual, norm_w, EPS, True, w, 2, True, config=cfg)
        for got, want in zip(out, _unfused(x, residual, norm_w, True, w, 2, True), strict=True):
            assert torch.equal(got, want)
        assert _counter(x.device) == 0


@pytest.mark.parametrize("renorm", [True, False])
def test_ties_go_to_the_lower_expert(renorm):
    """Experts 3, 5 and 9 have the same router row (h itself, so theirs are the largest logits, the same
    bits): top-2 takes 3 then 5, as moe_route and torch.topk on CUDA do."""
    g = torch.Generator().manual_seed(11)
    d, e = 64, 16
    w = _weights(e, d, True, g, scale=0.05)
    x, residual, norm_w = _inputs(d, g)
    h, _ = add_rmsnorm(x, residual, norm_w, EPS, False)
    w.router_rows[[3, 5, 9]] = h[0]
    cfg = NormRouteConfig(rows=4, warps=1)
    h2, _, ids, route_w = norm_route(x, residual, norm_w, EPS, False, w, 2, renorm, config=cfg)
    assert torch.equal(h2, h)
    assert ids.tolist() == [[3, 5, e]]
    assert route_w[0, 0] == route_w[0, 1] and (not renorm or route_w[0, 0] == 0.5)
    _, _, ids0, route_w0 = _unfused(x, residual, norm_w, False, w, 2, renorm)
    assert torch.equal(ids, ids0) and torch.equal(route_w, route_w0)


def test_rejects_bad_inputs():
    g = torch.Generator().manual_seed(0)
    w = _weights(8, 64, True, g)
    x, residual, norm_w = _inputs(64, g)
    bad = [
        ((x.expand(2, 64), residual, norm_w, w, 2), "x: norm_route takes one row"),
        ((x.float(), residual, norm_w, w, 2), "x: expected bfloat16"),
        ((x, residual.to(torch.bfloat16), norm_w, w, 2), "residual: expected float32"),
        ((x, residual[:, :32], norm_w, w, 2), r"residual: expected float32 \[1, 64\]"),
        ((x, residual, norm_w[:32], w, 2), "norm_weight: expected"),
        ((x, residual, norm_w, _weights(8, 32, True, g), 2), r"router: expected bfloat16 \[9, 64\]"),
        ((x, residual, norm_w, w, 3), "top_k: expected a power of two in 1..8"),
        ((x, residual, norm_w, w, 16), "top_k: expected a power of two in 1..8"),
    ]
    for (xx, rr, nw, ww, k), msg in bad:
        with pytest.raises(ValueError, match=msg):
            norm_route(xx, rr, nw, EPS, True, ww, k, True)
    with pytest.raises(ValueError, match="rows: expected a power of two"):
        NormRouteConfig(rows=3, warps=1)
    with pytest.raises(ValueError, match="warps: expected 1, 2, 4 or 8"):
        NormRouteConfig(rows=2, warps=3)


# (E, shared, one_plus) of Qwen3.5/3.6-35B-A3B and Qwen3-30B-A3B; D 2048, top-8, renormalised.
GPU_MODELS = [(256, True, True), (128, False, False)]
GPU_CONFIGS = [None, NormRouteConfig(1, 1), NormRouteConfig(4, 4), NormRouteConfig(8, 2)]


def _bf16_step(v: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |v| (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(v.float().abs().clamp_min(1e-30))) - 7)


@pytest.mark.gpu
@pytest.mark.parametrize(("e", "shared", "one_plus"), GPU_MODELS)
@pytest.mark.parametrize("cfg", GPU_CONFIGS)
def test_real_shapes_against_the_unfused_launches(e, shared, one_plus, cfg):
    """Against add_rmsnorm, cuBLAS's router GEMV and moe_route, over 16 inputs. The residual is the same fp32
    sum (exact); h's norm and the router dots are summed in another order (the reduction trees differ with the
    warps), so h may differ by a bf16 step in rare elements, and the routing, from logits a bf16 step apart
    here and there, is compared on the cuBLAS logits of the fused h: the same experts unless the k-th and
    (k+1)-th logits are within two bf16 steps (then skipped), weights within 2% (a logit one step of
    ~0.016 apart moves its weight by 1.6%)."""
    d, top_k = 2048, 8
    g = torch.Generator().manual_seed(e)
    w = _weights(e, d, shared, g, scale=2 / d**0.5)  # logits of std ~2, as a trained router's
    skipped = 0
    for _ in range(16):
        x, residual, norm_w = _inputs(d, g)
        h, r, ids, route_w = norm_route(x, residual, norm_w, EPS, one_plus, w, top_k, True, config=cfg)
        h0, r0 = add_rmsnorm(x, residual, norm_w, EPS, one_plus)
        assert torch.equal(r, r0)
        assert ((h.float() - h0.float()).abs() <= _bf16_step(h0)).all()
        assert (h == h0).float().mean() > 0.99
        logits = router_logits(h, w)
        ids0, route_w0 = moe_route(logits, e, top_k, True, shared)
        top = logits[0, :e].float().sort(descending=True).values
        if top[top_k - 1] - top[top_k] <= 2 * _bf16_step(top[top_k - 1]):
            skipped += 1
            continue
        order, order0 = ids[0, :top_k].sort(), ids0[0, :top_k].sort()
        assert torch.equal(order.values, order0.values)
        torch.testing.assert_close(
            route_w[0, :top_k][order.indices], route_w0[0, :top_k][order0.indices], rtol=2e-2, atol=1e-6
        )
        if shared:
            assert ids[0, -1] == e
            torch.testing.assert_close(route_w[0, -1], route_w0[0, -1], rtol=2e-2, atol=1e-6)
    assert skipped <= 8  # 5 of 16 at 256 experts on the H100 (session 25): 8th and 9th logits are close
    torch.cuda.synchronize()
    assert _counter(x.device) == 0


@pytest.mark.gpu
@pytest.mark.parametrize(("e", "shared", "one_plus"), GPU_MODELS)
def test_real_shapes_replayed_from_a_cuda_graph(e, shared, one_plus):
    """The engine captures decode steps: replays on new inputs give the eager launch's bits (one program sums
    each logit and one routes, so the kernel is deterministic), replay after replay (the counter reset)."""
    d = 2048
    g = torch.Generator().manual_seed(e + 1)
    w = _weights(e, d, shared, g, scale=2 / d**0.5)
    x, residual, norm_w = _inputs(d, g)
    norm_route(x, residual, norm_w, EPS, one_plus, w, 8, True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = norm_route(x, residual, norm_w, EPS, one_plus, w, 8, True)
    for _ in range(3):
        x2, residual2, _ = _inputs(d, g)
        x.copy_(x2)
        residual.copy_(residual2)
        for t in out:
            t.fill_(-1)
        graph.replay()
        want = norm_route(x, residual, norm_w, EPS, one_plus, w, 8, True)
        for got, ref in zip(out, want, strict=True):
            assert torch.equal(got, ref)
    torch.cuda.synchronize()
    assert _counter(x.device) == 0
