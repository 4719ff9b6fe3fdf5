"""The few-row NVFP4 linear on the tensor cores (`kernels/nvfp4_rows_tc.py`) against its fp32 reference:
interpreter shapes on CPU, lm_head and the projections at real shapes on the GPU."""

import pytest
import torch
from batchinfer.kernels.nvfp4 import quantize_nvfp4
from batchinfer.kernels.nvfp4_gemm import nvfp4_gemv, stack_nvfp4
from batchinfer.kernels.nvfp4_rows_tc import (
    ROWS_TC_MAX_M,
    RowsTCConfig,
    nvfp4_rows_tc,
    nvfp4_rows_tc_ref,
    pair_nvfp4_rows,
)
from test_kernels_fp8_rows_mm import DEVICE, _rel  # the same tolerance: bf16 output, fp32 sums


def _weights(k: int, parts, seed: int):
    """NVFP4 weights of very different scales (so different tensor scales), quantized on the CPU."""
    g = torch.Generator().manual_seed(seed)
    return [quantize_nvfp4(torch.randn(n, k, generator=g) * s).to(DEVICE) for n, s in parts]


@pytest.mark.parametrize(("m", "k", "block_n", "steps", "split"), [
    (1, 128, 64, 4, 1), (3, 256, 64, 4, 2), (16, 64, 64, 2, 1), (17, 96, 64, 1, 3), (33, 256, 64, 2, 4),
    (64, 128, 64, 4, 1), (9, 128, 128, 4, 2),
])  # fmt: skip
def test_matches_each_stacked_weight(m, k, block_n, steps, split):
    """Rows of three NVFP4 tensors (88 rows: each 64-row tile spans two of them, the second partial; one
    128-row tile, 8 warps), every STEPS, K split over programs (down to one 32-code block a program), written
    into a column slice of a wider output: each part is its own weight's product."""
    ws = _weights(k, ((24, 0.5), (48, 0.01), (16, 3.0)), seed=m + k)
    rows = pair_nvfp4_rows(ws)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16).to(DEVICE)
    wide = torch.full((m, 96), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    config = RowsTCConfig(block_n, block_n // 16, 1, steps, split)
    nvfp4_rows_tc(x, rows, out=wide[:, 4:92], config=config)
    assert wide[:, :4].isnan().all() and wide[:, 92:].isnan().all()
    got = wide[:, 4:92]
    lo = 0
    for w in ws:  # each weight within its own scale's tolerance
        assert _rel(got[:, lo : lo + w.shape[0]], nvfp4_rows_tc_ref(x, [w])) < 1e-2
        lo += w.shape[0]
    assert _rel(got, nvfp4_rows_tc_ref(x, ws)) < 1e-2


def test_default_config_one_row_as_the_gemv_and_bad_inputs():
    ws = _weights(128, ((70, 1.0),), seed=3)
    rows = pair_nvfp4_rows(ws)
    x = torch.randn(7, 128).to(torch.bfloat16).to(DEVICE)
    assert _rel(nvfp4_rows_tc(x, rows), nvfp4_rows_tc_ref(x, ws)) < 1e-2
    one = x[:1]
    assert _rel(nvfp4_rows_tc(one, rows), nvfp4_gemv(one, stack_nvfp4(ws)).float()) < 1e-2
    with pytest.raises(ValueError, match=rf"1 <= M <= {ROWS_TC_MAX_M}"):
        nvfp4_rows_tc(torch.zeros(ROWS_TC_MAX_M + 1, 128, dtype=torch.bfloat16, device=DEVICE), rows)
    with pytest.raises(ValueError, match=r"x: expected bfloat16 \[M, 128\]"):
        nvfp4_rows_tc(x.float(), rows)
    with pytest.raises(ValueError, match=r"x: expected bfloat16 \[M, 128\]"):
        nvfp4_rows_tc(x[:, :64], rows)
    with pytest.raises(ValueError, match="out: expected bfloat16"):
        nvfp4_rows_tc(x, rows, out=torch.empty(7, 71, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="STEPS must be 1, 2 or 4"):
        nvfp4_rows_tc(x, rows, config=RowsTCConfig(64, 4, 1, 3, 1))
    with pytest.raises(ValueError, match=r"must share K \(a multiple of 32\), got \[64, 128\]"):
        pair_nvfp4_rows([*ws, *_weights(64, ((8, 1.0),), seed=4)])
    with pytest.raises(ValueError, match="at least one"):
        pair_nvfp4_rows([])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 2, 8, 32, 64])
@pytest.mark.parametrize(
    ("parts", "k"),
    [
        (((248320, 0.02),), 2048),  # Qwen3.6 lm_head: thousands of row tiles, no K split
        (((4096, 0.02), (512, 0.03), (512, 0.01)), 2048),  # Qwen3-30B q | k | v (all-NVFP4)
        (((2048, 0.02),), 4096),  # o_proj: few row tiles, split-K
    ],
)
def test_real_shapes_gpu(m, parts, k):
    g = torch.Generator(device=DEVICE).manual_seed(m)
    ws = [quantize_nvfp4(torch.randn(n, k, generator=g, device=DEVICE) * s) for n, s in parts]
    rows = pair_nvfp4_rows(ws)
    x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
    out = torch.full((m, rows.shape[0]), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    nvfp4_rows_tc(x, rows, out=out)
    assert _rel(out, nvfp4_rows_tc_ref(x, ws)) < 1e-2
    if m == 1:  # the one-row GEMV computes the same
        assert _rel(out, nvfp4_gemv(x, stack_nvfp4(ws)).float()) < 1e-2
