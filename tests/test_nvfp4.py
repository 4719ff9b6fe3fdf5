"""NVFP4 / FP8 codec: hand-computed bit-exact vectors, ModelOpt's rounding and scale rules, round trips."""

import pytest
import torch
from batchinfer.kernels.nvfp4 import (
    E2M1_VALUES,
    FP8Weight,
    NVFP4Weight,
    ct_global_from_tensor_scale,
    dequantize_nvfp4,
    pack_e2m1,
    quantize_fp8,
    quantize_nvfp4,
    quantize_nvfp4_stack,
    round_to_e2m1_codes,
    tensor_scale_from_ct_global,
    unpack_e2m1,
)

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def codes_of(values: list[float]) -> list[int]:
    return round_to_e2m1_codes(torch.tensor(values, dtype=torch.float32)).tolist()


def up(x: float) -> float:
    return torch.nextafter(torch.tensor(x), torch.tensor(100.0)).item()


def down(x: float) -> float:
    return torch.nextafter(torch.tensor(x), torch.tensor(-100.0)).item()


def test_table_matches_the_format():
    assert E2M1_VALUES.dtype == torch.float32
    assert E2M1_VALUES[:8].tolist() == GRID
    assert E2M1_VALUES[8:].tolist() == [-v for v in GRID]
    assert torch.signbit(E2M1_VALUES[8])  # code 8 is negative zero


def test_all_16_codes_from_exact_grid_values():
    assert codes_of(GRID) == list(range(8))
    assert codes_of([-v for v in GRID[1:]]) == list(range(9, 16))
    # code 8: ModelOpt sets the sign bit from `x < 0`, so only a negative value that rounds to zero gets it.
    assert codes_of([-0.2, -0.25, -1e-30]) == [8, 8, 8]


def test_negative_zero_input_gives_code_0():
    assert codes_of([-0.0, 0.0]) == [0, 0]


@pytest.mark.parametrize(
    "bound, tie_code",
    [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6)],
)
def test_every_threshold_ties_to_even_and_neighbours_round_to_nearest(bound, tie_code):
    below = GRID.index(max(v for v in GRID if v < bound))
    above = GRID.index(min(v for v in GRID if v > bound))
    assert codes_of([down(bound), bound, up(bound)]) == [below, tie_code, above]
    assert codes_of([-down(bound), -bound, -up(bound)]) == [8 | below, 8 | tie_code, 8 | above]
    assert tie_code % 2 == 0  # the even neighbour: mantissa bit 0


def test_saturates_above_six():
    assert codes_of([6.0, up(6.0), 6.5, 100.0, float("inf"), -1e9]) == [7, 7, 7, 7, 7, 15]


def test_rounding_matches_a_plain_nearest_even_reference_on_a_dense_sweep():
    x = torch.cat([torch.arange(-7 * 256, 7 * 256 + 1) / 256.0, torch.randn(10000) * 3])
    grid = torch.tensor(GRID)
    dist = (x.abs().unsqueeze(-1) - grid).abs()  # [n, 8]
    best = dist.min(-1, keepdim=True).values
    # among the nearest grid points take the even code (ties to even)
    candidates = torch.where(dist == best, torch.arange(8) % 2, 10) * 8 + torch.arange(8)
    magnitude = candidates.min(-1).values % 8
    expected = magnitude | ((x < 0).long() << 3)
    assert torch.equal(round_to_e2m1_codes(x).long(), expected)


def test_pack_nibble_order_by_hand():
    codes = torch.tensor([[1, 2, 3, 4], [15, 0, 8, 7]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0x43], [0x0F, 0x78]]
    assert torch.equal(unpack_e2m1(torch.tensor([[0x21, 0x43], [0x0F, 0x78]], dtype=torch.uint8)), codes)


def test_pack_unpack_round_trip_all_bytes():
    all_bytes = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    assert torch.equal(pack_e2m1(unpack_e2m1(all_bytes)), all_bytes)


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="even"):
        pack_e2m1(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="0..15"):
        pack_e2m1(torch.tensor([16, 0], dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        pack_e2m1(torch.zeros(2, dtype=torch.int32))


def test_dequantize_formula_by_hand():
    # one row, K = 32: block 0 has scale 2.0, block 1 has scale 0.375; tensor scale 0.5
    codes = torch.tensor([list(range(16)) + [7, 15, 1, 9] + [0] * 12], dtype=torch.uint8)
    block_scale = torch.tensor([[2.0, 0.375]]).to(torch.float8_e4m3fn)
    w = NVFP4Weight(pack_e2m1(codes), block_scale, torch.tensor(0.5))
    # block 0: value * 2.0 * 0.5 = value; block 1: value * 0.375 * 0.5 = value * 0.1875
    expected = GRID + [-v for v in GRID] + [6 * 0.1875, -6 * 0.1875, 0.5 * 0.1875, -0.5 * 0.1875] + [0.0] * 12
    assert w.dequantize().tolist() == [expected]
    assert w.dequantize(torch.bfloat16).dtype == torch.bfloat16
    assert w.shape == (1, 32)
    assert torch.equal(dequantize_nvfp4(w.packed, w.block_scale, w.tensor_scale), w.dequantize())


def test_quantize_default_scales_by_hand():
    # amax 2688 -> tensor_scale 1.0; block 0 amax 2688 -> block scale 448, so w/448 lands on grid
    # points and ties; block 1 amax 6 -> block scale 1.0, so its values are quantized as they are.
    on_grid = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -5.0, 0.1, 4.4, 0, 0, 0]
    block0 = [448 * v for v in on_grid]
    block1 = [6.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -0.0, -0.1]
    q = quantize_nvfp4(torch.tensor([block0 + block1]))
    assert q.tensor_scale.item() == 1.0 and q.tensor_scale.shape == ()
    assert q.block_scale.float().tolist() == [[448.0, 1.0]]
    assert unpack_e2m1(q.packed).tolist() == [
        [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 14, 0, 6, 0, 0, 0]
        + [7, 1, 2, 3, 4, 5, 6, 15, 9, 10, 11, 12, 13, 14, 0, 8]
    ]


def test_quantize_uses_the_e4m3_rounded_block_scale():
    # tensor_amax 2688 -> tensor scale 1; block amax 1800 -> 300, which e4m3 rounds to 288
    # (step 32 in [256, 512));
    # 1800 / 288 = 6.25 saturates to code 7; 576 / 288 = 2 is code 4.
    w = torch.tensor([[1800.0, 576.0] + [0.0] * 14])
    q = quantize_nvfp4(w, tensor_amax=2688.0)
    assert q.block_scale.float().item() == 288.0
    assert unpack_e2m1(q.packed)[0, :2].tolist() == [7, 4]


def test_tensor_amax_gives_exact_power_of_two_tensor_scale():
    # tensor_amax 168 -> tensor scale 168 / 2688 = 1/16; block amax 3 -> block scale 3 / (6/16) = 8;
    # codes round w / 0.5 = 2w
    w = torch.tensor([[3.0, 0.125, 0.375, -1.25] + [0.0] * 12])
    q = quantize_nvfp4(w, tensor_amax=168.0)
    assert q.tensor_scale.item() == 1 / 16
    assert q.block_scale.float().tolist() == [[8.0]]
    assert unpack_e2m1(q.packed)[0, :4].tolist() == [7, 0, 2, 12]  # 6, 0.25->0, 0.75->1, -2.5->-2


def test_tiny_block_scale_clamps_to_e4m3_min_subnormal():
    # tensor scale 1; block amax 2^-10 -> 2^-10/6 < 2^-9, clamped up to 2^-9 (never 0x00)
    tiny = 2.0**-10
    w = torch.tensor([[2688.0] + [0.0] * 15 + [tiny, -tiny, tiny / 2, 3 * tiny] + [0.0] * 12])
    w[0, 19] = tiny  # keep the block amax at 2^-10
    q = quantize_nvfp4(w)
    assert q.block_scale.float()[0, 1].item() == 2.0**-9
    # w / 2^-9: 0.5 -> 1, -0.5 -> 9, 0.25 -> 0 (tie to even)
    assert unpack_e2m1(q.packed)[0, 16:20].tolist() == [1, 9, 0, 1]


def test_huge_block_scale_clamps_to_448():
    # a given tensor_amax below the weight's amax: block amax 6000 wants scale 1000, clamped to 448
    w = torch.tensor([[6000.0, 448 * 5.0, -448 * 3.0] + [0.0] * 13])
    q = quantize_nvfp4(w, tensor_amax=2688.0)
    assert q.block_scale.float().item() == 448.0
    assert unpack_e2m1(q.packed)[0, :3].tolist() == [7, 6, 13]  # 13.4 saturates; 5 ties down to 4; -3


def test_zero_blocks_get_scale_one_and_zero_tensor_is_exact():
    w = torch.zeros(2, 32)
    w[0, :16] = torch.linspace(-3, 3, 16)
    q = quantize_nvfp4(w)
    assert q.block_scale.float()[0, 1].item() == 1.0 and q.block_scale.float()[1].tolist() == [1.0, 1.0]
    assert unpack_e2m1(q.packed)[1].tolist() == [0] * 32
    z = quantize_nvfp4(torch.zeros(3, 16))
    assert z.tensor_scale.item() == 1.0
    assert torch.equal(z.dequantize(), torch.zeros(3, 16))


def test_negative_zero_and_tiny_negatives_dequantize_to_zero():
    w = torch.tensor([[6.0, -0.0, -0.1] + [0.0] * 13])
    q = quantize_nvfp4(w, tensor_amax=2688.0 * 6 / 448)  # tensor scale 1/448 -> block scale 448 -> w / 1
    assert unpack_e2m1(q.packed)[0, :3].tolist() == [7, 0, 8]
    d = q.dequantize()[0]
    assert d[1].item() == 0 and d[2].item() == 0 and torch.signbit(d[2])


def test_quantize_rejects_bad_shapes_and_values():
    with pytest.raises(ValueError, match="K = 24"):
        quantize_nvfp4(torch.zeros(2, 24))
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        quantize_nvfp4(torch.zeros(16))
    bad = torch.zeros(2, 16)
    bad[1, 3] = float("nan")
    with pytest.raises(ValueError, match=r"1 non-finite values \(first at index \[1, 3\]\)"):
        quantize_nvfp4(bad)
    with pytest.raises(ValueError, match="tensor_amax"):
        quantize_nvfp4(torch.ones(2, 16), tensor_amax=0.0)


def test_stack_quantization_is_bit_identical_to_one_matrix_at_a_time():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(5, 8, 64, generator=g) * torch.tensor([1.0, 1e-3, 0.0, 40.0, 2.0])[:, None, None]
    w[4, :, :16] = 0.0  # an all-zero block beside non-zero ones
    for b, got in enumerate(quantize_nvfp4_stack(w)):
        want = quantize_nvfp4(w[b])
        assert torch.equal(got.packed, want.packed)
        assert torch.equal(got.block_scale.view(torch.uint8), want.block_scale.view(torch.uint8))
        assert torch.equal(got.tensor_scale, want.tensor_scale)
    bad = w.clone()
    bad[2, 1, 5] = float("inf")
    with pytest.raises(ValueError, match=r"first at index \[2, 1, 5\]"):
        quantize_nvfp4_stack(bad)


def test_weight_validation_names_the_field():
    packed, ts = torch.zeros(4, 16, dtype=torch.uint8), torch.ones(())
    scale = torch.ones(4, 2).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="packed"):
        NVFP4Weight(packed.to(torch.int8), scale, ts)
    with pytest.raises(ValueError, match="K = 12"):
        NVFP4Weight(torch.zeros(4, 6, dtype=torch.uint8), scale, ts)
    with pytest.raises(ValueError, match=r"block_scale: expected float8_e4m3fn \[4, 2\]"):
        NVFP4Weight(packed, torch.ones(4, 3).to(torch.float8_e4m3fn), ts)
    with pytest.raises(ValueError, match="block_scale"):
        NVFP4Weight(packed, torch.ones(4, 2), ts)
    with pytest.raises(ValueError, match="tensor_scale"):
        NVFP4Weight(packed, scale, torch.ones(2))
    with pytest.raises(ValueError, match="tensor_scale"):
        NVFP4Weight(packed, scale, torch.ones((), dtype=torch.float64))
    with pytest.raises(ValueError, match="data"):
        FP8Weight(torch.ones(4, 4), ts)
    with pytest.raises(ValueError, match="scale"):
        FP8Weight(torch.ones(4, 4).to(torch.float8_e4m3fn), torch.ones(3))


def test_weight_properties_and_to():
    scale = torch.ones(4, 2).to(torch.float8_e4m3fn)
    w = NVFP4Weight(torch.zeros(4, 16, dtype=torch.uint8), scale, torch.ones(1))
    assert w.shape == (4, 32) and w.tensor_scale.shape == ()  # a CT-style [1] scalar is stored as []
    assert w.nbytes == 4 * 16 + 4 * 2 + 4
    moved = w.to("meta")
    assert moved is not w and moved.packed.device.type == "meta" and w.packed.device.type == "cpu"
    f = FP8Weight(torch.ones(3, 5).to(torch.float8_e4m3fn), torch.tensor(2.0))
    assert f.shape == (3, 5) and f.nbytes == 15 + 4
    assert f.to("meta").data.device.type == "meta"
    assert torch.equal(f.dequantize(), torch.full((3, 5), 2.0))


def test_nvfp4_round_trip_error_within_the_format_bound():
    # Bound, per element x of a block with amax b (block scale d = b / (6 s) in e4m3's normal range):
    # the stored scale d' is within a factor (1 +- 2^-4) of d (3 mantissa bits, round to nearest), so
    # |x| / (d' s) <= 6.4, and rounding onto E2M1 errs by at most half its widest step (4 -> 6), i.e. 1 unit
    # of d' s (saturating 6.4 -> 6 errs less). Hence |x - x'| <= d' s <= (1 + 2^-4) * b / 6, plus fp32 slack.
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * torch.logspace(-2, 1, 64).unsqueeze(1)
    w[5, 32:48] = 0.0
    q = quantize_nvfp4(w)
    assert q.block_scale.float().min() >= 2.0**-6  # premise: every block scale is an e4m3 normal
    err = (q.dequantize() - w).abs().unflatten(-1, (16, 16))
    block_amax = w.abs().unflatten(-1, (16, 16)).amax(-1, keepdim=True)
    bound = (1 + 2.0**-4) * block_amax / 6 + 1e-6 * block_amax
    assert bool((err <= bound).all())
    assert float((err / block_amax.clamp(min=1e-30)).max()) > 0.1  # the bound is not vacuous
    assert torch.equal(q.dequantize()[5, 32:48], torch.zeros(16))


def test_nvfp4_round_trip_is_exact_on_representable_weights():
    codes = torch.randint(0, 16, (8, 64), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    codes[:, 0] = 7  # every block holds 6 * scale so the recovered scales are exact
    codes[:, 16] = 15
    codes[:, 32] = 7
    codes[:, 48] = 15
    scale = torch.full((8, 4), 448.0).to(torch.float8_e4m3fn)
    original = NVFP4Weight(pack_e2m1(codes), scale, torch.tensor(0.25))
    w = original.dequantize()
    q = quantize_nvfp4(w)
    assert torch.equal(q.dequantize(), w)


def test_fp8_by_hand_and_round_trip_bound():
    w = torch.tensor([[448.0, 300.0, 0.3, -0.0], [-448.0, 2.0**-9, 2.0**-11, 17.0]])
    q = quantize_fp8(w)
    assert q.scale.item() == 1.0
    # e4m3: 300 -> 288 (step 32), 0.3 -> 0.3125 (step 1/32), 2^-11 is half the smallest subnormal and
    # ties to 0, 17 ties between 16 and 18 to the even mantissa 16
    assert q.data.float().tolist() == [[448.0, 288.0, 0.3125, 0.0], [-448.0, 2.0**-9, 0.0, 16.0]]
    # bound: 3 mantissa bits -> relative error <= 2^-4 for |x/scale| >= 2^-6 (normals); absolute error
    # <= half the subnormal step 2^-10 times the scale below that.
    g = torch.Generator().manual_seed(2)
    w = torch.randn(32, 64, generator=g) * 7
    q = quantize_fp8(w)
    assert q.scale.item() == pytest.approx(float(w.abs().max()) / 448, rel=1e-7)
    err = (q.dequantize() - w).abs()
    bound = torch.maximum(w.abs() * 2.0**-4, torch.full_like(w, 2.0**-10 * q.scale.item())) * (1 + 1e-6)
    assert bool((err <= bound).all())
    assert float((err / w.abs()).max()) > 0.03
    zero = quantize_fp8(torch.zeros(2, 3))
    assert zero.scale.item() == 0.0 and torch.equal(zero.dequantize(), torch.zeros(2, 3))


def test_compressed_tensors_global_scale_inversion():
    s = tensor_scale_from_ct_global(torch.tensor([4.0]))
    assert s.shape == () and s.dtype == torch.float32 and s.item() == 0.25
    g = ct_global_from_tensor_scale(torch.tensor(0.25))
    assert g.shape == (1,) and g.item() == 4.0
    # a non-power-of-two scale survives the double reciprocal to within one fp32 ulp
    amax = torch.rand(1000, generator=torch.Generator().manual_seed(3)) * 10 + 1e-3
    ts = amax / 2688.0
    back = torch.stack([tensor_scale_from_ct_global(ct_global_from_tensor_scale(t)) for t in ts])
    ulp = torch.nextafter(ts, torch.full_like(ts, float("inf"))) - ts
    assert bool(((back - ts).abs() <= ulp).all())
    # CT's dequantization rule e2m1 * (block / global) equals ours with the converted tensor scale
    q = quantize_nvfp4(torch.randn(4, 32, generator=torch.Generator().manual_seed(4)))
    glob = ct_global_from_tensor_scale(q.tensor_scale)
    ct_w = NVFP4Weight(q.packed, q.block_scale, tensor_scale_from_ct_global(glob)).dequantize()
    assert torch.allclose(ct_w, q.dequantize(), rtol=2e-7, atol=0)
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="weight_global_scale"):
            tensor_scale_from_ct_global(torch.tensor([bad]))


@pytest.mark.gpu
def test_cuda_quantization_is_bit_identical_to_cpu():
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(256, 512, generator=g) * torch.logspace(-4, 2, 256).unsqueeze(1)).to(torch.bfloat16)
    w[0, :16] = 0.0
    for amax in (None, 0.5):  # 0.5 is below max |w|: block scales clamp to 448 and codes saturate
        cpu, gpu = quantize_nvfp4(w, tensor_amax=amax), quantize_nvfp4(w.cuda(), tensor_amax=amax)
        assert gpu.packed.is_cuda and gpu.tensor_scale.is_cuda
        assert torch.equal(gpu.packed.cpu(), cpu.packed)
        assert torch.equal(gpu.block_scale.cpu().view(torch.uint8), cpu.block_scale.view(torch.uint8))
        assert gpu.tensor_scale.item() == cpu.tensor_scale.item()
        assert torch.equal(gpu.dequantize(torch.bfloat16).cpu(), cpu.dequantize(torch.bfloat16))
    f_cpu, f_gpu = quantize_fp8(w.float()), quantize_fp8(w.float().cuda())
    assert torch.equal(f_gpu.data.cpu().view(torch.uint8), f_cpu.data.view(torch.uint8))
    assert f_gpu.scale.item() == f_cpu.scale.item()
    assert not torch.isnan(f_gpu.dequantize()).any()
    scales = torch.rand(1000, generator=g) * 10 + 1e-3
    for fn in (tensor_scale_from_ct_global, ct_global_from_tensor_scale):
        assert all(fn(s.cuda()).item() == fn(s).item() for s in scales)
