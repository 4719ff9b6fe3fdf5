"""FP8 W8A16 linear against its fp32 reference: interpreter shapes on CPU, real shapes on the GPU."""

import pytest
import torch
from batchinfer.kernels.causal_conv1d import causal_conv1d_update, causal_conv1d_update_ref
from batchinfer.kernels.fp8_gemm import fp8_dequantize, fp8_gemm, fp8_gemm_ref, fp8_gemv, stack_fp8
from batchinfer.kernels.gdn import gated_rmsnorm, gated_rmsnorm_ref
from batchinfer.kernels.nvfp4 import quantize_fp8
from batchinfer.kernels.nvfp4_gemm import FUSED_MAX_M, GemmConfig, GemvConfig, choose_split_k

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


def _deltanet_out(heads: int, dv: int, n: int, tail_rows: int, seed: int):
    """out_proj's inputs at one decode row: o and z `[1, heads * dv]` (each head of o at its own scale, so a
    norm over the wrong columns changes every output), the norm weight `[dv]` and FP8 rows (+ a bf16 tail)."""
    g = torch.Generator().manual_seed(seed)
    k = heads * dv
    scale = torch.logspace(-2, 1, heads)[torch.randperm(heads, generator=g)].repeat_interleave(dv)
    o = (torch.randn(1, k, generator=g) * scale).to(torch.bfloat16).to(DEVICE)
    z = (torch.randn(1, k, generator=g) * 2).to(torch.bfloat16).to(DEVICE)
    weight = (1 + 0.5 * torch.randn(dv, generator=g)).to(torch.bfloat16).to(DEVICE)
    tail = [(torch.randn(tail_rows, k, generator=g) * 0.1).to(torch.bfloat16).to(DEVICE)] if tail_rows else []
    rows = stack_fp8([quantize_fp8(torch.randn(n, k, generator=g) * 0.05).to(DEVICE)], tail)
    return o, z, weight, rows


def _two_launches(o, z, weight, eps, rows, config=None):
    """What the fused GEMV replaces: `gated_rmsnorm` over heads of Dv, then the GEMV on its bf16 output."""
    dv = weight.shape[0]
    return fp8_gemv(
        gated_rmsnorm(o.view(-1, dv), z.view(-1, dv), weight, eps).view(1, -1), rows, config=config
    )


@pytest.mark.parametrize("tail_rows", [0, 7])  # none; bf16 rows inside the last FP8 tile and one more
@pytest.mark.parametrize(
    ("dv", "heads", "block_g", "split"),
    [
        (16, 6, 2, 1),  # two heads a K step, one split
        (16, 5, 2, 2),  # the last K step half masked (K = 80 is no multiple of BLOCK_K = 32)
        (16, 8, 4, 3),  # four heads a step, ragged splits (k_per_split 64 of K = 128: the third is empty)
        (32, 4, 2, 2),  # one head a step
        (32, 6, 4, 2),  # two heads a step, two steps a split
    ],
)
def test_gated_norm_fused_is_bit_exact(dv, heads, block_g, split, tail_rows):
    """The fused gated RMSNorm + GEMV equals the two launches bit for bit (same fp32 norm, same single bf16
    rounding of x), written into a poisoned column slice; twice, so a stale split-K counter shows."""
    n = 40
    cfg = GemvConfig(16, block_g, 4, split)
    for seed in (dv * heads + split, dv * heads + split + 1):
        o, z, weight, rows = _deltanet_out(heads, dv, n, tail_rows, seed)
        wide = torch.full((1, n + tail_rows + 6), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        out = fp8_gemv(o, rows, out=wide[:, 3 : 3 + n + tail_rows], config=cfg, gated_norm=(z, weight, 1e-6))
        want = _two_launches(o, z, weight, 1e-6, rows, cfg)
        assert torch.equal(out, want), (out.float() - want.float()).abs().max()
        assert wide[:, :3].isnan().all() and wide[:, 3 + n + tail_rows :].isnan().all()
        normed = gated_rmsnorm_ref(o.view(-1, dv), z.view(-1, dv), weight, 1e-6).view(1, -1)
        data = rows.data.float() * rows.scale[:, None]
        ref = normed @ torch.cat([data] + ([rows.tail.float()] if tail_rows else [])).t()
        _check(out, ref, exact_weights=False)  # and it is the product with the normalised x


def test_gated_norm_falls_back_to_two_launches(monkeypatch):
    """A head wider than the K step (Dv = 64 > BLOCK_K = 32) or not dividing it (the demo model's 48) runs
    `gated_rmsnorm` and the plain GEMV; a wider step (block_g = 4: 64 columns) fuses Dv = 64 again."""
    from batchinfer.kernels import fp8_gemm as mod

    calls = []
    monkeypatch.setattr(mod, "gated_rmsnorm", lambda *a: calls.append(1) or gated_rmsnorm(*a))
    for dv, block_g, fused in ((64, 2, False), (48, 2, False), (48, 4, False), (64, 4, True)):
        o, z, weight, rows = _deltanet_out(4, dv, 24, 0, seed=dv + block_g)
        cfg = GemvConfig(16, block_g, 4, 2)
        calls.clear()
        out = fp8_gemv(o, rows, config=cfg, gated_norm=(z, weight, 1e-5))
        assert calls == ([] if fused else [1]), (dv, block_g)
        assert torch.equal(out, _two_launches(o, z, weight, 1e-5, rows, cfg)), (dv, block_g)


def test_gated_norm_rejects_bad_inputs():
    o, z, weight, rows = _deltanet_out(4, 16, 24, 0, seed=5)
    with pytest.raises(ValueError, match=r"gated_norm z: expected bfloat16 \[1, 64\]"):
        fp8_gemv(o, rows, gated_norm=(z[:, :48], weight, 1e-6))
    with pytest.raises(ValueError, match="gated_norm z: expected bfloat16"):
        fp8_gemv(o, rows, gated_norm=(z.float(), weight, 1e-6))
    with pytest.raises(ValueError, match="gated_norm z: .* strides"):
        fp8_gemv(o, rows, gated_norm=(torch.cat([z, z], dim=1)[:, ::2], weight, 1e-6))
    with pytest.raises(ValueError, match="Dv dividing K=64"):
        fp8_gemv(o, rows, gated_norm=(z, weight[:12].contiguous(), 1e-6))
    with pytest.raises(ValueError, match="gated_norm weight: expected a contiguous"):
        fp8_gemv(o, rows, gated_norm=(z, torch.cat([weight, weight])[::2], 1e-6))
    with pytest.raises(ValueError, match="gated_norm weight"):
        fp8_gemv(o, rows, gated_norm=(z, weight.view(4, 4), 1e-6))


def _in_proj(n: int, tail_rows: int, k: int, c: int, kc: int, slots: int, seed: int):
    """in_proj at one decode row: FP8 rows (+ a bf16 tail, DeltaNet's b|a), the conv weight `[C, Kc]` and a
    random conv state pool `[slots, Kc - 1, C]` (bf16, as the engine keeps it)."""
    g = torch.Generator().manual_seed(seed)
    tail = [(torch.randn(tail_rows, k, generator=g) * 0.1).to(torch.bfloat16).to(DEVICE)] if tail_rows else []
    rows = stack_fp8([quantize_fp8(torch.randn(n, k, generator=g) * 0.05).to(DEVICE)], tail)
    weight = (torch.randn(c, kc, generator=g) * 0.5).to(torch.bfloat16).to(DEVICE)
    state = torch.randn(slots, kc - 1, c, generator=g).to(torch.bfloat16).to(DEVICE)
    return rows, weight, state


def _bits(t: torch.Tensor) -> torch.Tensor:
    """bf16 as its bits: equal means bit-identical (-0 and +0 differ; NaN equals the same NaN)."""
    return t.view(torch.int16)


def _conv_steps(rows, weight, state, slot_seq, config, seed: int) -> None:
    """One decode row a step, each into the slot of `slot_seq` (-1: padded): the fused GEMV + conv against
    `fp8_gemv` then `causal_conv1d_update` on a copy of the pool, bit for bit: proj (in a poisoned column
    slice), mixed and the whole pool after every step, so each step reads the state the one before rolled."""
    g = torch.Generator().manual_seed(seed)
    c, k, n = weight.shape[0], rows.data.shape[1], rows.rows
    pool = state.clone()
    for slot in slot_seq:
        x = torch.randn(1, k, generator=g).to(torch.bfloat16).to(DEVICE)
        s = torch.tensor([slot], dtype=torch.int32, device=DEVICE)
        before = state.clone()
        wide = torch.full((1, n + 5), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        proj, mixed = fp8_gemv(x, rows, out=wide[:, 2 : 2 + n], config=config, conv=(weight, state, s))
        want = fp8_gemv(x, rows, config=config)
        want_mixed = causal_conv1d_update(want[:, :c], weight, pool, s)
        assert proj.data_ptr() == wide[:, 2:].data_ptr() and mixed.shape == (1, c)
        assert torch.equal(_bits(proj), _bits(want)), slot
        assert torch.equal(_bits(mixed), _bits(want_mixed)), (slot, (mixed - want_mixed).abs().max())
        assert torch.equal(_bits(state), _bits(pool)), slot
        assert wide[:, :2].isnan().all() and wide[:, 2 + n :].isnan().all()
        if slot < 0:  # padded: zeros out, the pool untouched
            assert torch.equal(_bits(state), _bits(before)) and not mixed.any()
        else:  # and the two launches are the conv: within bf16 of the fp32 reference on the bf16 proj
            ref_mixed, ref_state = causal_conv1d_update_ref(want[:, :c], weight, before, s)
            assert torch.allclose(mixed.float(), ref_mixed, rtol=2**-7, atol=1e-3)
            assert torch.equal(_bits(state), _bits(ref_state))


@pytest.mark.parametrize(
    ("n", "tail_rows", "c", "kc", "block_g", "split"),
    [
        (40, 7, 37, 4, 2, 1),  # C no multiple of BLOCK_N: the tile of rows 32-47 holds conv channels, z, b|a
        (40, 7, 37, 4, 2, 2),  # the same, split-K (the last split's epilogue)
        (48, 0, 48, 4, 2, 3),  # every row a conv channel, whole tiles; K = 128 in 3 splits: the third empty
        (24, 9, 20, 2, 4, 2),  # Kc = 2: one state entry, nothing to shift
        (30, 4, 30, 5, 2, 1),  # Kc = 5: four state entries; the conv channels end where the bf16 tail starts
    ],
)
def test_conv_fused_is_bit_exact(n, tail_rows, c, kc, block_g, split):
    """The GEMV with DeltaNet's conv update in its epilogue equals the two launches bit for bit, over steps
    into slots 2, 2, padded, 0, 2 of a pool of 3 (the rolled state read back; a padded row leaves it)."""
    k = 128 if split == 3 else 96
    rows, weight, state = _in_proj(n, tail_rows, k, c, kc, slots=3, seed=n + c + kc + split)
    _conv_steps(rows, weight, state, [2, 2, -1, 0, 2], GemvConfig(16, block_g, 4, split), seed=split)


def test_conv_rejects_bad_inputs():
    rows, weight, state = _in_proj(24, 4, 64, 20, 4, slots=2, seed=9)
    x = torch.randn(1, 64).to(torch.bfloat16).to(DEVICE)
    s = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"conv weight: expected \[C, Kc\] .* 0 < C <= 28"):
        fp8_gemv(x, rows, conv=(torch.zeros(29, 4, dtype=torch.bfloat16, device=DEVICE), state, s))
    with pytest.raises(ValueError, match="Kc >= 2"):
        fp8_gemv(x, rows, conv=(weight[:, :1], state[:, :0], s))
    with pytest.raises(ValueError, match="conv weight: expected .* unit column stride"):
        fp8_gemv(x, rows, conv=(weight.t().contiguous().t(), state, s))
    with pytest.raises(ValueError, match=r"conv state: expected \[slots, 3, 20\]"):
        fp8_gemv(x, rows, conv=(weight, state[:, :2], s))
    with pytest.raises(ValueError, match=r"conv state: expected \[slots, 3, 20\]"):
        fp8_gemv(x, rows, conv=(weight, state.transpose(1, 2).contiguous(), s))
    with pytest.raises(ValueError, match="conv state: .* unit channel stride"):
        fp8_gemv(x, rows, conv=(weight, torch.cat([state, state], -1)[..., ::2], s))
    with pytest.raises(ValueError, match=r"conv slot: expected int32 or int64 \[1\]"):
        fp8_gemv(x, rows, conv=(weight, state, torch.zeros(2, dtype=torch.int32, device=DEVICE)))
    with pytest.raises(ValueError, match="conv slot: expected int32 or int64"):
        fp8_gemv(x, rows, conv=(weight, state, s.float()))


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


@pytest.mark.gpu
@pytest.mark.parametrize("tail_rows", [0, 64])
def test_gated_norm_fused_real_shape(tail_rows):
    """Qwen3.6's DeltaNet out_proj (Hv = 32 heads of Dv = 128, K = 4096, N = 2048) at the production launch.
    Exact where the math is identical: o of +-{1/2, 1, 2} times a power of two a head sums its squares
    exactly in any order, so the fused kernel must equal gated_rmsnorm + fp8_gemv bit for bit (indexing,
    sigmoid, weight, rounding, split-K). On random o the two kernels' sums of squares run in different
    orders (`fp8_gemm._gemv_x`): within 1e-3 of the two launches and 5e-3 of fp32, over 50 draws."""
    o, z, weight, rows = _deltanet_out(32, 128, 2048, tail_rows, seed=36)
    g = torch.Generator().manual_seed(37)
    levels = torch.tensor([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0])[torch.randint(0, 6, (1, 4096), generator=g)]
    exact = (levels * 2.0 ** torch.randint(-6, 4, (32,), generator=g).repeat_interleave(128)).to(DEVICE)
    for _ in range(2):  # the split-K counters reset
        out = fp8_gemv(exact.bfloat16(), rows, gated_norm=(z, weight, 1e-6))
        assert torch.equal(out, _two_launches(exact.bfloat16(), z, weight, 1e-6, rows))
    data = torch.cat([rows.data.float() * rows.scale[:, None]] + ([rows.tail.float()] if tail_rows else []))
    for seed in range(50):
        o = torch.randn(1, 4096, generator=torch.Generator().manual_seed(seed)) * 3
        o = o.to(torch.bfloat16).to(DEVICE)
        out = fp8_gemv(o, rows, gated_norm=(z, weight, 1e-6))
        want = _two_launches(o, z, weight, 1e-6, rows)
        _check(out, want.float(), tol=1e-3, exact_weights=False)
        normed = gated_rmsnorm_ref(o.view(-1, 128), z.view(-1, 128), weight, 1e-6).view(1, -1)
        _check(out, normed @ data.t(), tol=5e-3, exact_weights=False)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [0, 4])  # the production launch (one split at this shape); split-K
def test_conv_fused_real_shape(split):
    """Qwen3.6's DeltaNet in_proj (FP8 qkv|z 8192 + 4096 rows, bf16 b|a 64, K = 2048) with its conv (C =
    8192, Kc = 4): the math is the same ops in the same order, so bit-identical to the two launches, state
    included, over 20 steps in slots of a pool of 8 (a race between the tile's reads of the old state and
    its writes of the rolled one would show as a mismatch in some step)."""
    rows, weight, state = _in_proj(12288, 64, 2048, 8192, 4, slots=8, seed=36)
    slot_seq = [3, 3, 5, -1, 3, 0, 7, 7, 7, 3] * 2
    _conv_steps(rows, weight, state, slot_seq, GemvConfig(16, 16, 4, split) if split else None, seed=36)
