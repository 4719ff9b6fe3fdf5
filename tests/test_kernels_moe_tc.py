"""The tensor-core MoE kernels (`moe_tc`) against the fp32 reference; CPU (interpreter), real GPU shapes."""

import pytest
import torch
from batchinfer.kernels import moe
from batchinfer.kernels.moe import (
    MoEConfig,
    MoEDecodeConfig,
    MoEGroupedMMConfig,
    moe_experts,
    moe_experts_ref,
    moe_route,
)
from batchinfer.kernels.moe_grouped_mm import dequantize_experts
from batchinfer.kernels.moe_tc import (
    PAIR_WORD_BITS,
    MoETCConfig,
    pair_groups,
    pair_moe_weights,
    pair_scales,
    slot_k,
)
from test_kernels_moe import DEVICE, _rel, _route, _weights

CFGS = [
    MoETCConfig(16, (16, 1, 1, 1), (16, 1, 1, 2)),
    MoETCConfig(32, (64, 4, 2, 2), (64, 4, 2, 1)),  # I = 96 not a multiple of the tile: masked rows
]


def test_pairing_moves_every_code_to_its_slot():
    """Word t of each 32-code block holds group A's codes at K 2t, 2t+1, 2t+8, 2t+9 (slots 0-3) and group
    B's (slots 4-7), code bit b of slot j at word bit PAIR_WORD_BITS[j][b]; every word bit is used once."""
    assert sorted(slot_k.fn(t, j) for t in range(4) for j in range(8)) == list(range(32))
    assert [[slot_k.fn(t, j) for j in range(4)] for t in range(4)] == [
        [2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9] for t in range(4)
    ]
    assert sorted(bit for bits in PAIR_WORD_BITS for bit in bits) == list(range(32))
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (3, 5, 32), dtype=torch.uint8, generator=g)  # K = 64 codes a row
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(3, 5, 2, 32).long()  # [.., block, k]
    words = pair_groups(packed).reshape(3, 5, 2, 4, 4).long()
    words = sum(words[..., i] << 8 * i for i in range(4))  # [.., block, t]
    for t in range(4):
        for j, bits in enumerate(PAIR_WORD_BITS):
            k = slot_k.fn(t, j)
            got = sum(((words[..., t] >> pos) & 1) << b for b, pos in enumerate(bits))
            assert torch.equal(got, codes[..., k])
    with pytest.raises(ValueError, match="multiple of 32"):
        pair_groups(packed[..., :8])


def test_paired_scales_put_a_rows_64_code_block_in_one_word_rows_adjacent():
    """`pair_scales`: group g of row n of expert e at e 4N + (g // 4) 4 E N + 4 n + g % 4 (`scale_offset`
    with the expert's base), zero-padded to a whole word where K is not a multiple of 64 codes."""
    g = torch.Generator().manual_seed(2)
    scale = torch.randint(1, 128, (3, 5, 6), dtype=torch.uint8, generator=g)  # K = 96 codes: 6 groups
    paired = pair_scales(scale)
    assert paired.shape == (2, 3, 5, 4)
    flat = paired.reshape(-1)
    e, n, grp = torch.meshgrid(torch.arange(3), torch.arange(5), torch.arange(6), indexing="ij")
    offs = e * 4 * 5 + (grp // 4) * 4 * 3 * 5 + 4 * n + grp % 4
    assert torch.equal(flat[offs], scale)
    assert not paired[1, ..., 2:].any()  # groups 6 and 7: padding
    scale[2, 4, 5] |= 0x80  # a negative scale: the kernels read seven bits
    with pytest.raises(ValueError, match="sign bit"):
        pair_scales(scale)


@pytest.mark.parametrize("cfg", CFGS)
@pytest.mark.parametrize("shared", [True, False])
def test_tensor_core_path_matches_reference(monkeypatch, cfg, shared):
    w = _weights(6, 64, 96 if cfg.block_m == 32 else 32, True, shared, seed=51)
    t, a = 5, 2 + shared
    ids, route_w, g = _route(t, a, 6 + shared, seed=52)
    ids[1:, 0] = ids[0, 0]  # one expert serving every token: a tile of several entries
    h = torch.randn(t, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    paired = pair_moe_weights(w)
    real_empty = torch.empty
    monkeypatch.setattr(
        torch,
        "empty",
        lambda *s, **k: (
            real_empty(*s, **k).fill_(float("nan"))
            if k.get("dtype") == torch.bfloat16
            else real_empty(*s, **k)
        ),
    )  # poison outputs
    out = moe_experts(h, ids, route_w, paired, config=cfg)
    assert out.shape == (t, 64) and out.dtype == torch.bfloat16
    ref = moe_experts_ref(h, ids, route_w, w)
    assert _rel(out, ref) < 5e-3
    decode = moe_experts(h, ids, route_w, w, config=MoEDecodeConfig((16, 2, 4, 1), (16, 2, 4, 1)))
    assert _rel(out, decode) < 5e-3


@pytest.mark.parametrize("steps,d", [(2, 128), (4, 256)])
def test_several_blocks_an_iteration_walk_the_whole_k(steps, d):
    """STEPS blocks an iteration over K = d (gate_up: two iterations, each with its own 2 STEPS scale
    bytes a row) and K = 64 (down: one iteration, STEPS 4 falling back to 2), distinct scales
    everywhere: a wrong code or scale offset shows."""
    w = _weights(4, d, 64, True, False, seed=71)
    ids, route_w, g = _route(6, 2, 4, seed=72)
    ids[1:, 0] = ids[0, 0]
    h = torch.randn(6, d, generator=g).to(torch.bfloat16).to(DEVICE)
    cfg = MoETCConfig(16, (16, 1, 1, steps), (32, 1, 1, steps))
    out = moe_experts(h, ids, route_w, pair_moe_weights(w), config=cfg)
    assert _rel(out, moe_experts_ref(h, ids, route_w, w)) < 5e-3


def test_tensor_core_path_covers_the_scale_and_code_range():
    """Extreme block scales (e4m3 subnormal and near max) and every E2M1 code, incl. the subnormal 0.5."""
    g = torch.Generator().manual_seed(3)
    w = _weights(2, 32, 32, True, False, seed=61)
    codes = torch.arange(256, dtype=torch.uint8).reshape(16, 16)  # every byte: all code pairs
    w.w13[:] = codes.repeat(4, 1)[: w.w13.shape[1]].to(DEVICE)
    e4m3 = torch.tensor([2**-9, 2**-6, 1.0, 448.0]).to(torch.float8_e4m3fn).view(torch.uint8)
    w.w13_scale[:] = e4m3[torch.randint(0, 4, tuple(w.w13_scale.shape), generator=g)].to(DEVICE)
    ids, route_w, g = _route(3, 2, 2, seed=62)
    h = torch.randn(3, 32, generator=g).to(torch.bfloat16).to(DEVICE)
    out = moe_experts(h, ids, route_w, pair_moe_weights(w), config=CFGS[0])
    assert _rel(out, moe_experts_ref(h, ids, route_w, w)) < 5e-3


@pytest.mark.parametrize(
    "cfg", [MoEDecodeConfig((16, 2, 4, 1), (16, 2, 4, 1)), MoEDecodeConfig((32, 4, 2, 3), (64, 2, 1, 2))]
)
def test_decode_path_reads_the_paired_layout(cfg):
    """The GEMV decode path on paired experts: two scale groups an int64, x gathered to match, the
    gate_up output stored in the order the down kernel reads (K = 64 and 96: one and a half pairs of
    int64 per K step at BLOCK_G 2 and 4, and splits)."""
    w = _weights(5, 64, 96, True, True, seed=81)
    ids, route_w, g = _route(4, 3, 6, seed=82)
    h = torch.randn(4, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    ours = moe_experts(h, ids, route_w, pair_moe_weights(w), config=cfg)
    assert _rel(ours, moe_experts_ref(h, ids, route_w, w)) < 5e-3
    assert _rel(ours, moe_experts(h, ids, route_w, w, config=cfg)) < 1e-3


def test_paired_experts_decode_to_the_same_bf16():
    """The grouped-GEMM path's expert decode reads the paired layout to the very same bf16 weights."""
    w = _weights(3, 64, 96, True, True, seed=91)
    for ours, theirs in zip(dequantize_experts(pair_moe_weights(w)), dequantize_experts(w), strict=True):
        assert torch.equal(ours.cpu(), theirs.cpu())
    ids, route_w, g = _route(3, 2, 4, seed=92)
    h = torch.randn(3, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    out = moe_experts(h, ids, route_w, pair_moe_weights(w), config=MoEGroupedMMConfig())
    assert torch.equal(out.cpu(), moe_experts(h, ids, route_w, w, config=MoEGroupedMMConfig()).cpu())


def test_paired_experts_follow_the_timed_table(monkeypatch):
    """Paired experts (the engine's): the direct path up to 8 tokens (`test_kernels_moe_direct`), `moe_tc`
    above (BLOCK_M growing with the entries an expert; never the decode path, slower at every size timed),
    then grouped_mm from ~290 entries an expert, the crossovers timed on the H200 at both models' widths."""
    monkeypatch.setattr(moe, "interpreting", lambda: False)
    assert moe._moe_configs(81, 257, paired=True) == moe.tc_config(16)  # Qwen3.6, T=9
    assert isinstance(moe._moe_configs(108, 257, paired=True), MoETCConfig)  # T=12
    assert isinstance(moe._moe_configs(288, 257, paired=True), MoETCConfig)  # T=32
    assert isinstance(moe._moe_configs(80, 128, paired=True), MoETCConfig)  # Qwen3-30B, T=10
    assert moe._moe_configs(1152, 257, paired=True).block_m == 16  # T=128
    assert moe._moe_configs(2304, 257, paired=True).block_m == 16  # T=256
    assert moe._moe_configs(4608, 257, paired=True).block_m == 32  # T=512
    assert moe._moe_configs(9216, 257, paired=True).block_m == 64  # T=1024
    assert moe._moe_configs(18432, 257, paired=True).block_m == 64  # T=2048
    assert moe._moe_configs(36864, 257, paired=True).block_m == 128  # T=4096
    assert isinstance(moe._moe_configs(73728, 257, paired=True), MoETCConfig)  # T=8192: a tie
    assert isinstance(moe._moe_configs(110592, 257, paired=True), MoEGroupedMMConfig)  # T=12288
    assert moe._moe_configs(1024, 128, paired=True).block_m == 16  # Qwen3-30B, T=128
    assert moe._moe_configs(2048, 128, paired=True).block_m == 32  # T=256
    assert moe._moe_configs(4096, 128, paired=True).block_m == 64  # T=512
    assert moe._moe_configs(16384, 128, paired=True).block_m == 128  # T=2048
    assert isinstance(moe._moe_configs(32768, 128, paired=True), MoETCConfig)  # T=4096
    assert isinstance(moe._moe_configs(65536, 128, paired=True), MoEGroupedMMConfig)  # T=8192


def test_paired_experts_run_moe_tc_by_default():
    """Without a config, a batch of several entries per expert on paired experts goes through `moe_tc`
    (the interpreter's table), and agrees with the reference and with the standard layout's path."""
    w = _weights(4, 64, 32, True, True, seed=77)
    ids, route_w, g = _route(25, 3, 5, seed=78)  # 75 entries: past the direct path's 72
    h = torch.randn(25, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    paired = pair_moe_weights(w)
    assert isinstance(moe._moe_configs(ids.numel(), 5, paired=True), MoETCConfig)
    out = moe_experts(h, ids, route_w, paired)
    assert _rel(out, moe_experts_ref(h, ids, route_w, w)) < 5e-3
    assert _rel(out, moe_experts(h, ids, route_w, w)) < 5e-3


def test_layouts_are_not_mixed_up():
    w = _weights(4, 64, 32, True, False, seed=71)
    ids, route_w, g = _route(2, 2, 4, seed=72)
    h = torch.randn(2, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    with pytest.raises(ValueError, match="paired"):
        moe_experts(h, ids, route_w, w, config=CFGS[0])
    paired = pair_moe_weights(w)
    with pytest.raises(ValueError, match="paired"):
        moe_experts(h, ids, route_w, paired, config=MoEConfig(16, (64, 64, 4, 1), (64, 64, 4, 1)))
    with pytest.raises(ValueError, match="standard"):
        pair_moe_weights(paired)
    with pytest.raises(ValueError, match="standard NVFP4 layout"):
        moe_experts_ref(h, ids, route_w, paired)
    with pytest.raises(ValueError, match="standard"):
        pair_moe_weights(_weights(4, 64, 32, False, False, seed=73))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 8, 32, 256, 1024])
@pytest.mark.parametrize(("e", "d", "i", "shared"), [(256, 2048, 512, True), (128, 2048, 768, False)])
def test_tensor_core_path_real_shapes(t, e, d, i, shared):
    w = _weights(e, d, i, True, shared, seed=t + e)
    g = torch.Generator().manual_seed(t)
    h = torch.randn(t, d, generator=g).to(torch.bfloat16).to(DEVICE)
    ids, route_w = moe_route(h @ w.router.t(), e, 8, True, shared)
    cfgs = (
        MoETCConfig(16, (64, 4, 3, 2), (64, 4, 3, 2)),
        MoETCConfig(32, (128, 8, 3, 1), (128, 8, 3, 1)),
        *(moe.tc_config(block_m) for block_m in moe.TC_TILES),
    )
    for cfg in cfgs:
        out = moe_experts(h, ids, route_w, pair_moe_weights(w), config=cfg)
        assert _rel(out, moe_experts_ref(h, ids, route_w, w)) < 5e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize(("e", "d", "i", "shared"), [(256, 2048, 512, True), (128, 2048, 768, False)])
def test_paired_decode_path_real_shapes(t, e, d, i, shared):
    """The decode path (`paired_dot8`'s PTX) on paired experts under its table's configs (the default up to
    8 tokens is the direct path since session 28)."""
    w = _weights(e, d, i, True, shared, seed=3 * t + e)
    h = torch.randn(t, d, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16).to(DEVICE)
    ids, route_w = moe_route(h @ w.router.t(), e, 8, True, shared)
    out = moe_experts(h, ids, route_w, pair_moe_weights(w), config=moe._decode_config(ids.numel()))
    assert _rel(out, moe_experts_ref(h, ids, route_w, w)) < 5e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_subnormal_block_scales_on_every_paired_path():
    """E4M3 subnormal block scales (bytes 1-7) reach bf16 exactly in `_scales_ptx` and the decode path:
    every paired path agrees with the reference when a quarter of the scales are subnormal."""
    e, d, i = 16, 256, 128
    w = _weights(e, d, i, True, False, seed=5)
    g = torch.Generator().manual_seed(6)
    for scale in (w.w13_scale, w.w2_scale):
        sub = torch.randint(1, 8, scale.shape, generator=g, dtype=torch.uint8).to(DEVICE)
        pick = (torch.rand(scale.shape, generator=g) < 0.25).to(DEVICE)
        scale.view(torch.uint8).copy_(torch.where(pick, sub, scale.view(torch.uint8)))
    paired = pair_moe_weights(w)
    for t, cfg in (
        (1, None),
        (1, moe._decode_config(8)),
        (64, MoETCConfig(16, (64, 4, 3, 4), (64, 4, 3, 4))),
        (64, moe.tc_config(64)),
    ):
        h = torch.randn(t, d, generator=g).to(torch.bfloat16).to(DEVICE)
        ids, route_w = moe_route(h @ w.router.t(), e, 8, True, False)
        out = moe_experts(h, ids, route_w, paired, config=cfg)
        assert _rel(out, moe_experts_ref(h, ids, route_w, w)) < 5e-3
    for ours, theirs in zip(dequantize_experts(paired), dequantize_experts(w), strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("e", "d", "i", "shared"), [(256, 2048, 512, True), (128, 2048, 768, False)])
def test_paired_experts_decode_to_the_same_bf16_real_shapes(e, d, i, shared):
    w = _weights(e, d, i, True, shared, seed=e)
    for ours, theirs in zip(dequantize_experts(pair_moe_weights(w)), dequantize_experts(w), strict=True):
        assert torch.equal(ours, theirs)


def _run_ptx(ptx: str, regs: dict[str, int | float]) -> dict[str, int | float]:
    """A model of the few PTX instructions `moe_tc`'s decodes use (the interpreter cannot run inline PTX):
    32-bit shf.r.wrap (a funnel shift of b:a), prmt (byte select, selector nibbles 0-3 from a, 4-7 from b),
    shl, shr, and, or, mov (of a register, from or to a pair of 16-bit ones), mul.rn.bf16x2, cvt.f32.f16,
    and fp32 mul and fma (in float64: exact products, the sums rounded once less than the GPU's). `regs`:
    the inputs by operand name; returns every register."""
    regs = dict(regs)
    val = lambda t: int(t, 0) if t[0].isdigit() else regs[t]
    for ins in ptx.strip("{} \n").split(";"):
        ins = ins.strip()
        if not ins or ins.startswith(".reg"):
            continue
        op, rest = ins.split(None, 1)
        d, *a = [x.strip() for x in rest.split(",")]
        if op == "mov.b32" and d.startswith("{"):  # split a 32-bit register into its halves
            regs[d.strip("{ ")], regs[a[0].strip("} ")] = val(a[1]) & 0xFFFF, val(a[1]) >> 16
        elif op == "cvt.f32.f16":
            regs[d] = torch.tensor([val(a[0])], dtype=torch.int32).to(torch.int16).view(torch.float16).item()
        elif op == "mul.rn.f32":
            regs[d] = val(a[0]) * val(a[1])
        elif op == "fma.rn.f32":
            regs[d] = val(a[0]) * val(a[1]) + val(a[2])
        elif op == "shf.r.wrap.b32":
            regs[d] = ((val(a[0]) | val(a[1]) << 32) >> (val(a[2]) % 32)) & 0xFFFFFFFF
        elif op == "prmt.b32":
            pool = val(a[0]) | val(a[1]) << 32
            regs[d] = sum(((pool >> 8 * ((val(a[2]) >> 4 * i) & 7)) & 0xFF) << 8 * i for i in range(4))
        elif op == "shl.b32":
            regs[d] = (val(a[0]) << val(a[1])) & 0xFFFFFFFF
        elif op == "shr.b32":
            regs[d] = val(a[0]) >> val(a[1])
        elif op == "mov.b32" and a[0].startswith("{"):
            regs[d] = val(a[0].strip("{ ")) | val(a[1].strip("} ")) << 16
        elif op == "mov.b32":
            regs[d] = val(a[0])
        elif op == "mul.rn.bf16x2":
            x, y = (
                torch.tensor([v & 0xFFFF, v >> 16], dtype=torch.int32).to(torch.int16)
                for v in (val(a[0]), val(a[1]))
            )
            x, y = x.view(torch.bfloat16), y.view(torch.bfloat16)
            z = (x.double() * y.double()).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
            regs[d] = int(z[0]) | int(z[1]) << 16
        elif op == "and.b32":
            regs[d] = val(a[0]) & val(a[1])
        elif op == "or.b32":
            regs[d] = val(a[0]) | val(a[1])
        else:
            raise AssertionError(f"instruction the test does not model: {ins}")
    return regs


def test_scales_ptx_gives_both_rows_scales_times_2_100():
    """Every non-negative finite e4m3 byte (subnormals included; 0x7F is NaN), in each of the four
    positions of either row's word, comes back as its value * 2^100 in bf16, row $4 in the low half."""
    from batchinfer.kernels import moe_tc

    g = torch.Generator().manual_seed(8)
    for v in range(127):
        rows = torch.randint(0, 127, (2, 4), generator=g)
        rows[v % 2, v % 4] = v
        words = [sum(int(b) << 8 * i for i, b in enumerate(r)) for r in rows]
        out = _run_ptx(moe_tc._SCALES_PTX.value, {"$4": words[0], "$5": words[1]})
        regs = [out[f"${r}"] for r in range(4)]
        got = torch.tensor([[r & 0xFFFF, r >> 16] for r in regs], dtype=torch.int32).to(torch.int16)
        got = got.view(torch.bfloat16).double().T * 2.0**-100  # [row, scale]
        assert torch.equal(got, rows.to(torch.uint8).view(torch.float8_e4m3fn).double()), (v, rows)


def _random_paired_blocks(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    """n random 32-code blocks: their codes [n, 32] in K order, their paired words [n, 4] (as int), and
    the generator, for more random inputs."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, 16), dtype=torch.uint8, generator=g)
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(n, 32).long()
    words = pair_groups(packed).reshape(n, 4, 4).long()
    return codes, sum(words[..., i] << 8 * i for i in range(4)), g


def test_decode_ptx_builds_the_bf16_codes():
    """Every paired word of random blocks, with scales 2^100 and 2^99 (bf16, as `_word_scales` gives),
    gives four bf16x2 registers worth E2M1(code) * scale * 2^-126: group A's K 2t, 2t+1 in $0 (low half
    first), 2t+8, 2t+9 in $1, group B's in $2, $3."""
    from batchinfer.kernels import moe_tc
    from batchinfer.kernels.nvfp4 import E2M1_VALUES

    codes, words, _ = _random_paired_blocks(64, seed=7)
    for blk in range(64):
        for t in range(4):
            out = _run_ptx(moe_tc._DECODE_PTX.value, {"$4": int(words[blk, t]), "$5": 0x7180, "$6": 0x7100})
            regs = [out[f"${r}"] for r in range(4)]  # scales 2^100 (group A), 2^99 (B)
            halves = torch.tensor([[r & 0xFFFF, r >> 16] for r in regs], dtype=torch.int32).reshape(-1)
            got = halves.to(torch.int16).view(torch.bfloat16).double() * 2.0**26
            got[4:] *= 2.0
            k = [slot_k.fn(t, j) for j in range(8)]
            assert torch.equal(got, E2M1_VALUES[codes[blk, k]].double()), (blk, t)


def test_paired_dot8_ptx_sums_each_groups_codes_times_x():
    """The decode path's PTX (`paired_dot8`): every paired word of random blocks times 8 random x gives
    (group A's sum, group B's) of E2M1(code) * x * 2^-14, the x in slot order."""
    from batchinfer.kernels import moe_tc
    from batchinfer.kernels.nvfp4 import E2M1_VALUES

    codes, words, g = _random_paired_blocks(32, seed=9)
    for blk in range(32):
        for t in range(4):
            x = torch.randn(8, generator=g, dtype=torch.float64)
            out = _run_ptx(
                moe_tc._PAIRED_DOT8_PTX.value,
                {"$2": int(words[blk, t])} | {f"${3 + j}": float(x[j]) for j in range(8)},
            )
            k = [slot_k.fn(t, j) for j in range(8)]
            want = E2M1_VALUES[codes[blk, k]].double() * x * 2.0**-14
            assert out["$0"] == pytest.approx(float(want[:4].sum()), rel=1e-12, abs=1e-18)
            assert out["$1"] == pytest.approx(float(want[4:].sum()), rel=1e-12, abs=1e-18)
