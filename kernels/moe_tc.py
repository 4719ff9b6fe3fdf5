"""NVFP4 MoE experts on the tensor cores for mid-size batches: the weight is the MMA's A operand.

Why: between the decode path (a GEMV per (token, expert) entry on CUDA cores, which decodes an expert
once per entry) and prefill sizes (experts decoded to bf16 once, then `torch._grouped_mm`), the fused
grouped GEMMs of `moe.py` decode each weight tile in a blocked layout and move it through shared memory
into the MMA operand layout. Here the product is computed transposed, `out^T [BN, BM] = W [BN, K] @
x^T [K, BM]`: weight rows fill the MMA's M (64 a warpgroup), the tokens of one expert its N (16-64), so
one expert's weights are read and decoded once for all its tokens, and, with the decode an elementwise
chain from the loaded bytes, Triton loads the packed codes into shared memory (cp.async, 4 bits a code)
and from there straight into the wgmma register operand layout, decoding in registers (checked in the
sm_90 TTGIR: no shared-memory copy of the decoded weight).

That needs one block scale per row for each K=16 MMA, so the codes are repacked once (`pair_groups`):
within each 32-code block of a row (two 16-code scale groups A, B) one byte holds A's code j in its low
nibble and B's code j in its high nibble, and the 16 bytes are ordered so that the four a thread's MMA
operand needs (K = 2t, 2t+1, 2t+8, 2t+9 for t = 0..3) are adjacent: byte `4 t + 2 h + c` holds K = `8 h +
2 t + c` (`BYTE_K`). A step loads 16 bytes a row; the kernel views them back in K order (a reshape and
permute that only relabels a thread's registers) and decodes four at a time, so shared memory is read
32 bits at a time (sm_90: 15 shared loads an iteration instead of 27). The low nibbles are group A (one
MMA against x[k : k+16]), the high nibbles group B (x[k+16 : k+32]). A loop iteration covers
STEPS such blocks and loads a row's 16 STEPS code bytes in one load (STEPS 2: a whole 32-byte sector, by
16-byte cp.async; as two 16-byte loads each used half a sector, and ncu counted 61% of the sectors the
kernel fetched as excess) and its 2 STEPS block scales as 32-bit words, which Triton pipelines by
cp.async with the codes. The scales are repacked at load too (`pair_scales`: `[K/64, E', N, 4]`, a row's
four scales of a 64-code block in one word, the words of adjacent rows adjacent), so a tile's scale
loads are coalesced: row-major, each row's 4 bytes an iteration took a 32-byte sector of its own, as
many sectors as the codes. The decode path and the grouped-GEMM dequantization read the same layout
(`scale_offset`). Loads of fewer than 4 bytes a thread it cannot pipeline: one-byte scale loads
stalled the warps on L1 (ncu on the H200, session 6), and a [64, 4]-byte load still gave each of 128
threads 2 bytes, a synchronous `LDG.U16` plus a copy through shared memory (sm_90 SASS, session 7).
Codes are split into blocks (`_halves`) and words into scales (shifts) in registers.

Decode (`_weight`, inline PTX on pairs of bytes): the code's sign goes to bit 15 and its three magnitude
bits to bits 6-8 of a bf16 (code * 2^-126, E2M1's subnormal 0.5 included), times the block scale as a
bf16 of e4m3 * 2^100 (one bf16x2 multiply a pair): code * scale * 2^-26, exact in bf16 (at most 6
significant bits, far from the range limits); the epilogue multiplies by the tensor scale * 2^26. sm_90
SASS (Triton 3.6), BLOCK_N 64 on 4 warps, STEPS 2: ~7.0 (gate_up) and ~8.3 (down) instructions a code a
thread, each code serving every token of its tile. Entries are grouped by expert with `moe_align`
(BLOCK_M-padded, as the fused grouped GEMMs), gate_up fuses SiLU * up, down applies the routing weight, a
sum over each token's slots finishes. The engine loads its NVFP4 experts paired, and `moe._moe_configs`
sends batches of more than ~0.35 entries an expert here, up to where grouped_mm wins (crossovers timed on
the H200, `tune_kernels --kinds moe_paths`; tiles by `--kinds moe_tc`; docs/PERF_KERNELS.md). Against
`moe_experts_ref` (fp32) expect the bf16 rounding of the intermediates, ~1e-3..1e-2.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from batchinfer.kernels.moe_align import moe_align
from batchinfer.kernels.moe_weights import MoEWeights
from batchinfer.kernels.nvfp4_gemm import bf16_rne, e2m1_to_f32, e4m3_to_f32, interpreting
from batchinfer.kernels.small_ops import sum_slots


@dataclass(frozen=True, slots=True)
class MoETCConfig:
    """BLOCK_M (tokens a tile, also the alignment), then per GEMM (BLOCK_N, num_warps, num_stages, STEPS):
    STEPS (1, 2 or 4; fewer where K is not a multiple of 32 STEPS) 32-code blocks a loop iteration
    (unrolled), which spreads the loop's fixed cost (scale loads, wgmma fences, addressing) over more
    codes and loads a row's codes and scales in longer runs."""

    block_m: int
    gate_up: tuple[int, int, int, int]
    down: tuple[int, int, int, int]


@triton.jit
def byte_k(p):
    """The K index (0-15 within a scale group) that byte p (0-15) of a 16-byte block holds in the paired
    layout: byte 4 t + 2 h + c holds K = 8 h + 2 t + c, so a thread's four operand bytes are adjacent."""
    return 8 * ((p % 4) // 2) + 2 * (p // 4) + p % 2


@triton.jit
def k_byte(k):
    """The byte of a 16-byte block that holds K index k (`byte_k` inverted)."""
    return 4 * ((k % 8) // 2) + 2 * (k // 8) + k % 2


BYTE_K = [byte_k.fn(p) for p in range(16)]  # the same on the host (`pair_groups`, tests)


def pair_groups(packed: torch.Tensor) -> torch.Tensor:
    """NVFP4 codes `uint8 [..., K/2]` (byte j: code 2j low, 2j+1 high) -> the paired layout (module
    docstring) of the same shape. K must be a multiple of 32."""
    k = packed.shape[-1] * 2
    if k % 32:
        raise ValueError(f"pair_groups: K = {k} codes a row must be a multiple of 32")
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], k // 32, 2, 16)
    codes = codes[..., BYTE_K]
    return (codes[..., 0, :] | (codes[..., 1, :] << 4)).reshape(packed.shape)


def pair_scales(scale: torch.Tensor) -> torch.Tensor:
    """Block scales `uint8 [E', N, K/16]` -> the paired layout's `[ceil(K/64), E', N, 4]`: a row's four
    scales of a 64-code block in one 32-bit word (zero-padded past K), the words of every row of every
    expert adjacent, so that a tile's scale loads are coalesced (`scale_offset`)."""
    e, n, g = scale.shape
    padded = torch.zeros((e, n, triton.cdiv(g, 4) * 4), dtype=scale.dtype, device=scale.device)
    padded[..., :g] = scale
    return padded.view(e, n, -1, 4).permute(2, 0, 1, 3).contiguous()


@triton.jit
def scale_offset(rows, groups, stride_sk):
    """Byte offset of the scale of 16-code group `groups` of row `rows` (of one expert) in the paired
    layout (`pair_scales`; stride_sk = 4 E' N, the bytes of one 64-code block's words)."""
    return (groups // 4) * stride_sk + rows * 4 + groups % 4


def pair_moe_weights(w: MoEWeights) -> MoEWeights:
    """`w` with both expert stacks (codes and block scales) in the paired layout, for `moe_experts_tc`."""
    if not w.nvfp4 or w.paired:
        raise ValueError("pair_moe_weights: expected NVFP4 experts in the standard layout")
    return dataclasses.replace(w, w13=pair_groups(w.w13), w2=pair_groups(w.w2), w13_scale=pair_scales(
        w.w13_scale), w2_scale=pair_scales(w.w2_scale), paired=True)


def _ptx(sh_m: int, sh_s: int) -> str:
    """Four bytes (a thread's operand pairs of one row: K = 2t, 2t+1 and 2t+8, 2t+9) -> four bf16 codes *
    2^-126 of one nibble, two a register: each byte pair spread to [b0, 0, b1, 0], magnitude bits shifted
    to 6-8, sign to 15 (Triton's integer ops on uint8 tensors spend ~1.3x the instructions: PRMTs to
    widen each byte, then 16-bit shifts)."""
    pair = lambda sel, out: (f"prmt.b32 t, $2, 0, {sel}; shl.b32 u, t, {sh_m}; shl.b32 v, t, {sh_s}; "
                             f"and.b32 u, u, 0x01C001C0; and.b32 v, v, 0x80008000; or.b32 {out}, u, v; ")
    return "{ .reg .b32 t, u, v; " + pair("0x4140", "$0") + pair("0x4342", "$1") + "}"


_LO_PTX = tl.constexpr(_ptx(6, 12))
_HI_PTX = tl.constexpr(_ptx(2, 8))


@triton.jit
def _scale(s):
    """e4m3 bits (uint8) -> fp32 value * 2^100 (exact in bf16)."""
    return e4m3_to_f32(s) * 3.2451855365842673e32  # * 2^108


@triton.jit
def _weight(b, s, HI: tl.constexpr, INTERPRET: tl.constexpr):
    """[BN, 16] codes of one nibble times their rows' scales [BN, 1]: bf16 code * scale * 2^-26. The
    interpreter runs no PTX and flushes bf16 subnormals, so there the codes are built as fp16 (code *
    2^-14) and multiplied in fp32 (the same values)."""
    if INTERPRET:
        return e2m1_to_f32(b, HI) * s.to(tl.float32) * 1.925929944387236e-34  # * 2^-112
    ptx: tl.constexpr = _HI_PTX if HI else _LO_PTX
    c = tl.inline_asm_elementwise(ptx, "=r,=r,r", [b.to(tl.uint8)], dtype=tl.bfloat16, is_pure=True, pack=4)
    return c * s


@triton.jit
def _halves(x):
    """x [BN, 2 n] -> (x[:, :n], x[:, n:]) within each thread's registers."""
    return tl.split(tl.permute(tl.reshape(x, (x.shape[0], 2, x.shape[1] // 2)), (0, 2, 1)))


@triton.jit
def _scale_at(word, i: tl.constexpr):
    """Byte i of each row's scale word [BN] as `_scale`'s fp32 (`e4m3_to_f32` keeps the low byte)."""
    return _scale(word >> (8 * i))


@triton.jit
def _iteration_scales(s, STEPS: tl.constexpr):
    """A row's 2 STEPS block scales of one iteration as little-endian words [BN, WORDS] (`_launch`: int16
    for STEPS 1, one int32 for 2, two for 4) -> (A, B) of each block in order, 2 STEPS tensors [BN] fp32
    (block 0's twice when STEPS is 1)."""
    if STEPS == 4:
        w0, w1 = tl.split(s)
        r = (_scale_at(w0, 0), _scale_at(w0, 1), _scale_at(w0, 2), _scale_at(w0, 3),
             _scale_at(w1, 0), _scale_at(w1, 1), _scale_at(w1, 2), _scale_at(w1, 3))
    else:
        w = tl.reshape(s, (s.shape[0],))
        if STEPS == 1:
            r = (_scale_at(w, 0), _scale_at(w, 1), _scale_at(w, 0), _scale_at(w, 1))
        else:
            r = (_scale_at(w, 0), _scale_at(w, 1), _scale_at(w, 2), _scale_at(w, 3))
    return r


@triton.jit
def _iteration_blocks(b, STEPS: tl.constexpr):
    """A row's 16 STEPS code bytes of one iteration [BN, 16 STEPS] -> its STEPS blocks [BN, 16] in order
    (block 0 twice when STEPS is 1)."""
    if STEPS == 1:
        r = (b, b)
    elif STEPS == 2:
        b0, b1 = _halves(b)
        r = (b0, b1)
    else:
        h0, h1 = _halves(b)
        b0, b1 = _halves(h0)
        b2, b3 = _halves(h1)
        r = (b0, b1, b2, b3)
    return r


@triton.jit
def _pair_step(b, sa, sb, xa, xb, acc, INTERPRET: tl.constexpr):
    """acc + W[:, k : k+32] @ x^T for one 32-code block: b [BN, 16] its bytes, two K=16 MMAs; sa, sb [BN]
    the block's two scales (fp32 from `_scale`)."""
    BN: tl.constexpr = b.shape[0]
    # byte 4 t + 2 h + c holds K = 8 h + 2 t + c (`BYTE_K`): back to K order, within each thread's registers
    b = tl.reshape(tl.permute(tl.reshape(b, (BN, 4, 2, 2)), (0, 2, 1, 3)), (BN, 16)).to(tl.int32)
    sa = sa.to(tl.bfloat16)[:, None]
    sb = sb.to(tl.bfloat16)[:, None]
    acc = tl.dot(_weight(b, sa, False, INTERPRET), xa, acc)
    return tl.dot(_weight(b, sb, True, INTERPRET), xb, acc)


@triton.jit
def _moe_tc_kernel(
    a_ptr, w_ptr, s_ptr, ts_ptr, out_ptr, route_w_ptr,  #
    sorted_ptr, block_expert_ptr, num_padded_ptr,  #
    NUMEL, N, K, A_DIV,  #
    stride_am, stride_we, stride_wn, stride_sk, stride_se, stride_sn, stride_om,  #
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, STEPS: tl.constexpr, GATE_UP: tl.constexpr,  #
    INTERPRET: tl.constexpr,  #
):
    """GATE_UP: out[entry, n] = silu(gate[n] . a[tok]) * (up[n] . a[tok]), tok = entry // A_DIV.
    Else (down): out[entry, n] = route_w[entry] * (w[n] . a[entry]). One expert's BLOCK_M entries and
    BLOCK_N rows n a program; accumulators are [BLOCK_N, BLOCK_M] (rows x entries)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    entry = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = entry < NUMEL
    a_rows = tl.where(valid, entry // A_DIV, 0).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rows < N
    j = tl.arange(0, 16)
    w_ptrs = w_ptr + e * stride_we + rows[:, None] * stride_wn + tl.arange(0, 16 * STEPS)[None, :]
    # an iteration's 2 STEPS block scales of a row: WORDS words (`pair_scales`: one 32-bit word a row and
    # 64-code block, rows adjacent; STEPS 1 a 16-bit half; s_ptr and its strides in words), 4 bytes a
    # thread, which Triton pipelines by cp.async; as bytes a thread got 2 of STEPS 2's 4 and loaded them
    # synchronously (sm_90 SASS), and byte loads stalled on L1 (ncu, H200)
    WORDS: tl.constexpr = 2 if STEPS == 4 else 1
    s_ptrs = s_ptr + e * stride_se + rows[:, None] * stride_sn + (tl.arange(0, WORDS) * stride_sk)[None, :]
    x_ptrs = a_ptr + a_rows[None, :] * stride_am + j[:, None]  # [16, BLOCK_M]: x^T
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    row_ok = mask_n[:, None]
    for k0 in range(0, K, 32 * STEPS):  # K is a multiple of 32 * STEPS (`_launch`)
        s_off = (k0 // 64) * stride_sk + (k0 // 32) % 2 if STEPS == 1 else (k0 // 64) * stride_sk
        sc = _iteration_scales(tl.load(s_ptrs + s_off, mask=row_ok, other=0), STEPS)
        bw = _iteration_blocks(tl.load(w_ptrs + k0 // 2, mask=row_ok, other=0), STEPS)
        sc_up = sc
        bw_up = bw
        if GATE_UP:  # the up rows follow the N gate rows
            sc_up = _iteration_scales(tl.load(s_ptrs + N * stride_sn + s_off, mask=row_ok, other=0), STEPS)
            bw_up = _iteration_blocks(tl.load(w_ptrs + N * stride_wn + k0 // 2, mask=row_ok, other=0), STEPS)
        for u in tl.static_range(STEPS):
            k = k0 + 32 * u
            xa = tl.load(x_ptrs + k, mask=valid[None, :], other=0.0)
            xb = tl.load(x_ptrs + k + 16, mask=valid[None, :], other=0.0)
            if INTERPRET:  # the interpreter multiplies bf16 dot operands as raw bits
                xa, xb = xa.to(tl.float32), xb.to(tl.float32)
            acc = _pair_step(bw[u], sc[2 * u], sc[2 * u + 1], xa, xb, acc, INTERPRET)
            if GATE_UP:
                acc_up = _pair_step(bw_up[u], sc_up[2 * u], sc_up[2 * u + 1], xa, xb, acc_up, INTERPRET)
    if GATE_UP:
        acc = acc * (tl.load(ts_ptr + e * 2) * 67108864.0)  # tensor scale * 2^26
        acc_up = acc_up * (tl.load(ts_ptr + e * 2 + 1) * 67108864.0)
        acc = acc * tl.sigmoid(acc) * acc_up
    else:
        acc = acc * (tl.load(ts_ptr + e) * 67108864.0)
        acc = acc * tl.load(route_w_ptr + entry, mask=valid, other=0.0)[None, :]
    out_ptrs = out_ptr + entry.to(tl.int64)[None, :] * stride_om + rows[:, None]
    tl.store(out_ptrs, bf16_rne(acc, INTERPRET), mask=valid[None, :] & mask_n[:, None])


def _launch(a, w: MoEWeights, gate_up: bool, out, route_w, sorted_ids, block_expert, num_padded,
            numel: int, a_div: int, cfg: MoETCConfig) -> None:
    wt, st = (w.w13, w.w13_scale) if gate_up else (w.w2, w.w2_scale)
    ts = w.w13_tensor_scale if gate_up else w.w2_tensor_scale
    n = w.intermediate if gate_up else w.hidden
    block_n, warps, stages, steps = cfg.gate_up if gate_up else cfg.down
    k = a.shape[1]
    if steps not in (1, 2, 4):
        raise ValueError(f"MoETCConfig: STEPS must be 1, 2 or 4, got {steps}")
    while k % (32 * steps):  # fewer blocks an iteration where K is not a multiple (K % 32 == 0 always)
        steps //= 2
    # the kernel's scale words: [K/64, E', N] of int32, or [K/64, E', N, 2] of int16 halves for STEPS 1
    st = st.view(torch.int16) if steps == 1 else st.view(torch.int32).squeeze(-1)
    _moe_tc_kernel[(block_expert.numel(), triton.cdiv(n, block_n))](
        a, wt, st, ts, out, route_w,  #
        sorted_ids, block_expert, num_padded,  #
        numel, n, k, a_div,  #
        a.stride(0), wt.stride(0), wt.stride(1), st.stride(0), st.stride(1), st.stride(2), out.stride(0),  #
        BLOCK_N=block_n, BLOCK_M=cfg.block_m, STEPS=steps, GATE_UP=gate_up, INTERPRET=interpreting(),  #
        num_warps=warps, num_stages=stages,  #
    )


@triton.jit
def _dequant_paired_kernel(
    w_ptr, s_ptr, ts_ptr, out_ptr,  #
    N, PAIRS, TS_ROWS,  #
    stride_wn, stride_sk, stride_on,  #
    BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, INTERPRET: tl.constexpr,  #
):
    """Paired rows [BLOCK_N, BLOCK_P 32-code blocks] -> bf16 (as `nvfp4_gemm._nvfp4_dequant_kernel`);
    scales in the paired layout (`scale_offset`). The bytes are put back in K order in registers, so that
    each row's BLOCK_P * 32 values are one contiguous store (2-byte scattered stores ran at ~5% of the
    bandwidth)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    pairs = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_rp = (rows < N)[:, None] & (pairs < PAIRS)[None, :]
    byte = pairs[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]  # [1, P, 16]
    b = tl.load(w_ptr + rows[:, None, None] * stride_wn + byte, mask=mask_rp[:, :, None], other=0)
    # byte 4 t + 2 h + c holds K = 8 h + 2 t + c (`byte_k`): swap the t and h axes
    b = tl.permute(tl.reshape(b, (BLOCK_N, BLOCK_P, 4, 2, 2)), (0, 1, 3, 2, 4))
    b = tl.reshape(b, (BLOCK_N, BLOCK_P, 16)).to(tl.int32)
    s_ptrs = s_ptr + scale_offset(rows[:, None], 2 * pairs[None, :], stride_sk)
    ts = tl.load(ts_ptr + rows // TS_ROWS, mask=rows < N, other=0.0)[:, None, None] * 4194304.0
    sf_lo = e4m3_to_f32(tl.load(s_ptrs, mask=mask_rp, other=0))[:, :, None] * ts  # K 0-15 of a pair
    sf_hi = e4m3_to_f32(tl.load(s_ptrs + 1, mask=mask_rp, other=0))[:, :, None] * ts  # K 16-31
    lo = bf16_rne(e2m1_to_f32(b, False) * sf_lo, INTERPRET)
    hi = bf16_rne(e2m1_to_f32(b, True) * sf_hi, INTERPRET)
    val = tl.reshape(tl.permute(tl.join(lo, hi), (0, 1, 3, 2)), (BLOCK_N, BLOCK_P * 32))
    k = tl.program_id(1) * BLOCK_P * 32 + tl.arange(0, BLOCK_P * 32)
    mask = (rows < N)[:, None] & (k < 32 * PAIRS)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_on + k[None, :], val, mask=mask)


def dequantize_paired_rows(
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    tensor_scale: torch.Tensor,
    ts_rows: int,
    out: torch.Tensor,
) -> None:
    """`nvfp4_gemm.dequantize_rows` for rows in the paired layout: `packed [N, K/2]`, `block_scale [K/64, N,
    4]` (`pair_scales`' layout, e4m3 bits; rows 4 bytes apart) -> bf16 `out [N, K]`, row r times
    `tensor_scale.view(-1)[r // ts_rows]`."""
    n, kb = packed.shape
    if block_scale.shape != (triton.cdiv(kb, 32), n, 4) or block_scale.stride()[1:] != (4, 1):
        raise ValueError(f"dequantize_paired_rows: block_scale {tuple(block_scale.shape)}, expected "
                         f"{(triton.cdiv(kb, 32), n, 4)} with rows 4 bytes apart (pair_scales)")
    block_n, block_p = (16, 4) if interpreting() else (32, 16)
    grid = (triton.cdiv(n, block_n), triton.cdiv(kb // 16, block_p))
    _dequant_paired_kernel[grid](
        packed, block_scale.view(torch.uint8), tensor_scale.reshape(-1), out,  #
        n, kb // 16, ts_rows,  #
        packed.stride(0), block_scale.stride(0), out.stride(0),  #
        BLOCK_N=block_n, BLOCK_P=block_p, INTERPRET=interpreting(), num_warps=4,  #
    )


def moe_experts_tc(
    h: torch.Tensor, ids: torch.Tensor, route_w: torch.Tensor, w: MoEWeights, cfg: MoETCConfig
) -> torch.Tensor:
    """`moe.moe_experts` on the tensor cores: `h [T, D]` bf16, `ids [T, A']` int32, `route_w` flat fp32
    `[T * A']`, paired NVFP4 experts (`pair_moe_weights`) -> `[T, D]` bf16. Called by `moe_experts`,
    which checks the shapes and flattens `route_w`; D and I multiples of 32 (`pair_groups` checks)."""
    if not w.paired:
        raise ValueError("moe_experts_tc: expected experts in the paired layout (pair_moe_weights)")
    t, d = h.shape
    a_slots = ids.shape[1]
    numel = t * a_slots
    sorted_ids, block_expert, num_padded = moe_align(ids, w.w13.shape[0], cfg.block_m)
    inter = torch.empty((numel, w.intermediate), dtype=torch.bfloat16, device=h.device)
    y = torch.empty((numel, d), dtype=torch.bfloat16, device=h.device)
    _launch(h, w, True, inter, route_w, sorted_ids, block_expert, num_padded, numel, a_slots, cfg)
    _launch(inter, w, False, y, route_w, sorted_ids, block_expert, num_padded, numel, 1, cfg)
    return sum_slots(y, a_slots)
