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

That needs one block scale per row for each K=16 MMA, so the codes are repacked once (`pair_groups`): each
32-code block of a row (two 16-code scale groups A, B) is four 32-bit words, and word t holds the eight codes
a thread's MMA operands need from it, A's and B's at K = 2t, 2t+1, 2t+8, 2t+9, with their bits placed so that
each bf16x2 operand register is the word rotated and masked (`PAIR_WORD_BITS`). The kernel loads the words as
int32 (a byte tensor's packs of four, as inline PTX sees them, mix the rows r and r + 8 of the MMA operand),
decodes each in PTX and puts the halves in K order (`_k_order`: a join and permute that only relabels a
thread's registers). Group A is one MMA against x[k : k+16], group B one against x[k+16 : k+32]. A loop
iteration covers STEPS such blocks and loads a row's 4 STEPS words in one load (STEPS 2: a whole 32-byte
sector, by 16-byte cp.async; as two 16-byte loads each used half a sector, and ncu counted 61% of the sectors
the kernel fetched as excess) and its 2 STEPS block scales as 32-bit words, which Triton pipelines by cp.async
with the codes. The scales are repacked at load too (`pair_scales`: `[K/64, E', N, 4]`, a row's four scales of
a 64-code block in one word, the words of adjacent rows adjacent), so a tile's scale loads are coalesced:
row-major, each row's 4 bytes an iteration took a 32-byte sector of its own, as many sectors as the codes. The
decode path and the grouped-GEMM dequantization read the same layout (`paired_dot8`, `paired_codes`,
`scale_offset`). Loads of fewer than 4 bytes a thread it cannot pipeline: one-byte scale loads stalled the
warps on L1 (ncu on the H200, session 6), and a [64, 4]-byte load still gave each of 128 threads 2 bytes, a
synchronous `LDG.U16` plus a copy through shared memory (sm_90 SASS, session 7). Codes are split into blocks
(`_halves`) in registers.

Decode (`_decode_ptx`, inline PTX a word): a code's sign goes to bit 15 and its three magnitude bits to
bits 6-8 of a bf16 (code * 2^-126, E2M1's subnormal 0.5 included), four registers from a word in nine
instructions (funnel-shift rotations and masks), each times its row's block scale as a bf16 of e4m3 *
2^100 (one bf16x2 multiply a register, the scale broadcast from a half; `_scales_ptx` builds both of a
thread's rows' scales in one register, two instructions a scale): code * scale * 2^-26, exact in bf16
(at most 6 significant bits, far from the range limits); the epilogue multiplies by the tensor scale *
2^26. sm_90 SASS (Triton 3.6), gate_up at 32 tokens (BLOCK_N 64 on 4 warps, STEPS 4): 497 instructions
a loop iteration of 128 codes a thread, ~3.9 a code, each code serving every token of its tile (789
with the previous byte-per-K layout: a PRMT, two shifts and two logic ops a register, and five
instructions a scale through fp16 and fp32; one MoE layer 15-19% faster on the H200 from 32 to 2,048
tokens, docs/PERF.md session 12). An iteration's blocks form one [BN, 32 STEPS] tile and one `tl.dot`,
and K is a constexpr: before, ptxas serialized every wgmma (`ptxas -v` info C7515: the loop's zero-trip
path defined the accumulators outside the MMA pipeline) and Triton waited after each 16-code dot; now
the wgmmas of a dot go back to back with one wait (sm_90: 450 instructions an iteration, 124 registers;
not yet timed on the H200). Entries are grouped by expert with `moe_align`
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
from batchinfer.kernels import pdl
from batchinfer.kernels.moe_align import moe_align
from batchinfer.kernels.moe_weights import MoEWeights
from batchinfer.kernels.nvfp4_gemm import bf16_rne, e4m3_to_f32, interpreting
from batchinfer.kernels.small_ops import sum_slots


@dataclass(frozen=True, slots=True)
class MoETCConfig:
    """BLOCK_M (tokens a tile, also the alignment), then per GEMM (BLOCK_N, num_warps, num_stages, STEPS):
    STEPS (1, 2 or 4; fewer where K is not a multiple of 32 STEPS) 32-code blocks a loop iteration
    (unrolled), which spreads the loop's fixed cost (scale loads, wgmma fences, addressing) over more
    codes and loads a row's codes and scales in longer runs. `max_regs` caps both kernels' registers a thread
    (ptxas `.maxnreg`; 0: the compiler's choice): more programs an SM for kernels that wait on memory."""

    block_m: int
    gate_up: tuple[int, int, int, int]
    down: tuple[int, int, int, int]
    max_regs: int = 0


@triton.jit
def slot_k(t, j):
    """The K index (0-31 within a 32-code block) of slot j (0-7) of paired word t (0-3): group j // 4 (A: K
    0-15, B: 16-31) at K 2t, 2t+1, 2t+8, 2t+9 of it, a thread's four operand K (`PAIR_WORD_BITS`). Also
    on the host (`slot_k.fn`: `pair_groups`, tests)."""
    return 16 * (j // 4) + 8 * ((j // 2) % 2) + 2 * t + j % 2

# A paired word's 8 codes, slot j = 2 r + h: bf16 register r (0: group A at K 2t, 2t+1; 1: A at 2t+8, 2t+9;
# 2, 3: group B at the same K), half h. Code bit b (magnitude 0-2, sign 3) goes to bf16 bit BF16_BIT[b] of
# half h (code * 2^-126: E2M1's three magnitude bits at bf16's exponent/mantissa boundary, its subnormal 0.5
# included) and is stored at that bit of the word rotated left by ROTATE[r][b]: register r is the word
# rotated right and masked. No four rotations of one bf16x2 pattern tile 32 bits, so register 3 takes its
# magnitude's low bit from a second rotation.
BF16_BIT = (6, 7, 8, 15)
ROTATE = ((0, 0, 0, 0), (4, 4, 4, 4), (10, 10, 10, 10), (14, 6, 6, 6))
PAIR_WORD_BITS = [[(16 * (j % 2) + BF16_BIT[b] + ROTATE[j // 2][b]) % 32 for b in range(4)] for j in range(8)]
_PAIR_ROWS = 1 << 20  # 16-byte blocks `pair_groups` repacks at a time (bounds its scratch memory)


def pair_groups(packed: torch.Tensor) -> torch.Tensor:
    """NVFP4 codes `uint8 [..., K/2]` (byte j: code 2j low, 2j+1 high) -> the paired layout (module
    docstring) of the same shape: 32-bit word t of each 16-byte block holds both scale groups' codes at
    K = 2t, 2t+1, 2t+8, 2t+9 in the bits of `PAIR_WORD_BITS`. K must be a multiple of 32."""
    k = packed.shape[-1] * 2
    if k % 32:
        raise ValueError(f"pair_groups: K = {k} codes a row must be a multiple of 32")
    blocks = packed.reshape(-1, 16)
    out = torch.empty_like(blocks)
    t = torch.arange(4, device=packed.device)[:, None]
    j = torch.arange(8, device=packed.device)[None, :]
    k_of_slot = slot_k.fn(t, j)  # [4 words, 8 slots]
    for r0 in range(0, blocks.shape[0], _PAIR_ROWS):
        chunk = blocks[r0 : r0 + _PAIR_ROWS].to(torch.int64)
        codes = torch.stack([chunk & 0xF, chunk >> 4], dim=-1).reshape(-1, 32)[:, k_of_slot]  # [n, 4, 8]
        words = torch.zeros(codes.shape[:2], dtype=torch.int64, device=packed.device)
        for slot, bits in enumerate(PAIR_WORD_BITS):
            for b, pos in enumerate(bits):
                words |= ((codes[..., slot] >> b) & 1) << pos
        chunk_bytes = torch.stack([(words >> 8 * i) & 0xFF for i in range(4)], -1)
        out[r0 : r0 + _PAIR_ROWS] = chunk_bytes.reshape(-1, 16)
    return out.reshape(packed.shape)


def pair_scales(scale: torch.Tensor) -> torch.Tensor:
    """Block scales `uint8 [E', N, K/16]` -> the paired layout's `[ceil(K/64), E', N, 4]`: a row's four
    scales of a 64-code block in one 32-bit word (zero-padded past K), the words of every row of every
    expert adjacent, so that a tile's scale loads are coalesced (`scale_offset`)."""
    e, n, g = scale.shape
    if (scale & 0x80).any():  # `_scales_ptx` drops the sign bit
        raise ValueError("pair_scales: block scales with the sign bit set (e4m3 bytes >= 0x80); NVFP4 block "
                         "scales are non-negative")
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


def _decode_ptx() -> str:
    """One paired word ($4) and its row's two block scales ($5, $6: bf16 times 2^100) -> its four bf16x2
    registers of code * scale * 2^-26 (`PAIR_WORD_BITS`): $0, $1 group A (K 2t, 2t+1 and 2t+8, 2t+9),
    $2, $3 group B. A register's codes (code * 2^-126) are a funnel-shift rotation and a mask of the word,
    then one bf16x2 multiply by its group's scale (exact: at most 6 significant bits)."""
    lines = ["{", ".reg .b32 t, u, sa, sb;", "mov.b32 sa, {$5, $5};", "mov.b32 sb, {$6, $6};"]
    for r, rot in enumerate(ROTATE[:3]):
        src = "$4"
        if rot[0]:
            lines.append(f"shf.r.wrap.b32 t, $4, $4, {rot[0]};")
            src = "t"
        lines += [f"and.b32 u, {src}, 0x81C081C0;", f"mul.rn.bf16x2 ${r}, u, {'sa' if r < 2 else 'sb'};"]
    lines += [f"shf.r.wrap.b32 t, $4, $4, {ROTATE[3][0]};", "and.b32 t, t, 0x00400040;",
              f"shf.r.wrap.b32 u, $4, $4, {ROTATE[3][1]};", "and.b32 u, u, 0x81808180;",
              "or.b32 u, t, u;", "mul.rn.bf16x2 $3, u, sb;", "}"]
    return "\n".join(lines)


_DECODE_PTX = tl.constexpr(_decode_ptx())


@triton.jit
def _scale(s):
    """e4m3 bits (uint8) -> fp32 value * 2^100 (exact in bf16)."""
    return e4m3_to_f32(s) * 3.2451855365842673e32  # * 2^108


@triton.jit
def _rotr(w, k: tl.constexpr):
    """uint32 words rotated right by k (0 < k < 32)."""
    return (w >> k) | (w << (32 - k))


@triton.jit
def _register_codes(u):
    """A bf16x2 register of codes * 2^-126 (`_decode_ptx`) -> its two codes as fp32 * 2^-14, built as fp16
    (magnitude to bits 9-11, E2M1's subnormal/normal boundary on fp16's), as `e2m1_to_f32`."""
    f = ((u & 0x01C001C0) << 3) | (u & 0x80008000)
    lo = (f & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (f >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def paired_codes(w):
    """Paired words (int32 or uint32) -> their 8 codes as fp32 * 2^-14 in slot order (`PAIR_WORD_BITS`:
    group A at K 2t, 2t+1, 2t+8, 2t+9, then group B): the math of `_decode_ptx` in Triton, for the
    interpreter, the decode path and the dequantization."""
    w = w.to(tl.uint32, bitcast=True)
    c0, c1 = _register_codes(w & 0x81C081C0)
    c2, c3 = _register_codes(_rotr(w, 4) & 0x81C081C0)
    c4, c5 = _register_codes(_rotr(w, 10) & 0x81C081C0)
    c6, c7 = _register_codes((_rotr(w, 14) & 0x00400040) | (_rotr(w, 6) & 0x81808180))
    return c0, c1, c2, c3, c4, c5, c6, c7


def _paired_dot8_ptx() -> str:
    """PTX of `paired_dot8`: each register's two codes built as fp16 (magnitude at bits 9-11, sign 15: as
    `_register_codes`, straight from rotations of the word), each half converted to fp32 and multiplied
    into its group's sum (as `nvfp4_gemm._dot8_ptx` for the checkpoint layout; Triton's compile of
    `paired_codes` took 13% more instructions and 168 registers in the decode path's gate_up, sm_90)."""
    lines = ["{", ".reg .b32 t, u;", ".reg .b16 lo, hi;", ".reg .f32 c;"]
    for r in range(4):
        masks: dict[int, int] = {}
        for b, fp16_bit in enumerate((9, 10, 11, 15)):
            rot = (ROTATE[r][b] + BF16_BIT[b] - fp16_bit) % 32
            masks[rot] = masks.get(rot, 0) | 0x10001 << fp16_bit
        for i, (rot, mask) in enumerate(masks.items()):
            src = "$2"
            if rot:
                lines.append(f"shf.r.wrap.b32 t, $2, $2, {rot};")
                src = "t"
            lines.append(f"and.b32 {'u' if i == 0 else 't'}, {src}, {mask:#010x};")
            if i:
                lines.append("or.b32 u, u, t;")
        acc, x = f"${r // 2}", 3 + 2 * r
        first = f"mul.rn.f32 {acc}, c, ${x};" if r % 2 == 0 else f"fma.rn.f32 {acc}, c, ${x}, {acc};"
        lines += ["mov.b32 {lo, hi}, u;", "cvt.f32.f16 c, lo;", first, "cvt.f32.f16 c, hi;",
                  f"fma.rn.f32 {acc}, c, ${x + 1}, {acc};"]
    return "\n".join(lines + ["}"])


_PAIRED_DOT8_PTX = tl.constexpr(_paired_dot8_ptx())


@triton.jit
def paired_dot8(w, x0, x1, x2, x3, x4, x5, x6, x7, INTERPRET: tl.constexpr):
    """Paired words (uint32) times the x of their 8 slots (fp32, broadcast against w): (group A's sum,
    group B's), fp32 * 2^-14. One inline PTX block a word on the GPU, `paired_codes` in the interpreter."""
    if INTERPRET:
        c0, c1, c2, c3, c4, c5, c6, c7 = paired_codes(w)
        a = c0 * x0 + c1 * x1 + c2 * x2 + c3 * x3
        b = c4 * x4 + c5 * x5 + c6 * x6 + c7 * x7
    else:
        a, b = tl.inline_asm_elementwise(
            _PAIRED_DOT8_PTX, "=f,=f,r,f,f,f,f,f,f,f,f", [w, x0, x1, x2, x3, x4, x5, x6, x7],
            dtype=(tl.float32, tl.float32), is_pure=True, pack=1,
        )
    return a, b


@triton.jit
def _k_order(c0, c1, c2, c3):
    """One group's four slot tensors [R, 4 words] (K 2t, 2t+1, 2t+8, 2t+9 of word t) -> [R, 16] in K order."""
    both = tl.join(tl.join(c0, c1), tl.join(c2, c3))  # [R, t, c, h]: K 8 h + 2 t + c
    return tl.reshape(tl.permute(both, (0, 3, 1, 2)), (both.shape[0], 16))


@triton.jit
def _halves(x):
    """x [BN, 2 n] -> (x[:, :n], x[:, n:]) within each thread's registers."""
    return tl.split(tl.permute(tl.reshape(x, (x.shape[0], 2, x.shape[1] // 2)), (0, 2, 1)))


def _scales_ptx() -> str:
    """Two rows' scale words ($4, $5: four e4m3 bytes each, non-negative, `pair_scales` checks) -> $0..$3,
    scale i of both rows as bf16x2 times 2^100: a byte's seven low bits go to bf16 bits 4-10 (e4m3 * 2^-120,
    its subnormals as bf16 subnormals, exact), then two exact bf16x2 multiplies by 2^110 (sm_90 SASS: two
    instructions a scale where the fp16 -> fp32 -> bf16 route took five)."""
    lines = ["{", ".reg .b32 t, u, k;", "mov.b32 k, 0x76807680;"]  # bf16x2 2^110
    for half, sel in enumerate(("0x5410", "0x7632")):  # bytes [a0, a1, b0, b1], then [a2, a3, b2, b3]
        lines.append(f"prmt.b32 t, $4, $5, {sel};")
        for i, shift in enumerate(("shl.b32 u, t, 4;", "shr.b32 u, t, 4;")):
            out = f"${2 * half + i}"
            lines += [shift, "and.b32 u, u, 0x07F007F0;", "mul.rn.bf16x2 u, u, k;",
                      f"mul.rn.bf16x2 {out}, u, k;"]
    return "\n".join(lines + ["}"])


_SCALES_PTX = tl.constexpr(_scales_ptx())


@triton.jit
def _word_scales(w, INTERPRET: tl.constexpr):
    """Each row's scale word [BN] (int32, or int16 for its two low bytes) -> its four scales times 2^100:
    bf16 on the GPU (`_scales_ptx`, the thread's two rows in one register), fp32 in the interpreter."""
    w = w.to(tl.int32)
    if INTERPRET:
        r = (_scale(w), _scale(w >> 8), _scale(w >> 16), _scale(w >> 24))
    else:
        r = tl.inline_asm_elementwise(_SCALES_PTX, "=r,=r,=r,=r,r,r", [w], dtype=(tl.bfloat16,) * 4,
                                      is_pure=True, pack=2)
    return r


@triton.jit
def _iteration_scales(s, STEPS: tl.constexpr, INTERPRET: tl.constexpr):
    """A row's 2 STEPS block scales of one iteration as little-endian words [BN, WORDS] (`_launch`: int16
    for STEPS 1, one int32 for 2, two for 4) -> (A, B) of each block in order, 2 STEPS tensors [BN]
    (`_word_scales`; block 0's twice when STEPS is 1)."""
    if STEPS == 4:
        w0, w1 = tl.split(s)
        a0, b0, a1, b1 = _word_scales(w0, INTERPRET)
        a2, b2, a3, b3 = _word_scales(w1, INTERPRET)
        r = (a0, b0, a1, b1, a2, b2, a3, b3)
    else:
        a0, b0, a1, b1 = _word_scales(tl.reshape(s, (s.shape[0],)), INTERPRET)
        if STEPS == 1:
            r = (a0, b0, a0, b0)
        else:
            r = (a0, b0, a1, b1)
    return r


@triton.jit
def _iteration_blocks(b, STEPS: tl.constexpr):
    """A row's 4 STEPS paired words of one iteration [BN, 4 STEPS] -> its STEPS blocks [BN, 4] in order
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
def _bf16_halves(r):
    """bf16x2 registers as int32 [R, 4] -> (low halves, high halves), bf16 [R, 4] each."""
    lo = (r & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    hi = (r >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return lo, hi


@triton.jit
def _cat(x, y):
    """[R, n] and [R, n] -> [R, 2 n], x's columns first (a relabelling of registers)."""
    return tl.reshape(tl.permute(tl.join(x, y), (0, 2, 1)), (x.shape[0], 2 * x.shape[1]))


@triton.jit
def _block_tile(w, sa, sb, INTERPRET: tl.constexpr):
    """One 32-code block's weight tile: w [BN, 4] its paired words; sa, sb [BN] its two scales * 2^100
    (`_word_scales`) -> [BN, 32] in K order (group A's 16 codes, then B's). On the GPU bf16 code * scale
    * 2^-26 (`_decode_ptx` a word: the inline PTX takes whole words, as a byte tensor's packs of four mix
    the rows r and r + 8 of the MMA operand); the interpreter runs no PTX and flushes bf16 subnormals, so
    there fp32 of the same values."""
    if INTERPRET:
        c0, c1, c2, c3, c4, c5, c6, c7 = paired_codes(w)
        wa = _k_order(c0, c1, c2, c3) * sa[:, None] * 1.925929944387236e-34  # * 2^-112
        wb = _k_order(c4, c5, c6, c7) * sb[:, None] * 1.925929944387236e-34
    else:
        sa = tl.broadcast_to(sa[:, None], w.shape)
        sb = tl.broadcast_to(sb[:, None], w.shape)
        r0, r1, r2, r3 = tl.inline_asm_elementwise(_DECODE_PTX, "=r,=r,=r,=r,r,h,h", [w, sa, sb],
                                                   dtype=(tl.int32,) * 4, is_pure=True, pack=1)
        a0, a1 = _bf16_halves(r0)
        a8, a9 = _bf16_halves(r1)
        b0, b1 = _bf16_halves(r2)
        b8, b9 = _bf16_halves(r3)
        wa = _k_order(a0, a1, a8, a9)
        wb = _k_order(b0, b1, b8, b9)
    return _cat(wa, wb)


@triton.jit
def _iteration_tile(bw, sc, STEPS: tl.constexpr, INTERPRET: tl.constexpr):
    """An iteration's STEPS blocks (`_iteration_blocks`, `_iteration_scales`) -> its weight tile [BN, 32
    STEPS] in K order, the A operand of one `tl.dot`: Triton then issues the iteration's 2 STEPS wgmmas
    back to back and waits once, where a dot per 16-code group waited after each (sm_90 SASS)."""
    t = _block_tile(bw[0], sc[0], sc[1], INTERPRET)
    if STEPS == 2:
        t = _cat(t, _block_tile(bw[1], sc[2], sc[3], INTERPRET))
    elif STEPS == 4:
        t01 = _cat(t, _block_tile(bw[1], sc[2], sc[3], INTERPRET))
        t23 = _cat(_block_tile(bw[2], sc[4], sc[5], INTERPRET), _block_tile(bw[3], sc[6], sc[7], INTERPRET))
        t = _cat(t01, t23)
    return t


@triton.jit
def expert_rows(w_ptr, s_ptr, e, rows, stride_we, stride_wn, stride_sk, stride_se, stride_sn,  #
                STEPS: tl.constexpr):
    """(w_ptrs [BN, 4 STEPS], s_ptrs [BN, WORDS]) of expert e's `rows` at K = 0, for `expert_tile_dot`: a
    row's 4 STEPS paired words an iteration, and its 2 STEPS block scales as WORDS words (`pair_scales`:
    one 32-bit word a row and 64-code block, rows adjacent; STEPS 1 a 16-bit half; s_ptr and its strides
    in words), 4 bytes a thread, which Triton pipelines by cp.async; as bytes a thread got 2 of STEPS 2's 4
    and loaded them synchronously (sm_90 SASS), and byte loads stalled on L1 (ncu, H200)."""
    WORDS: tl.constexpr = 2 if STEPS == 4 else 1
    w_ptrs = w_ptr + e * stride_we + rows[:, None] * stride_wn + tl.arange(0, 4 * STEPS)[None, :]
    s_ptrs = s_ptr + e * stride_se + rows[:, None] * stride_sn + (tl.arange(0, WORDS) * stride_sk)[None, :]
    return w_ptrs, s_ptrs


@triton.jit
def expert_tile_dot(x_ptrs, valid, w_ptrs, s_ptrs, row_ok, k_base, N, stride_wn, stride_sk, stride_sn,  #
                    ITERATIONS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,  #
                    STEPS: tl.constexpr, GATE_UP: tl.constexpr, INTERPRET: tl.constexpr):
    """One expert's weight tile times x^T over ITERATIONS iterations of 32 STEPS codes from K = k_base:
    (acc, acc_up) fp32 [BLOCK_N, BLOCK_M] (acc_up zero unless GATE_UP: the up rows, N rows below the gate
    rows). x_ptrs [32 STEPS, BLOCK_M] point at K = 0 of each column's x row (columns not `valid` read as
    zero); w_ptrs [BLOCK_N, 4 STEPS] at each row's first word, s_ptrs at its first scale word. ITERATIONS is
    a constexpr: a loop that may run zero times defines the accumulators outside the MMA pipeline, and
    ptxas then serializes the wgmmas (`sm90_report`)."""
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for i in range(ITERATIONS):
        k0 = k_base + i * 32 * STEPS
        s_off = (k0 // 64) * stride_sk + (k0 // 32) % 2 if STEPS == 1 else (k0 // 64) * stride_sk
        sc = _iteration_scales(tl.load(s_ptrs + s_off, mask=row_ok, other=0), STEPS, INTERPRET)
        bw = _iteration_blocks(tl.load(w_ptrs + k0 // 8, mask=row_ok, other=0), STEPS)
        x = tl.load(x_ptrs + k0, mask=valid[None, :], other=0.0)
        if INTERPRET:  # the interpreter multiplies bf16 dot operands as raw bits
            x = x.to(tl.float32)
        acc = tl.dot(_iteration_tile(bw, sc, STEPS, INTERPRET), x, acc)
        if GATE_UP:
            sc_up = _iteration_scales(tl.load(s_ptrs + N * stride_sn + s_off, mask=row_ok, other=0), STEPS,
                                      INTERPRET)
            bw_up = _iteration_blocks(tl.load(w_ptrs + N * stride_wn + k0 // 8, mask=row_ok, other=0), STEPS)
            acc_up = tl.dot(_iteration_tile(bw_up, sc_up, STEPS, INTERPRET), x, acc_up)
    return acc, acc_up


@triton.jit
def _moe_tc_kernel(
    a_ptr, w_ptr, s_ptr, ts_ptr, out_ptr, route_w_ptr,  #
    sorted_ptr, block_expert_ptr, num_padded_ptr,  #
    NUMEL, N, A_DIV,  #
    stride_am, stride_we, stride_wn, stride_sk, stride_se, stride_sn, stride_om,  #
    K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, STEPS: tl.constexpr,  #
    GATE_UP: tl.constexpr, INTERPRET: tl.constexpr,  #
    PDL: tl.constexpr = False,  #
):
    """GATE_UP: out[entry, n] = silu(gate[n] . a[tok]) * (up[n] . a[tok]), tok = entry // A_DIV.
    Else (down): out[entry, n] = route_w[entry] * (w[n] . a[entry]). One expert's BLOCK_M entries and
    BLOCK_N rows n a program; accumulators are [BLOCK_N, BLOCK_M] (rows x entries)."""
    pdl.enter(PDL)
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
    w_ptrs, s_ptrs = expert_rows(w_ptr, s_ptr, e, rows, stride_we, stride_wn, stride_sk, stride_se, stride_sn,
                                 STEPS)
    x_ptrs = a_ptr + a_rows[None, :] * stride_am + tl.arange(0, 32 * STEPS)[:, None]  # x^T [32 STEPS, BM]
    acc, acc_up = expert_tile_dot(x_ptrs, valid, w_ptrs, s_ptrs, mask_n[:, None], 0, N, stride_wn,  #
                                  stride_sk, stride_sn, K // (32 * STEPS), BLOCK_N, BLOCK_M, STEPS,  #
                                  GATE_UP, INTERPRET)
    if GATE_UP:
        acc = acc * (tl.load(ts_ptr + e * 2) * 67108864.0)  # tensor scale * 2^26
        acc_up = acc_up * (tl.load(ts_ptr + e * 2 + 1) * 67108864.0)
        acc = acc * tl.sigmoid(acc) * acc_up
    else:
        acc = acc * (tl.load(ts_ptr + e) * 67108864.0)
        acc = acc * tl.load(route_w_ptr + entry, mask=valid, other=0.0)[None, :]
    out_ptrs = out_ptr + entry.to(tl.int64)[None, :] * stride_om + rows[:, None]
    tl.store(out_ptrs, bf16_rne(acc, INTERPRET), mask=valid[None, :] & mask_n[:, None])


def fit_steps(k: int, steps: int, split: int = 1) -> tuple[int, int]:
    """(STEPS, SPLIT) at most the config's with K a multiple of 32 STEPS SPLIT: splits halve first, then the
    blocks an iteration (K is a multiple of 32: `pair_groups` checks)."""
    while k % (32 * steps * split) and split > 1:
        split //= 2
    while k % (32 * steps * split):
        steps //= 2
    return steps, split


def scale_words(scale: torch.Tensor, steps: int) -> torch.Tensor:
    """Paired block scales `[K/64, E', N, 4]` as `expert_rows` reads them: int32 words `[K/64, E', N]`, or
    for STEPS 1 int16 halves `[K/64, E', N, 2]`."""
    return scale.view(torch.int16) if steps == 1 else scale.view(torch.int32).squeeze(-1)


def _launch(a, w: MoEWeights, gate_up: bool, out, route_w, sorted_ids, block_expert, num_padded,
            numel: int, a_div: int, cfg: MoETCConfig) -> None:
    wt, st = (w.w13, w.w13_scale) if gate_up else (w.w2, w.w2_scale)
    wt = wt.view(torch.int32)  # the paired words
    ts = w.w13_tensor_scale if gate_up else w.w2_tensor_scale
    n = w.intermediate if gate_up else w.hidden
    block_n, warps, stages, steps = cfg.gate_up if gate_up else cfg.down
    k = a.shape[1]
    if steps not in (1, 2, 4):
        raise ValueError(f"MoETCConfig: STEPS must be 1, 2 or 4, got {steps}")
    steps, _ = fit_steps(k, steps)
    st = scale_words(st, steps)
    _moe_tc_kernel[(block_expert.numel(), triton.cdiv(n, block_n))](
        a, wt, st, ts, out, route_w,  #
        sorted_ids, block_expert, num_padded,  #
        numel, n, a_div,  #
        a.stride(0), wt.stride(0), wt.stride(1), st.stride(0), st.stride(1), st.stride(2), out.stride(0),  #
        K=k, BLOCK_N=block_n, BLOCK_M=cfg.block_m, STEPS=steps, GATE_UP=gate_up, INTERPRET=interpreting(),  #
        num_warps=warps, num_stages=stages, maxnreg=cfg.max_regs or None, **pdl.launch(out.device),  #
    )


@triton.jit
def _dequant_paired_kernel(
    w_ptr, s_ptr, ts_ptr, out_ptr,  #
    N, PAIRS, TS_ROWS,  #
    stride_wn, stride_sk, stride_on,  #
    BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, INTERPRET: tl.constexpr,  #
):
    """Paired rows [BLOCK_N, BLOCK_P 32-code blocks] -> bf16 (as `nvfp4_gemm._nvfp4_dequant_kernel`);
    codes as int32 words (stride_wn in words), scales in the paired layout (`scale_offset`). The codes are
    put in K order in registers, so that each row's BLOCK_P * 32 values are one contiguous store (2-byte
    scattered stores ran at ~5% of the bandwidth)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    pairs = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_rp = (rows < N)[:, None] & (pairs < PAIRS)[None, :]
    word = pairs[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]  # [1, P, 4]
    w = tl.load(w_ptr + rows[:, None, None] * stride_wn + word, mask=mask_rp[:, :, None], other=0)
    c0, c1, c2, c3, c4, c5, c6, c7 = paired_codes(tl.reshape(w, (BLOCK_N * BLOCK_P, 4)))
    s_ptrs = s_ptr + scale_offset(rows[:, None], 2 * pairs[None, :], stride_sk)
    ts = tl.load(ts_ptr + rows // TS_ROWS, mask=rows < N, other=0.0)[:, None] * 4194304.0
    sa = tl.reshape(e4m3_to_f32(tl.load(s_ptrs, mask=mask_rp, other=0)) * ts, (BLOCK_N * BLOCK_P, 1))
    sb = tl.reshape(e4m3_to_f32(tl.load(s_ptrs + 1, mask=mask_rp, other=0)) * ts, (BLOCK_N * BLOCK_P, 1))
    lo = bf16_rne(_k_order(c0, c1, c2, c3) * sa, INTERPRET)  # K 0-15 of a pair
    hi = bf16_rne(_k_order(c4, c5, c6, c7) * sb, INTERPRET)  # K 16-31
    val = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BLOCK_N, BLOCK_P * 32))
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
    words = packed.view(torch.int32)
    _dequant_paired_kernel[grid](
        words, block_scale.view(torch.uint8), tensor_scale.reshape(-1), out,  #
        n, kb // 16, ts_rows,  #
        words.stride(0), block_scale.stride(0), out.stride(0),  #
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
