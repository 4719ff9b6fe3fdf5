"""Benchmark cases for the linear kernels (NVFP4 W4A16, FP8 W8A16) and the fused MoE, both models.

Baselines: "dequant+cublas" (the weight's torch `dequantize` to bf16, then `x @ W^T`), "cublas_bf16"
(`x @ W^T` on a bf16 weight already in memory: the same-shape ceiling of issue 5's large-M target)
and, for FP8, "scaled_mm_w8a8" (per-token FP8 activations through cuBLAS `torch._scaled_mm`,
quantization included), which is what an FP8-tensor-core path would reach. The MoE baseline is the
fp32 reference loop over experts (host-synchronising, so timed eagerly). At decode sizes (up to
`STREAM_MAX_M` rows) both also time "stream_read": one launch that only reads the weight bytes the call
must read (`bench.stream_read`), the floor for a kernel of that size on this GPU; the MoE also
"row_tile_read", the same bytes read in its kernels' order (64-row tiles, 64 bytes of a row at a time).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from batchinfer.bench.kernels import KernelCase, Target, Timed, register, rotating_sets
from batchinfer.bench.stream_read import row_tile_read_baseline, stream_read_baseline
from batchinfer.kernels.fp8_gemm import fp8_gemm, stack_fp8
from batchinfer.kernels.fp8_rows_mm import ROWS_MM_MAX_M, fp8_rows_mm
from batchinfer.kernels.moe import fused_moe, moe_experts_ref, moe_route, moe_route_ref
from batchinfer.kernels.moe_tc import pair_moe_weights
from batchinfer.kernels.moe_weights import MoEWeights, stack_moe_weights
from batchinfer.kernels.nvfp4 import FP8Weight, NVFP4Weight, quantize_fp8, quantize_nvfp4
from batchinfer.kernels.nvfp4_gemm import nvfp4_gemm, nvfp4_gemv, stack_nvfp4
from batchinfer.kernels.nvfp4_rows_tc import ROWS_TC_MAX_M, nvfp4_rows_tc, pair_nvfp4_rows
from batchinfer.models.config import ModelConfig

STREAM_MAX_M = 64  # rows (tokens) up to which a call is bandwidth-bound: the stream_read baseline applies


def linear_shapes(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """(name, N, K) of the distinct linears of one model; lm_head last."""
    d = cfg.hidden_size
    q_rows = cfg.num_attention_heads * cfg.head_dim * (2 if cfg.attn_output_gate else 1)
    shapes = [
        ("q_proj", q_rows, d),
        ("kv_proj", cfg.num_key_value_heads * cfg.head_dim, d),
        ("o_proj", d, cfg.num_attention_heads * cfg.head_dim),
    ]
    if cfg.has_linear_attention:
        kd = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        vd = cfg.linear_num_value_heads * cfg.linear_value_head_dim
        shapes += [("in_proj_qkv", 2 * kd + vd, d), ("in_proj_z", vd, d), ("out_proj", d, vd)]
    inter = cfg.moe_intermediate_size
    shapes += [("expert_gate_up", inter, d), ("expert_down", d, inter)]
    shapes.append(("lm_head", cfg.vocab_size, d))
    seen: set[tuple[int, int]] = set()
    return [s for s in shapes if not ((s[1], s[2]) in seen or seen.add((s[1], s[2])))]


def _weights(kind: str, n: int, k: int, count: int, device: torch.device) -> list[NVFP4Weight | FP8Weight]:
    """`count` distinct quantized weights; quantized once on the GPU and perturbed by code bytes."""
    base = torch.randn(n, k, device=device) * 0.02
    w0 = quantize_nvfp4(base) if kind == "nvfp4" else quantize_fp8(base)
    out = [w0]
    for i in range(1, count):
        if kind == "nvfp4":
            out.append(NVFP4Weight(w0.packed.roll(i, dims=1).contiguous(), w0.block_scale, w0.tensor_scale))
        else:  # torch has no roll for float8: roll the bytes
            data = w0.data.view(torch.uint8).roll(i, dims=1).contiguous().view(torch.float8_e4m3fn)
            out.append(FP8Weight(data, w0.scale))
    return out


def _scaled_mm_w8a8(x: torch.Tensor, w_t: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax().float().clamp_min(1e-12) / 448.0  # per-tensor, the scaling cuBLAS takes
    xq = (x.float() / scale).to(torch.float8_e4m3fn)
    return torch._scaled_mm(xq, w_t, scale_a=scale, scale_b=w_scale, out_dtype=torch.bfloat16)


def _linear_timed(
    kind: str, m: int, n: int, k: int, device: torch.device, rows_mm: bool = False, rows_tc: bool = False
) -> Timed:
    """One linear at (m, n, k); `rows_mm`: FP8 as `fp8_rows_mm` on the weight stacked as the engine stacks
    it, `fp8_gemm` (the tile kernel) then among the baselines; `rows_tc`: NVFP4 as `nvfp4_rows_tc` in the
    paired layout, the kernel the call would take otherwise (the one-row GEMV, the fused GEMM) a baseline."""
    w_bytes = n * k // 2 + n * k // 16 if kind == "nvfp4" else n * k
    io_bytes = 2 * m * (k + n)
    sets = rotating_sets(w_bytes + io_bytes)
    ws = _weights(kind, n, k, sets, device)
    xs = [torch.randn(m, k, device=device, dtype=torch.bfloat16) for _ in range(sets)]
    outs = [torch.empty(m, n, device=device, dtype=torch.bfloat16) for _ in range(sets)]
    w_bf16 = [w.dequantize(torch.bfloat16) for w in ws]  # rotated too, so cuBLAS gets no L2 advantage
    run = lambda i: (nvfp4_gemm if kind == "nvfp4" else fp8_gemm)(xs[i], ws[i], out=outs[i])  # noqa: E731
    baselines = {
        "dequant+cublas": lambda i: xs[i] @ ws[i].dequantize(torch.bfloat16).t(),
        "cublas_bf16": lambda i: torch.matmul(xs[i], w_bf16[i].t(), out=outs[i]),
    }
    if kind == "nvfp4" and m == 1:  # the engine's one-row GEMV reads group-major rows (`NVFP4Rows`)
        rows = [stack_nvfp4([w]) for w in ws]
        baselines["gemv_checkpoint_layout"] = run
        run = lambda i: nvfp4_gemv(xs[i], rows[i], out=outs[i])  # noqa: E731
    if rows_tc:
        paired = [pair_nvfp4_rows([w]) for w in ws]
        baselines["nvfp4_gemv" if m == 1 else "nvfp4_gemm"] = run
        run = lambda i: nvfp4_rows_tc(xs[i], paired[i], out=outs[i])  # noqa: E731
    if rows_mm:
        stacked = [stack_fp8([w]) for w in ws]
        baselines["fp8_gemm"] = run
        run = lambda i: fp8_rows_mm(xs[i], stacked[i], out=outs[i])  # noqa: E731
    if m <= STREAM_MAX_M:
        baselines["stream_read"] = stream_read_baseline(w_bytes, sets, device)
    if kind == "fp8" and m >= 16:
        w_t = ws[0].data.t()
        baselines["scaled_mm_w8a8"] = lambda i: _scaled_mm_w8a8(xs[i], w_t, ws[0].scale)
    # The codec's dequantize copies its E2M1 table from the host, which a CUDA graph cannot capture.
    return Timed(
        run=run,
        n_sets=sets,
        bytes=w_bytes + io_bytes,
        flops=2 * m * n * k,
        baselines=baselines,
        eager=frozenset({"dequant+cublas"}),
    )


def _linear_target(m: int) -> Target | None:
    if m <= 16:
        return Target("bandwidth", 0.70)
    if m >= 2048:
        return Target("baseline:cublas_bf16", 0.70)
    return None


@register
def linear_cases(model: str, cfg: ModelConfig, ms: Sequence[int]) -> Iterator[KernelCase]:
    for name, n, k in linear_shapes(cfg):
        for m in ms:
            build = lambda dev, m=m, n=n, k=k: _linear_timed("nvfp4", m, n, k, dev)
            yield KernelCase("nvfp4_gemm", model, f"{name} N={n} K={k}", m, build, _linear_target(m))
        for m in (m for m in ms if m <= ROWS_TC_MAX_M and not name.startswith("expert")):
            build = lambda dev, m=m, n=n, k=k: _linear_timed("nvfp4", m, n, k, dev, rows_tc=True)
            yield KernelCase("nvfp4_rows_tc", model, f"{name} N={n} K={k}", m, build, _linear_target(m))
        if name.startswith(("expert", "lm_head")):
            continue  # FP8 only where NVIDIA's mixed checkpoints use it: attention and DeltaNet projections
        for m in ms:
            yield KernelCase(
                "fp8_gemm",
                model,
                f"{name} N={n} K={k}",
                m,
                lambda dev, m=m, n=n, k=k: _linear_timed("fp8", m, n, k, dev),
            )
        for m in (m for m in ms if 1 < m <= ROWS_MM_MAX_M):  # decode batches: against cuBLAS on bf16
            build = lambda dev, m=m, n=n, k=k: _linear_timed("fp8", m, n, k, dev, rows_mm=True)
            yield KernelCase("fp8_rows_mm", model, f"{name} N={n} K={k}", m, build, _linear_target(m))


def moe_layer(cfg: ModelConfig, device: torch.device) -> MoEWeights:
    """One MoE layer of the model with random NVFP4 experts (and shared expert) and a bf16 router."""
    e, d, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    shared = cfg.shared_expert_intermediate_size > 0
    w_one = [quantize_nvfp4(torch.randn(n, k, device=device) * 0.02) for n, k in ((i, d), (i, d), (d, i))]
    # Distinct experts without quantizing each: roll the codes (timing does not depend on values).
    experts = [
        tuple(NVFP4Weight(w.packed.roll(j, 1).contiguous(), w.block_scale, w.tensor_scale) for w in w_one)
        for j in range(e)
    ]
    gate = torch.randn(1, d, device=device, dtype=torch.bfloat16) if shared else None
    router = torch.randn(e, d, device=device, dtype=torch.bfloat16)
    return stack_moe_weights(router, experts, tuple(w_one) if shared else None, gate)


def _moe_timed(cfg: ModelConfig, t: int, device: torch.device) -> Timed:
    """One layer's fused MoE, NVFP4 experts in the engine's paired layout (the reference reads the
    standard one); bytes = expert bytes the routing actually touches."""
    e, d, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    shared = cfg.shared_expert_intermediate_size > 0
    w = moe_layer(cfg, device)
    paired = pair_moe_weights(w)
    per_expert = 3 * (i * d // 2 + i * d // 16)
    probe = torch.randn(t, d, device=device, dtype=torch.bfloat16)
    touched = moe_route(probe @ w.router.t(), e, cfg.num_experts_per_tok, True, shared)[0].unique().numel()
    io = 2 * t * d * 2
    sets = rotating_sets(touched * per_expert + io, cap=64)
    hs = [probe] + [torch.randn(t, d, device=device, dtype=torch.bfloat16) for _ in range(sets - 1)]
    top_k, slots = cfg.num_experts_per_tok, cfg.num_experts_per_tok + shared

    def reference(j: int) -> torch.Tensor:
        ids, route_w = moe_route_ref(hs[j] @ w.router.t(), e, top_k, True, shared)
        return moe_experts_ref(hs[j], ids, route_w, w)

    baselines = {"reference_loop": reference}
    if t <= STREAM_MAX_M:
        baselines["stream_read"] = stream_read_baseline(touched * per_expert, sets, device)
        baselines["row_tile_read"] = row_tile_read_baseline(touched * per_expert, d // 2, sets, device)
    return Timed(
        run=lambda j: fused_moe(hs[j], paired, top_k, True),
        n_sets=sets,
        bytes=touched * per_expert + io,
        flops=2 * t * slots * 3 * i * d,
        baselines=baselines,
        eager=frozenset({"reference_loop"}),
    )


@register
def moe_cases(model: str, cfg: ModelConfig, ms: Sequence[int]) -> Iterator[KernelCase]:
    shape = f"E={cfg.num_experts} I={cfg.moe_intermediate_size} top{cfg.num_experts_per_tok}" + (
        " +shared" if cfg.shared_expert_intermediate_size else ""
    )
    for m in ms:
        target = Target("bandwidth", 0.60) if m <= 64 else None
        yield KernelCase("fused_moe", model, shape, m, lambda dev, m=m: _moe_timed(cfg, m, dev), target)
