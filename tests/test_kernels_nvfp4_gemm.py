"""NVFP4 W4A16 linear against its fp32 reference: interpreter shapes on CPU, real shapes on the GPU."""

import pytest
import torch
from batchinfer.kernels import nvfp4_gemm as nvfp4_gemm_module
from batchinfer.kernels.nvfp4 import quantize_nvfp4
from batchinfer.kernels.nvfp4_gemm import (
    FUSED_MAX_M,
    GemmConfig,
    GemvConfig,
    NVFP4Rows,
    choose_split_k,
    nvfp4_dequantize,
    nvfp4_gemm,
    nvfp4_gemm_ref,
    nvfp4_gemv,
    stack_nvfp4,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check(out: torch.Tensor, ref: torch.Tensor, tol: float = 1e-2, exact_weights: bool = True) -> None:
    assert not torch.isnan(out).any(), "NaN in output (unwritten poisoned element?)"
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err <= tol, f"relative error {err:.2e} > {tol}"
    if exact_weights:  # fused decode is exact: only the output's bf16 rounding (interpreter truncates: 2^-7)
        assert torch.all((out.float() - ref).abs() <= ref.abs() * 2**-7 + 1e-3 * ref.abs().max())


def _case(m: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = quantize_nvfp4(torch.randn(n, k, generator=g) * 0.05).to(DEVICE)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEVICE)
    return x, w


@pytest.mark.parametrize(
    ("m", "n", "k", "split"),
    [(1, 32, 64, 1), (5, 40, 96, 1), (16, 33, 48, 2), (3, 64, 128, 4), (20, 16, 64, 0)],
)
@pytest.mark.parametrize("even_odd", [False, True])
def test_fused_matches_reference_small(m, n, k, split, even_odd):
    x, w = _case(m, n, k, seed=m * 1000 + n + k)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    res = nvfp4_gemm(x, w, out=out, config=GemmConfig(16, 16, 32, split, 4, 1, even_odd))
    assert res.data_ptr() == out.data_ptr()
    _check(out, nvfp4_gemm_ref(x, w))


@pytest.mark.parametrize(("m", "n", "k"), [(17, 40, 96), (33, 70, 64)])
def test_dequant_path_matches_reference(m, n, k, monkeypatch):
    x, w = _case(m, n, k, seed=m + n)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    assert m > FUSED_MAX_M
    nvfp4_gemm(x, w, out=out)  # dequantize (bf16 weights: one more rounding) + matmul
    _check(out, nvfp4_gemm_ref(x, w), exact_weights=False)
    monkeypatch.setattr(nvfp4_gemm_module, "DEQUANT_CHUNK_ELEMS", 16 * k)  # slices of 16 rows
    _check(nvfp4_gemm(x, w), nvfp4_gemm_ref(x, w), exact_weights=False)
    wide = torch.full((m, n + 5), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    nvfp4_gemm(x, w, out=wide[:, :n])  # a strided output view
    _check(wide[:, :n], nvfp4_gemm_ref(x, w), exact_weights=False)
    assert wide[:, n:].isnan().all()


def test_dequantize_matches_codec():
    _, w = _case(1, 48, 96, seed=9)
    ref = w.dequantize(torch.bfloat16).float()
    torch.testing.assert_close(nvfp4_dequantize(w).float(), ref, rtol=2**-7, atol=0)
    torch.testing.assert_close(nvfp4_dequantize(w, 16, 40), nvfp4_dequantize(w)[16:40])


def test_split_k_counters_reset_between_calls():
    x, w = _case(4, 32, 128, seed=7)
    cfg = GemmConfig(16, 16, 32, 4, 4, 1)
    first = nvfp4_gemm(x, w, config=cfg)
    x2 = torch.randn_like(x)
    second = nvfp4_gemm(x2, w, config=cfg)  # a stale counter would skip or double the reduction
    _check(first, nvfp4_gemm_ref(x, w))
    _check(second, nvfp4_gemm_ref(x2, w))


def test_outgrown_split_k_counters_stay_allocated(monkeypatch):
    """A CUDA graph keeps the address of the counters it was captured with: growing the buffer must not
    free the old one (graphs of small batches are captured before those of large ones)."""
    monkeypatch.setattr(nvfp4_gemm_module, "_LOCKS", {})
    dev = torch.device(DEVICE)
    small = nvfp4_gemm_module.split_k_locks(dev, 10)
    assert nvfp4_gemm_module.split_k_locks(dev, 100) is small  # big enough: reused
    large = nvfp4_gemm_module.split_k_locks(dev, small.numel() + 1)
    assert large is not small and large.numel() > small.numel() and not large.any()
    assert any(b is small for b in nvfp4_gemm_module._LOCKS[dev])  # still referenced, so never freed


@pytest.mark.parametrize(
    ("n", "k"), [(40, 96), (24, 304), (16, 1024)]
)  # ragged last group block; 2; 4 splits
def test_one_row_takes_the_gemv(monkeypatch, n, k):
    """A single row (decode) runs the CUDA-core GEMV on the checkpoint layout, whole or split over K, twice
    (split counters reset); exact weights, so only the accumulation order and the bf16 output round."""
    calls = []
    real = nvfp4_gemm_module._nvfp4_gemv
    monkeypatch.setattr(nvfp4_gemm_module, "_nvfp4_gemv", lambda *a: calls.append(1) or real(*a))
    for seed in (n + k, n + k + 1):
        x, w = _case(1, n, k, seed=seed)
        out = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        nvfp4_gemm(x, w, out=out)
        _check(out, nvfp4_gemm_ref(x, w))
    assert len(calls) == 2


def _stacked_case(ns: list[int], k: int, seed: int):
    """One x row and NVFP4 weights of `ns` rows with distinct tensor scales, and the fp32 reference."""
    g = torch.Generator().manual_seed(seed)
    ws = [
        quantize_nvfp4((torch.randn(n, k, generator=g) * (0.05 * (i + 1))).to(DEVICE))
        for i, n in enumerate(ns)
    ]
    x = torch.randn(1, k, generator=g).to(torch.bfloat16).to(DEVICE)
    return x, ws, torch.cat([nvfp4_gemm_ref(x, w) for w in ws], dim=1)


@pytest.mark.parametrize(
    ("ns", "k", "config"),
    [([40], 96, None), ([24, 8, 8], 304, GemvConfig(16, 2, 4, 2)), ([33, 31], 1024, GemvConfig(16, 4, 4, 4))],
)  # ragged row tiles; a K split with a ragged last step; 4 splits
def test_stacked_rows_gemv_matches_reference(ns, k, config):
    """Group-major stacked rows (q|k|v-style, each matrix its own tensor scale) through the one-row GEMV,
    twice (split counters reset): exact weights, so only accumulation order and the bf16 output round."""
    for seed in (k, k + 1):
        x, ws, ref = _stacked_case(ns, k, seed)
        rows = stack_nvfp4(ws)
        assert rows.shape == (sum(ns), k)
        out = torch.full((1, sum(ns)), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        assert nvfp4_gemv(x, rows, out=out, config=config) is out
        _check(out, ref)


def test_stacked_rows_reject_bad_inputs():
    x, ws, _ = _stacked_case([16, 16], 64, seed=5)
    with pytest.raises(ValueError, match="share K"):
        stack_nvfp4([ws[0], quantize_nvfp4(torch.randn(16, 32)).to(DEVICE)])
    with pytest.raises(ValueError, match="at least one"):
        stack_nvfp4([])
    rows = stack_nvfp4(ws)
    with pytest.raises(ValueError, match="x: expected bfloat16 \\[1, 64\\]"):
        nvfp4_gemv(torch.cat([x, x]), rows)
    bad = NVFP4Rows(rows.codes, rows.scales, rows.tensor_scale[:1])  # one scale for all: not a stack's
    with pytest.raises(ValueError, match="float32 tensor scales \\[32\\]"):
        nvfp4_gemv(x, bad)
    with pytest.raises(ValueError, match="one row"):
        nvfp4_gemm(torch.cat([x, x]), ws[0], config=GemvConfig(16, 2, 4))


def test_leading_dims_and_default_config():
    g = torch.Generator().manual_seed(3)
    w = quantize_nvfp4(torch.randn(24, 64, generator=g)).to(DEVICE)
    x = torch.randn(2, 3, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    out = nvfp4_gemm(x, w)  # 6 rows: the fused kernel with the default config
    assert out.shape == (2, 3, 24) and out.dtype == torch.bfloat16
    _check(out.reshape(6, 24), nvfp4_gemm_ref(x.reshape(6, 64), w))


def test_rejects_bad_inputs():
    x, w = _case(2, 16, 64, seed=1)
    with pytest.raises(ValueError, match="K=64"):
        nvfp4_gemm(x[:, :32], w)
    with pytest.raises(ValueError, match="bfloat16"):
        nvfp4_gemm(x.float(), w)
    with pytest.raises(ValueError, match="out: expected bfloat16 \\[2, 16\\]"):
        nvfp4_gemm(x, w, out=torch.empty(2, 8, dtype=torch.bfloat16, device=DEVICE))


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
    nvfp4_gemm(x, w, out=out)
    _check(out, nvfp4_gemm_ref(x, w), tol=5e-3, exact_weights=m <= FUSED_MAX_M)
    if m <= FUSED_MAX_M:  # the even/odd variant the tuner compares
        even_odd = nvfp4_gemm(x, w, config=GemmConfig(16, 64, 256, 0, 4, 4, True))
        _check(even_odd, nvfp4_gemm_ref(x, w), tol=5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("ns", [[8192, 512, 512], [2048], [248320]])  # q|k|v (Qwen3-30B), o_proj, lm_head
@pytest.mark.parametrize("config", [None, GemvConfig(64, 16, 4), GemvConfig(256, 4, 8, 2, 1)])
def test_stacked_rows_gemv_real_shapes(ns, config):
    x, ws, ref = _stacked_case(ns, 4096 if ns == [2048] else 2048, seed=sum(ns))
    out = torch.full((1, sum(ns)), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    nvfp4_gemv(x, stack_nvfp4(ws), out=out, config=config)
    _check(out, ref, tol=5e-3)
