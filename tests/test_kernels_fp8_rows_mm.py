"""The few-row FP8 linear on stacked rows (`kernels/fp8_rows_mm.py`) against its fp32 reference: interpreter
shapes on CPU, the engine's stacks at real shapes on the GPU."""

import pytest
import torch
from batchinfer.kernels.fp8_gemm import fp8_gemm_ref, fp8_gemv, stack_fp8
from batchinfer.kernels.fp8_rows_mm import ROWS_MM_MAX_M, RowsMMConfig, fp8_rows_mm, fp8_rows_mm_ref
from batchinfer.kernels.nvfp4 import quantize_fp8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error against an fp32 reference; every element within its bf16 rounding (the
    interpreter truncates: 2^-7) beside the accumulation order's error."""
    assert not torch.isnan(out).any(), "NaN in output (unwritten poisoned element?)"
    diff = (out.float() - ref.float()).abs()
    assert torch.all(diff <= ref.float().abs() * 2**-7 + 1e-3 * ref.float().abs().max())
    return (diff.norm() / ref.float().norm()).item()


def _stack(k: int, parts, tail_rows: int, seed: int):
    """Per-tensor FP8 weights of very different scales stacked as `FP8Rows`, then bf16 tail rows."""
    g = torch.Generator().manual_seed(seed)
    ws = [quantize_fp8(torch.randn(n, k, generator=g) * s).to(DEVICE) for n, s in parts]
    tail = [(torch.randn(tail_rows, k, generator=g) * 0.1).to(torch.bfloat16).to(DEVICE)] if tail_rows else []
    return ws, tail, stack_fp8(ws, tail)


@pytest.mark.parametrize(("m", "k", "tail_rows", "split"), [
    (2, 96, 0, 1), (5, 80, 21, 1), (16, 64, 3, 2), (17, 128, 0, 0), (33, 96, 40, 3), (1, 64, 5, 1),
])  # fmt: skip
def test_matches_each_stacked_weight(m, k, tail_rows, split):
    """Rows of three FP8 tensors (45 rows: the last 16-row tile straddles into the tail), K not a multiple of
    the 32-column tile, split-K, written into a column slice of a wider output: each part is its own
    weight's product, the tail's the bf16 product."""
    ws, tail, rows = _stack(k, ((24, 0.5), (8, 0.01), (13, 3.0)), tail_rows, seed=m + k + tail_rows)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16).to(DEVICE)
    wide = torch.full((m, 52 + tail_rows), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    fp8_rows_mm(x, rows, out=wide[:, 4 : 49 + tail_rows], config=RowsMMConfig(16, 32, split, 4, 1))
    assert wide[:, :4].isnan().all() and wide[:, 49 + tail_rows :].isnan().all()
    got = wide[:, 4 : 49 + tail_rows]
    parts = [fp8_gemm_ref(x, w) for w in ws] + [x.float() @ t.float().t() for t in tail]
    lo = 0
    for want in parts:  # each weight within its own scale's tolerance
        assert _rel(got[:, lo : lo + want.shape[1]], want) < 1e-2
        lo += want.shape[1]
    assert _rel(got, fp8_rows_mm_ref(x, rows)) < 1e-2


def test_default_config_and_bad_inputs():
    _, _, rows = _stack(64, ((40, 1.0),), 8, seed=3)
    x = torch.randn(7, 64).to(torch.bfloat16).to(DEVICE)
    assert _rel(fp8_rows_mm(x, rows), fp8_rows_mm_ref(x, rows)) < 1e-2
    with pytest.raises(ValueError, match=rf"1 <= M <= {ROWS_MM_MAX_M}"):
        fp8_rows_mm(torch.zeros(ROWS_MM_MAX_M + 1, 64, dtype=torch.bfloat16, device=DEVICE), rows)
    with pytest.raises(ValueError, match=r"x: expected bfloat16 \[M, 64\]"):
        fp8_rows_mm(x.float(), rows)
    with pytest.raises(ValueError, match=r"x: expected bfloat16 \[M, 64\]"):
        fp8_rows_mm(x[:, :32], rows)
    with pytest.raises(ValueError, match="out: expected bfloat16"):
        fp8_rows_mm(x, rows, out=torch.empty(7, 40, dtype=torch.bfloat16, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 2, 8, 32, 64])
@pytest.mark.parametrize(
    ("parts", "tail_rows", "k"),
    [
        (((8192, 0.02), (512, 0.03), (512, 0.01)), 0, 2048),  # Qwen3.6 q (with gate) | k | v
        (((8192, 0.02), (4096, 0.03)), 64, 2048),  # DeltaNet qkv | z, then b | a in bf16
        (((2048, 0.02),), 0, 4096),  # o_proj: few row tiles, split-K
    ],
)
def test_engine_stacks_real_shapes_gpu(m, parts, tail_rows, k):
    _, _, rows = _stack(k, parts, tail_rows, seed=m)
    x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
    out = torch.full((m, rows.rows), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    fp8_rows_mm(x, rows, out=out)
    assert _rel(out, fp8_rows_mm_ref(x, rows)) < 1e-2
    if m == 1:  # the one-row GEMV computes the same
        assert _rel(out, fp8_gemv(x, rows)) < 1e-2
