"""FP8 W8A16 linear against its fp32 reference: interpreter shapes on CPU, real shapes on the GPU."""

import pytest
import torch
from batchinfer.kernels.fp8_gemm import fp8_dequantize, fp8_gemm, fp8_gemm_ref, fp8_gemv, stack_fp8
from batchinfer.kernels.nvfp4 import quantize_fp8
from batchinfer.kernels.nvfp4_gemm import FUSED_MAX_M, GemmConfig, choose_split_k

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check(out: torch.Tensor, ref: torch.Tensor, tol: float = 1e-2, exact_weights: bool = True) -> None:
    assert not torch.isnan(out).any(), "NaN in output (unwritten poisoned element?)"
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err <= tol, f"relative error {err:.2e} > {tol}"
    if exact_weights:  # fused decode is exact: only the output's bf16 rounding (interpreter truncates: 2^-7)
        assert torch.all((out.float() - ref).abs() <= ref.abs() * 2**-7 + 1e-3 * ref.abs().max())


def _case(m: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = quantize_fp8(torch.randn(n, k, generator=g) * 0.05).to(DEVICE)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEVICE)
    return x, w


@pytest.mark.parametrize(
    ("m", "n", "k", "split"),
    [(1, 32, 64, 1), (5, 40, 96, 1), (16, 33, 48, 2), (3, 64, 128, 4), (2, 16, 64, 0)],
)
def test_fused_matches_reference_small(m, n, k, split):
    x, w = _case(m, n, k, seed=m * 1000 + n + k)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    res = fp8_gemm(x, w, out=out, config=GemmConfig(16, 16, 32, split, 4, 1))
    assert res.data_ptr() == out.data_ptr()
    _check(out, fp8_gemm_ref(x, w))


@pytest.mark.parametrize(("n", "k"), [(40, 96), (40, 300), (16, 1024)])  # one split; 2 (ragged K); 4
def test_one_row_takes_the_gemv(monkeypatch, n, k):
    """A single row (decode) runs the CUDA-core GEMV, whole or split over K, twice (split counters reset)."""
    from batchinfer.kernels import fp8_gemm as mod

    calls = []
    real = mod._fp8_gemv
    monkeypatch.setattr(mod, "_fp8_gemv", lambda *a: calls.append(1) or real(*a))
    for seed in (n + k, n + k + 1):
        x, w = _case(1, n, k, seed=seed)
        out = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        fp8_gemm(x, w, out=out)
        _check(out, fp8_gemm_ref(x, w))
    assert len(calls) == 2


@pytest.mark.parametrize("k", [96, 1024])  # one split; 4 (the per-row scales of each split's partial)
@pytest.mark.parametrize("tail_rows", [0, 3, 21])  # none; inside the last FP8 tile; that tile and one more
def test_stacked_rows_keep_each_tensors_scale(k, tail_rows):
    """q|k|v-style stacking: three per-tensor FP8 weights of different scales, then bf16 tail rows (DeltaNet's
    b|a), as one GEMV written into a column slice of a wider row; each part is its weight's own product."""
    g = torch.Generator().manual_seed(k + tail_rows)
    ws = [
        quantize_fp8(torch.randn(n, k, generator=g) * s).to(DEVICE)
        for n, s in ((24, 0.5), (8, 0.01), (13, 3.0))
    ]
    tails = [
        (torch.randn(n, k, generator=g) * 0.1).to(torch.bfloat16).to(DEVICE) for n in (tail_rows // 3,) * 3
    ]
    x = torch.randn(1, k, generator=g).to(torch.bfloat16).to(DEVICE)
    rows = stack_fp8(ws, tails if tail_rows else ())
    assert rows.data.shape == (45, k) and rows.scale.shape == (45,) and rows.rows == 45 + tail_rows
    wide = torch.full((1, 52 + tail_rows), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    fp8_gemv(x, rows, out=wide[:, 4 : 49 + tail_rows])
    want = torch.cat([fp8_gemm_ref(x, w) for w in ws] + [x.float() @ t.float().t() for t in tails], dim=1)
    bounds = [0, 24, 32, 45] + [45 + i * tail_rows // 3 for i in (1, 2, 3)] if tail_rows else [0, 24, 32, 45]
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):  # each weight within its own scale's tolerance
        _check(wide[:, 4 + lo : 4 + hi], want[:, lo:hi])
    assert wide[:, :4].isnan().all() and wide[:, 49 + tail_rows :].isnan().all()
    with pytest.raises(ValueError, match="at least one FP8 weight"):
        stack_fp8([], tails)
    with pytest.raises(ValueError, match="share K"):
        stack_fp8([ws[0], quantize_fp8(torch.randn(4, k + 16, generator=g)).to(DEVICE)])
    with pytest.raises(ValueError, match=r"x: expected bfloat16 \[1, "):
        fp8_gemv(torch.cat([x, x]), rows)


@pytest.mark.parametrize(("m", "n", "k"), [(17, 40, 96), (33, 70, 64)])
def test_dequant_path_matches_reference(m, n, k):
    x, w = _case(m, n, k, seed=m + n)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    assert m > FUSED_MAX_M
    fp8_gemm(x, w, out=out)  # dequantize (bf16 weights: one more rounding) + matmul
    _check(out, fp8_gemm_ref(x, w), exact_weights=False)
    ref = w.dequantize(torch.bfloat16).float()
    torch.testing.assert_close(fp8_dequantize(w, 8, 30).float(), ref[8:30], rtol=2**-7, atol=0)


def test_split_k_counters_reset_between_calls():
    x, w = _case(4, 32, 128, seed=7)
    cfg = GemmConfig(16, 16, 32, 4, 4, 1)
    first = fp8_gemm(x, w, config=cfg)
    x2 = torch.randn_like(x)
    second = fp8_gemm(x2, w, config=cfg)  # a stale counter would skip or double the reduction
    _check(first, fp8_gemm_ref(x, w))
    _check(second, fp8_gemm_ref(x2, w))


def test_leading_dims_and_default_config():
    g = torch.Generator().manual_seed(3)
    w = quantize_fp8(torch.randn(24, 64, generator=g)).to(DEVICE)
    x = torch.randn(2, 3, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    out = fp8_gemm(x, w)
    assert out.shape == (2, 3, 24) and out.dtype == torch.bfloat16
    _check(out.reshape(6, 24), fp8_gemm_ref(x.reshape(6, 64), w))


def test_rejects_bad_inputs():
    x, w = _case(2, 16, 64, seed=1)
    with pytest.raises(ValueError, match="K=64"):
        fp8_gemm(x[:, :32], w)
    with pytest.raises(ValueError, match="bfloat16"):
        fp8_gemm(x.float(), w)
    with pytest.raises(ValueError, match="out: expected bfloat16 \\[2, 16\\]"):
        fp8_gemm(x, w, out=torch.empty(2, 8, dtype=torch.bfloat16, device=DEVICE))


def test_split_k_choice_covers_sms_and_keeps_k_blocks():
    assert choose_split_k(tiles=32, k=2048, block_k=256, num_sms=132) == 4
    assert choose_split_k(tiles=8, k=4096, block_k=256, num_sms=132) == 8
    assert choose_split_k(tiles=1000, k=2048, block_k=256, num_sms=132) == 1
    assert choose_split_k(tiles=1, k=512, block_k=256, num_sms=132) == 1


# Real shapes of both models (N, K): q_proj / in_proj_qkv, o_proj / out_proj, experts, lm_head slice.
GPU_SHAPES = [(8192, 2048), (2048, 4096), (512, 2048), (2048, 768), (16384, 2048)]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 100, 2048])
@pytest.mark.parametrize(("n", "k"), GPU_SHAPES)
def test_matches_reference_real_shapes(m, n, k):
    x, w = _case(m, n, k, seed=m + n + k)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    fp8_gemm(x, w, out=out)
    _check(out, fp8_gemm_ref(x, w), tol=5e-3, exact_weights=m <= FUSED_MAX_M)
