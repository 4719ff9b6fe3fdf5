"""Compile the attention, KV-store, DeltaNet, MoE, FP8 GEMV and small-op kernels for sm_90 on any machine
(no GPU needed) and report registers, spilled bytes, shared memory, the instruction mix of each and the
programs an SM holds.

Each kernel is reached through its real launcher at its production config: the launcher runs on CPU
tensors with the Triton launch replaced by a capture, so signature, constexprs, warps and stages are
what the H200 would compile (pointer and multiple-of-16 integer arguments get Triton's runtime
divisibility hint). `cuobjdump` from Triton's own package reads the cubin, and its `ptxas -v` says
whether it serialized the kernel's wgmmas (info C7515: each waits for the one before, as `moe_tc`'s did
until session 12, because a zero-trip loop defined the accumulators outside the MMA pipeline). Not a
timing: it answers "does it compile for Hopper, does it spill, does it use wgmma / cp.async, are its
wgmmas pipelined, does a loop wait on memory twice an iteration (`late LDG`), how many instructions
does a warp issue an iteration of its K loop (`loop instr`; `--mix` adds their opcodes)" before a GPU
is available.
The PDL column checks that a kernel launched with programmatic dependent launch (`kernels/pdl.py`)
waits for the kernel before it ahead of any global memory access.
Run `python -m batchinfer.bench.sm90_report` (with TRITON_INTERPRET unset); exit status 1 when a
kernel fails to compile, spills more than `--max-spill` bytes or, launched with PDL, touches memory
before its wait or never waits.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from batchinfer.kernels import (
    attention,
    causal_conv1d,
    fp8_gemm,
    fp8_rows_mm,
    gdn,
    gdn_chunk,
    kv_cache,
    moe,
    moe_align,
    moe_direct,
    moe_tc,
    norm_route,
    nvfp4_gemm,
    nvfp4_rows_tc,
    pdl,
    qk_norm_rope,
    sampling,
    small_ops,
)
from batchinfer.kernels.moe_weights import MoEWeights
from batchinfer.kernels.nvfp4 import quantize_fp8, quantize_nvfp4
from batchinfer.sam3 import norm_triton, rope_triton
from batchinfer.sam3.vit import axial_rope

# fmt: off
_MODULES = (attention, causal_conv1d, fp8_gemm, fp8_rows_mm, gdn, gdn_chunk, kv_cache, moe, moe_align,
            moe_direct, moe_tc, norm_route, nvfp4_gemm, nvfp4_rows_tc, qk_norm_rope, sampling, small_ops,
            norm_triton, rope_triton)
# fmt: on

_PDL_LAUNCH = pdl.launch

_PTR_TYPES = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.uint8: "*u8",
    torch.float8_e4m3fn: "*fp8e4nv",
}
_OPS = ("HGMMA", "HMMA", "LDGSTS", "LDL", "STL")


def _capture(kernel: triton.JITFunction, launch: Callable[[], Any]) -> tuple[list[Any], dict[str, Any]]:
    """Run `launch()` with every kernel launch of our modules recorded instead of made; returns the
    (args, kwargs) of `kernel`'s launch."""
    seen: dict[str, tuple[tuple, dict]] = {}
    kernels = {  # by identity: modules import each other's jitted helpers
        id(k): k for mod in _MODULES for k in vars(mod).values() if isinstance(k, triton.JITFunction)
    }.values()
    for k in kernels:
        k.run = lambda *args, grid, warmup, _k=k, **kwargs: seen.setdefault(_k.__name__, (args, kwargs))
    pdl.launch = lambda device: {"PDL": True, "launch_pdl": True}  # as on the H200 (the tensors are CPU's)
    try:
        launch()
    finally:
        for k in kernels:
            del k.run
        pdl.launch = _PDL_LAUNCH
    args, kwargs = seen[kernel.__name__]
    return list(args), kwargs


def _source(
    kernel: triton.JITFunction, args: list[Any], kwargs: dict[str, Any]
) -> tuple[ASTSource, dict[str, Any], dict[str, int]]:
    """The ASTSource Triton's runtime would build for this launch, its constexprs and its options."""
    values = dict(zip(kernel.arg_names, args, strict=False)) | kwargs
    options = {k: values.pop(k) for k in ("num_warps", "num_stages", "launch_pdl", "maxnreg") if k in values}
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        v = values[p.name]
        if p.is_constexpr:
            sig[p.name], consts[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = _PTR_TYPES[v.dtype]
            if v.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            sig[p.name] = "i32" if -(2**31) <= v < 2**31 else "i64"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs), consts, options


def _loops(sass: str) -> tuple[list[tuple[int, str]], list[tuple[int, int]]]:
    """The SASS as (address, instruction) pairs, and the loop bodies: the address ranges that backward
    branches close."""
    code = [(int(a, 16), ins) for a, ins in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for addr, ins in code:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    return code, loops


def loop_loads(sass: str) -> int:
    """Synchronous global loads (`LDG`; cp.async is `LDGSTS`) inside loop bodies: loads Triton's pipeliner
    left in a loop, each a wait on memory every iteration (`moe_tc`'s 2-byte scale loads were one,
    session 7)."""
    code, loops = _loops(sass)
    return sum(
        1 for addr, ins in code if re.search(r"\bLDG\b", ins) and any(lo <= addr <= hi for lo, hi in loops)
    )


def _largest_inner_loop(sass: str) -> list[str]:
    """The instructions of the largest innermost loop body (none without a loop)."""
    code, loops = _loops(sass)
    inner = [
        (lo, hi) for lo, hi in loops if not any(lo <= a < b <= hi and (a, b) != (lo, hi) for a, b in loops)
    ]
    bodies = [[ins for a, ins in code if lo <= a <= hi] for lo, hi in inner]
    return max(bodies, key=len, default=[])


def loop_instructions(sass: str) -> int:
    """Instructions in the largest innermost loop body (0 without a loop): an iteration's issue cost. A
    warp scheduler issues one instruction a cycle, so for a K loop that decodes weights in registers
    (`moe_tc`, the direct path) this count over the bytes an iteration loads bounds the bandwidth an SM
    can reach however well latency is hidden (docs/PERF.md, session 37)."""
    return len(_largest_inner_loop(sass))


def loop_mix(sass: str) -> str:
    """That loop's opcodes by count, most first ("LOP3 96, HMUL2 96, ..."; predicates and modifiers
    dropped): which units an iteration keeps busy."""
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0]
                              for ins in _largest_inner_loop(sass))  # fmt: skip
    return ", ".join(f"{op} {n}" for op, n in ops.most_common())


def late_loop_loads(sass: str) -> int:
    """Synchronous global loads (`LDG`) in a loop body after its first floating-point multiply-add or
    multiply: each is a second wait on memory an iteration, issued only once the math before it has its
    operands. The one-row NVFP4 kernels read their block scales after decoding the codes this way until
    session 27 (the scale loads followed the dots in source order; ptxas kept that order)."""
    code, loops = _loops(sass)
    late = set()
    for lo, hi in loops:
        body = [(a, i) for a, i in code if lo <= a <= hi]
        first_math = next((a for a, i in body if re.search(r"\b(FFMA|FMUL)\b", i)), None)
        if first_math is not None:
            late |= {a for a, i in body if a > first_math and re.search(r"\bLDG\b", i)}
    return len(late)


def wgmma_serialized(ptx: str) -> str:
    """ptxas's reason for serializing the kernel's wgmmas (info C7515), or "" when it did not."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(90).path, "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "k.cubin")]
        info = subprocess.run(cmd, capture_output=True, text=True).stderr
    m = re.search(
        r"C7515\)[^:]*: wgmma.mma_async instructions are serialized due to (.*?)(?: in the function|$)", info
    )
    return m.group(1) if m else ""


def pdl_order(sass: str, launch_pdl: bool) -> str:
    """Under programmatic dependent launch a kernel may start before the one it depends on has finished,
    so every program must wait (`griddepcontrol.wait`, SASS `ACQBULK`) before its first global memory
    access, and trigger the next launch (`PREEXIT`). From the machine code: "wait first" when it does,
    "LATE" when an access comes first, "NO WAIT" when a kernel launched with it never waits (both races),
    "" for a plain launch without a wait."""
    code = re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)
    wait = next((i for i, ins in enumerate(code) if re.search(r"\bACQBULK\b", ins)), None)
    if wait is None:
        return "NO WAIT" if launch_pdl else ""
    mem = r"\b(LDG|STG|LDGSTS|ATOMG?|REDG?|LD|ST|UTMALDG|UTMASTG|UTMAPF|UBLKCP)\b"
    first = next((i for i, ins in enumerate(code) if re.search(mem, ins)), len(code))
    triggers = any(re.search(r"\bPREEXIT\b", ins) for ins in code)
    return "wait first" if first > wait and triggers else "LATE"


def ctas_per_sm(regs: int, warps: int, smem: int) -> int:
    """Programs an H100/H200 SM holds at once (sm_90 limits: 64K registers allocated 8 a thread in whole
    warps, 228 KiB of shared memory with 1 KiB reserved a block, 64 warps, 32 blocks). A kernel whose
    programs are long chains of dependent steps (loads, dots, barriers) runs faster with more of them to
    interleave: the occupancy half of "is it latency-bound", which a compile alone can answer."""
    by_regs = 65536 // (-(-regs // 8) * 8 * 32 * warps)
    by_smem = (228 * 1024) // (smem + 1024)
    return min(by_regs, by_smem, 64 // warps, 32)


def compile_report(kernel: triton.JITFunction, launch: Callable[[], Any]) -> dict[str, Any]:
    """Compile the launch `launch()` would make for sm_90; registers, spill bytes, smem, op counts, and
    whether ptxas serialized its wgmmas."""
    src, consts, options = _source(kernel, *_capture(kernel, launch))
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "--dump-sass", f.name], capture_output=True, text=True).stdout
    regs, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
    tiles = {k: v for k, v in consts.items() if isinstance(v, int) and not isinstance(v, bool)}
    return {
        "kernel": kernel.__name__,
        "config": tiles | options,
        "regs": regs,
        "spill_bytes": stack,
        "smem": compiled.metadata.shared,
        **{op: len(re.findall(rf"\b{op}\b", sass)) for op in _OPS},
        "loop instr": loop_instructions(sass),
        "loop mix": loop_mix(sass),
        "loop LDG": loop_loads(sass),
        "late LDG": late_loop_loads(sass),
        "wgmma serialized": wgmma_serialized(compiled.asm["ptx"]) if "HGMMA" in sass else "",
        "CTAs/SM": ctas_per_sm(regs, options.get("num_warps", 4), compiled.metadata.shared),
        "PDL": pdl_order(sass, bool(options.get("launch_pdl"))),
    }


def _t(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


def _attention_launches(H: int, Hkv: int, Dh: int, rot: int, gated: bool) -> Iterator[tuple]:
    T, B, L = 64, 32, 512
    qg = _t(T, H, 2 * Dh)
    q, gate = qg[..., :Dh], qg[..., Dh:] if gated else None
    k, v = _t(T, Hkv, Dh), _t(T, Hkv, Dh)
    cu = torch.tensor([0, T], dtype=torch.int32)
    w, inv = _t(Dh), qk_norm_rope.rope_inv_freq(rot, 1e7)
    yield (
        f"Dh={Dh}",
        qk_norm_rope._qk_norm_rope_kernel,
        lambda: qk_norm_rope.qk_norm_rope(q, k, w, w, torch.arange(T), inv, 1e-6, gated),
    )
    yield (
        f"Dh={Dh}",
        attention._prefill_attn_kernel,
        lambda: attention.prefill_attention(q, k, v, cu, T, gate=gate),
    )
    kc, vc = _t(B, Hkv, L, Dh), _t(B, Hkv, L, Dh)
    lens, slots = torch.full((B,), L, dtype=torch.int32), torch.arange(B)
    k8, v8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    for name, caches in (("bf16", (kc, vc, None, None)), ("fp8", (k8, v8, *torch.ones(2, B, Hkv, L)))):
        store = (v[:B], *caches, slots.int())
        norm_store = lambda store=store: qk_norm_rope.qk_norm_rope(
            q[:B], k[:B], w, w, lens, inv, 1e-6, gated, store
        )
        yield f"Dh={Dh} B={B} KV store {name}", qk_norm_rope._qk_norm_rope_kernel, norm_store
    past, one = torch.full((1,), 100, dtype=torch.int32), slots[:1].int()
    yield (
        f"Dh={Dh} chunked prefill",
        attention._prefill_attn_kernel,
        lambda: attention.prefill_attention_cached(q, kc, vc, cu, one, past, T, gate=gate),
    )
    qd, gd = q[:B], None if gate is None else gate[:B]
    decode = lambda ctx: attention.decode_attention(qd, kc, vc, slots, lens, max_seqlen=ctx, gate=gd)
    yield f"Dh={Dh} B={B} split-KV", attention._decode_attn_kernel, lambda: decode(L)
    yield f"Dh={Dh} B={B} one split", attention._decode_attn_kernel, lambda: decode(64)
    yield f"Dh={Dh}", attention._decode_combine_kernel, lambda: decode(L)
    ks, vs = torch.ones(B, Hkv, L), torch.ones(B, Hkv, L)
    yield (
        f"Dh={Dh} B={B} split-KV, FP8 cache",
        attention._decode_attn_kernel,
        lambda: attention.decode_attention(qd, k8, v8, slots, lens, gate=gd, k_scale=ks, v_scale=vs),
    )
    yield (
        f"Dh={Dh} chunked prefill, FP8 cache",
        attention._prefill_attn_kernel,
        lambda: attention.prefill_attention_cached(
            q, k8, v8, cu, one, past, T, gate=gate, k_scale=ks, v_scale=vs
        ),
    )


def _gdn_launches() -> Iterator[tuple]:
    Hk, Hv, D, C, T = 16, 32, 128, 8192, 64
    mixed = _t(T, C)
    q, k = mixed[:, : Hk * D].view(T, Hk, D), mixed[:, Hk * D : 2 * Hk * D].view(T, Hk, D)
    v = mixed[:, 2 * Hk * D :].view(T, Hv, D)
    ab = _t(T, 2 * Hv)
    a_log, dt_bias = torch.rand(Hv), torch.randn(Hv)
    cu, slots = torch.tensor([0, T], dtype=torch.int32), torch.arange(T)
    a, b = ab[:, :Hv], ab[:, Hv:]
    rule = lambda state, **kw: gdn.gated_delta_rule(q, k, v, a, b, a_log, dt_bias, state, **kw)
    s32, s16 = torch.zeros(T, Hv, D, D), torch.zeros(T, Hv, D, D, dtype=torch.bfloat16)
    yield "decode, fp32 state", gdn._delta_rule_kernel, lambda: rule(s32, slot_ids=slots)
    few = lambda: gdn.gated_delta_rule(q[:8], k[:8], v[:8], a[:8], b[:8], a_log, dt_bias, s32, slots[:8])
    yield "decode, fp32 state, 8 rows", gdn._delta_rule_kernel, few  # the tile under 32 rows
    yield "decode, bf16 state", gdn._delta_rule_kernel, lambda: rule(s16, slot_ids=slots)
    past = torch.full((1,), 100, dtype=torch.int32)  # a later piece of a chunked prefill
    yield "prefill", gdn._delta_rule_kernel, lambda: rule(s32, slot_ids=slots[:1], cu_seqlens=cu)
    yield (
        "chunked prefill",
        gdn._delta_rule_kernel,
        lambda: rule(s32, slot_ids=slots[:1], cu_seqlens=cu, past=past),
    )
    chunk = lambda p=None: gdn_chunk.chunk_gated_delta_rule(
        q, k, v, a, b, a_log, dt_bias, s32, slots[:1], cu, T, past=p
    )
    yield "prefill", gdn_chunk._chunk_scores_kernel, chunk
    yield "prefill", gdn_chunk._chunk_inverse_kernel, chunk
    yield "prefill", gdn_chunk._chunk_wu_kernel, chunk
    yield "prefill", gdn_chunk._chunk_state_kernel, chunk
    yield "chunked prefill", gdn_chunk._chunk_state_kernel, lambda: chunk(past)
    yield "prefill", gdn_chunk._chunk_out_kernel, chunk
    cw, cs = _t(C, 4), _t(T, 3, C)
    conv = causal_conv1d
    yield "prefill", conv._conv1d_kernel, lambda: conv.causal_conv1d(mixed, cw, cu, T, cs, slots[:1])
    yield (
        "chunked prefill",
        conv._conv1d_kernel,
        lambda: conv.causal_conv1d(mixed, cw, cu, T, cs, slots[:1], past),
    )
    yield "decode", conv._conv1d_update_kernel, lambda: conv.causal_conv1d_update(mixed, cw, cs, slots)
    yield "", gdn._gated_rmsnorm_kernel, lambda: gdn.gated_rmsnorm(v, v, _t(D), 1e-6)


def _small_op_launches() -> Iterator[tuple]:
    T, V, n = 64, 248320, 8
    x = _t(T, 2048)
    yield "D=2048", small_ops._add_rmsnorm_kernel, lambda: small_ops.add_rmsnorm(x, x, _t(2048), 1e-6, True)
    yield "I=512", small_ops._silu_mul_kernel, lambda: small_ops.silu_mul(_t(T, 1024))
    yield "D=2048", small_ops._embedding_kernel, lambda: small_ops.embedding(torch.arange(T), x)
    yield "A=9 D=2048", small_ops._sum_slots_kernel, lambda: small_ops.sum_slots(_t(T * 9, 2048), 9)
    ones, k = torch.ones(n), torch.ones(n, dtype=torch.int32)
    draw = lambda: sampling.sample(
        _t(n, V, dtype=torch.float32), ones, k, ones * 0.9, torch.arange(n), torch.zeros(n, dtype=torch.int64)
    )
    for kernel in (
        sampling._partial_kernel,
        sampling._init_kernel,
        sampling._search_kernel,
        sampling._draw_kernel,
        sampling._finish_kernel,
    ):
        yield f"V={V}", kernel, draw


def _kv_store_launches(Hkv: int, Dh: int) -> Iterator[tuple]:
    T, S, L = 64, 8, 128  # `store_kv` quantizes on the CPU itself, so its kernel is launched directly here
    k, v = _t(T, Hkv, Dh), _t(T, Hkv, 2 * Dh)[..., :Dh]
    kc = torch.zeros(S, Hkv, L, Dh, dtype=torch.float8_e4m3fn)
    ks = torch.ones(S, Hkv, L)
    idx = torch.arange(T) % S
    # fmt: off
    store = lambda: kv_cache._store_kv_kernel[(T, Hkv)](
        k, v, kc, kc, ks, ks, idx, idx, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), ks.stride(0), ks.stride(1), HEAD_DIM=Dh, FP8=True,
        num_warps=1 if Dh <= 128 else 2, **pdl.launch(kc.device),
    )
    # fmt: on
    yield f"Dh={Dh} FP8", kv_cache._store_kv_kernel, store


def _moe_launches() -> Iterator[tuple]:
    """Qwen3.6's experts in the engine's paired layout (257 with the shared one, D 2048, I 512)."""
    E, D, I = 257, 2048, 512
    u8 = lambda *shape: torch.zeros(*shape, dtype=torch.uint8)
    # fmt: off
    w = MoEWeights(_t(E, D), u8(E, 2 * I, D // 2), u8(E, D, I // 2),
                   u8(D // 64, E, 2 * I, 4), u8(I // 64, E, D, 4),  # scales in `moe_tc.pair_scales`' layout
                   torch.ones(E, 2), torch.ones(E), E - 1, True, paired=True)
    # fmt: on
    ids = lambda t: (torch.arange(t * 9) % E).int().view(t, 9)
    route = lambda: moe.moe_route(_t(1, E), E - 1, 8, True, True)
    yield "T=1, 256 experts + shared", moe._moe_route_kernel, route
    run = lambda t, cfg: moe.moe_experts(_t(t, D), ids(t), torch.rand(t, 9), w, config=cfg)
    decode = lambda: run(8, moe._decode_config(72))
    yield "T=8 paired", moe._moe_decode_gate_up_kernel, decode
    yield "T=8 paired", moe._moe_decode_down_kernel, decode
    norm = lambda t, cfg: moe.moe_experts_add_rmsnorm(  # noqa: E731
        _t(t, D), ids(t), torch.rand(t, 9), w, _t(t, D, dtype=torch.float32), _t(D), 1e-6, True, config=cfg
    )
    yield "T=1 paired + add_rmsnorm", moe._moe_decode_down_kernel, lambda: norm(1, moe._decode_config(9))
    direct = moe_direct.direct_config()
    yield "T=1 paired", moe_direct._moe_direct_gate_up_kernel, lambda: run(1, direct)
    yield "T=1 paired + add_rmsnorm", moe_direct._moe_direct_down_kernel, lambda: norm(1, direct)
    tc = moe.tc_config(16)
    yield "T=32 gate_up, BLOCK_M 16", moe_tc._moe_tc_kernel, lambda: run(32, tc)
    # the register cap the tuner sweeps (`max_regs`): 7 programs an SM instead of 4, no spills (session 29)
    capped = dataclasses.replace(tc, max_regs=80)
    yield "T=32 gate_up, BLOCK_M 16, max_regs 80", moe_tc._moe_tc_kernel, lambda: run(32, capped)
    # the direct path's config is capped at 80 (session 30); beside it the compiler's own choice
    free_direct = dataclasses.replace(direct, max_regs=0)
    yield "T=1 paired, uncapped", moe_direct._moe_direct_gate_up_kernel, lambda: run(1, free_direct)
    out = torch.empty(2 * I, D, dtype=torch.bfloat16)
    dequant = lambda: moe_tc.dequantize_paired_rows(
        w.w13[0], w.w13_scale[:, 0], w.w13_tensor_scale[0], I, out
    )
    yield "one expert's gate_up", moe_tc._dequant_paired_kernel, dequant


def _norm_route_launches() -> Iterator[tuple]:
    """One decode row's norm + router + routing: Qwen3.6 (256 experts + the shared gate, (1 + w) norm) and
    Qwen3-30B (128 experts)."""
    D = 2048
    x, r, norm_w = _t(1, D), _t(1, D, dtype=torch.float32), _t(D)
    for E, shared in ((256, True), (128, False)):
        w = MoEWeights(_t(E + shared, D), *(None,) * 6, E, shared)  # only the router is read
        launch = lambda w=w, s=shared: norm_route.norm_route(x, r, norm_w, 1e-6, s, w, 8, True)  # noqa: E731
        yield f"T=1 D={D}, {E} experts" + " + shared" * shared, norm_route._norm_route_kernel, launch


def _fp8_gemv_launches() -> Iterator[tuple]:
    w, x = quantize_fp8(torch.randn(8192, 2048) * 0.02), _t(1, 2048)  # q_proj, one row
    yield "N=8192 K=2048 M=1", fp8_gemm._fp8_gemv_kernel, lambda: fp8_gemm.fp8_gemm(x, w)
    o_proj = quantize_fp8(torch.randn(2048, 4096) * 0.02)  # 128 row tiles: K in 4 splits on the H200's SMs

    def on_h200(launch: Callable[[], Any]) -> Callable[[], None]:
        def split_k() -> None:
            sms, fp8_gemm.num_sms = fp8_gemm.num_sms, lambda device: 132
            try:
                launch()
            finally:
                fp8_gemm.num_sms = sms

        return split_k

    yield (
        "N=2048 K=4096 M=1",
        fp8_gemm._fp8_gemv_kernel,
        on_h200(lambda: fp8_gemm.fp8_gemm(_t(1, 4096), o_proj)),
    )
    o, z, out_proj = _t(1, 4096), _t(1, 4096), fp8_gemm.stack_fp8([o_proj])  # DeltaNet: 32 heads of 128
    gated = lambda: fp8_gemm.fp8_gemv(o, out_proj, gated_norm=(z, _t(128), 1e-6))  # noqa: E731
    yield "N=2048 K=4096 M=1 gated norm Dv=128", fp8_gemm._fp8_gemv_kernel, on_h200(gated)
    rows = fp8_gemm.stack_fp8([quantize_fp8(torch.randn(12288, 2048) * 0.02)], [_t(64, 2048)])  # qkv|z, b|a
    yield "N=12288+64 bf16 K=2048 M=1", fp8_gemm._fp8_gemv_kernel, lambda: fp8_gemm.fp8_gemv(x, rows)
    conv = (_t(8192, 4), _t(8, 3, 8192), torch.zeros(1, dtype=torch.int32))  # qkv: C = 8192, Kc = 4
    in_proj = lambda: fp8_gemm.fp8_gemv(x, rows, conv=conv)  # noqa: E731
    yield "N=12288+64 bf16 K=2048 M=1 conv C=8192 Kc=4", fp8_gemm._fp8_gemv_kernel, in_proj
    x32 = _t(32, 2048)  # a decode batch of 32 on the same stack
    yield (
        "N=12288+64 bf16 K=2048 M=32",
        fp8_rows_mm._fp8_rows_mm_kernel,
        lambda: fp8_rows_mm.fp8_rows_mm(x32, rows),
    )


def _nvfp4_gemv_launches() -> Iterator[tuple]:
    w, x = quantize_nvfp4(torch.randn(8192, 2048) * 0.02), _t(1, 2048)  # q_proj, one row
    yield "N=8192 K=2048 M=1", nvfp4_gemm._nvfp4_gemv_kernel, lambda: nvfp4_gemm.nvfp4_gemm(x, w)
    rows = nvfp4_gemm.stack_nvfp4([w])  # the engine's group-major rows (lm_head, NVFP4 projections)
    group_major = lambda: nvfp4_gemm.nvfp4_gemv(x, rows)  # noqa: E731
    yield "N=8192 K=2048 M=1 group-major", nvfp4_gemm._nvfp4_gemv_kernel, group_major
    # lm_head's rows (GEMV_WIDE_ROWS and more: the cp.async pipeline), zero codes at the smallest such N
    n = nvfp4_gemm.GEMV_WIDE_ROWS
    codes, scales = torch.zeros(128, n, dtype=torch.int64), torch.zeros(128, n, dtype=torch.uint8)
    wide = nvfp4_gemm.NVFP4Rows(codes, scales, torch.ones(n))
    yield (
        f"N={n} K=2048 M=1 lm_head rows",
        nvfp4_gemm._nvfp4_gemv_kernel,
        lambda: nvfp4_gemm.nvfp4_gemv(x, wide),
    )


def _rows_tc_launches() -> Iterator[tuple]:
    """The few-row NVFP4 linear on the tensor cores: lm_head's row count (zero codes), one row and 32."""
    n, k = nvfp4_gemm.GEMV_WIDE_ROWS, 2048
    codes, scales = (
        torch.zeros(n, k // 8, dtype=torch.int32),
        torch.zeros(k // 64, 1, n, 4, dtype=torch.uint8),
    )
    rows = nvfp4_rows_tc.NVFP4PairedRows(codes, scales, torch.ones(n))
    for m in (1, 32):
        yield (
            f"N={n} K={k} M={m}",
            nvfp4_rows_tc._nvfp4_rows_tc_kernel,
            lambda m=m: nvfp4_rows_tc.nvfp4_rows_tc(_t(m, k), rows),
        )


def _moe_align_launches() -> Iterator[tuple]:
    ids = torch.randint(0, 257, (2048, 9), dtype=torch.int32)  # Qwen3.6 prefill: 257 experts, 9 slots
    align = lambda: moe_align.moe_align(ids, 257, 64)
    for kernel in (moe_align._moe_hist_kernel, moe_align._moe_offsets_kernel, moe_align._moe_scatter_kernel):
        yield "T=2048 E=257 BLOCK_M=64", kernel, align


def _vit_launches() -> Iterator[tuple]:
    """The SAM 3 ViT's two Triton passes at 16 images of 1,008 px (72 x 72 tokens, 24 x 24 windows)."""
    x, norm = _t(16, 72, 72, 1024), torch.nn.LayerNorm(1024).to(torch.bfloat16)
    for window, blocks, tokens in ((24, 16 * 9, 24 * 24), (0, 16, 72 * 72)):  # attention batches x tokens
        y = _t(blocks, tokens, 1024)
        yield (
            f"norm1, window {window}",
            norm_triton._ln_kernel,
            lambda w=window: norm_triton.layer_norm_rows(x, norm, w),
        )
        add = lambda w=window, y=y: norm_triton.add_layer_norm_rows(x, y, norm, w)  # noqa: E731
        yield f"add + norm2, window {window}", norm_triton._ln_kernel, add
        qkv = _t(blocks, tokens, 3072).view(blocks, tokens, 3, 16, 64).permute(2, 0, 3, 1, 4)
        cos, sin = axial_rope(64, window or 72, 1.0, torch.device("cpu"))
        yield (
            f"q, k of {blocks} x {tokens}",
            rope_triton._rope_kernel,
            lambda q=qkv, c=cos, s=sin: rope_triton.apply_rope_triton(q[:2], c, s),
        )


def launches() -> Iterator[tuple[str, triton.JITFunction, Callable[[], Any]]]:
    """(case, kernel, launch) at both models' shapes, production configs."""
    yield from _attention_launches(16, 2, 256, 64, True)
    yield from _attention_launches(32, 4, 128, 128, False)
    yield from _kv_store_launches(2, 256)
    yield from _kv_store_launches(4, 128)
    yield from _gdn_launches()
    yield from _moe_align_launches()
    yield from _moe_launches()
    yield from _norm_route_launches()
    yield from _fp8_gemv_launches()
    yield from _nvfp4_gemv_launches()
    yield from _rows_tc_launches()
    yield from _small_op_launches()
    yield from _vit_launches()


_CHECKS = ("loop instr", "loop LDG", "late LDG", "wgmma serialized", "CTAs/SM", "PDL")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-spill", type=int, default=128, help="largest tolerated spill (stack) in bytes")
    ap.add_argument("--mix", action="store_true", help="add a column: the K loop's opcodes by count")
    args = ap.parse_args()
    columns = (*_OPS, *_CHECKS, *(("loop mix",) if args.mix else ()))
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the report compiles real sm_90 code")
    print("| kernel | case | config | regs | spill B | smem B | " + " | ".join(columns) + " |")
    print("|---" * (6 + len(columns)) + "|")
    failed = False
    for case, kernel, launch in launches():
        try:
            r = compile_report(kernel, launch)
        except Exception as e:  # report every kernel, then fail
            print(f"| {kernel.__name__} | {case} | COMPILE FAILED: {str(e).splitlines()[0][:200]} |")
            failed = True
            continue
        failed |= r["spill_bytes"] > args.max_spill or r["PDL"] in ("LATE", "NO WAIT")
        print(
            f"| {r['kernel']} | {case} | {r['config']} | {r['regs']} | {r['spill_bytes']} | {r['smem']} | "
            + " | ".join(str(r[op]) for op in columns)
            + " |"
        )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
