"""Fused MoE for Qwen3-MoE / Qwen3.5-MoE: router top-k, grouped gate_up GEMM with SiLU*up, down GEMM.

Flow (no host sync; CUDA-graph safe): `logits = h @ router^T` (cuBLAS, bf16) -> `moe_route` (one
program per token: fp32 softmax, top-k, renormalise; the shared expert rides along as slot A with
weight sigmoid(shared_gate logit)) -> `moe_align` (entries grouped by expert, BLOCK_M-padded) ->
gate_up GEMM (x rows gathered by token, gate and up tiles of the same columns, `silu(g) * u` in the
fp32 epilogue, written per entry) -> down GEMM (routing weight applied in the epilogue, written per
entry) -> a sum over each token's slots (one pass over `[T, A, D]`, fp32 accumulation).
Weights are stacked at load (`stack_moe_weights`): NVFP4 `uint8 [E', 2I, D/2]` (gate rows then up
rows), e4m3 bytes `[E', 2I, D/16]`, tensor scales `[E', 2]` (gate and up keep their own), down
`[E', D, I/2]`, `[E', D, I/16]`, `[E']`; or bf16 `[E', 2I, D]` / `[E', D, I]`. E' = E + 1 when the shared
expert is stacked as expert E (it needs the routed experts' width, as in Qwen3.5/3.6).
NVFP4 tiles are decoded in registers as in `nvfp4_gemm`; accumulation is fp32; intermediates are bf16
(as in the HF model), so against `fused_moe_ref` (fp32 throughout) expect ~1e-2 relative error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from batchinfer.kernels.moe_align import moe_align
from batchinfer.kernels.nvfp4 import NVFP4Weight
from batchinfer.kernels.nvfp4_gemm import _decode_nvfp4_tile, interpreting

Linear = NVFP4Weight | torch.Tensor


@dataclass(slots=True)
class MoEWeights:
    """One layer's experts stacked for the fused kernels; see the module docstring for layouts."""

    router: torch.Tensor  # bf16 [E (+1 shared gate row), D]
    w13: torch.Tensor  # NVFP4 uint8 [E', 2I, D/2] or bf16 [E', 2I, D]
    w2: torch.Tensor  # NVFP4 uint8 [E', D, I/2] or bf16 [E', D, I]
    w13_scale: torch.Tensor | None  # uint8 e4m3 bits [E', 2I, D/16]
    w2_scale: torch.Tensor | None  # uint8 e4m3 bits [E', D, I/16]
    w13_tensor_scale: torch.Tensor | None  # fp32 [E', 2]
    w2_tensor_scale: torch.Tensor | None  # fp32 [E']
    num_experts: int  # routed experts E
    has_shared: bool

    @property
    def nvfp4(self) -> bool:
        return self.w13_scale is not None

    @property
    def intermediate(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def hidden(self) -> int:
        return self.w2.shape[1]


def stack_moe_weights(
    router: torch.Tensor,
    experts: Sequence[tuple[Linear, Linear, Linear]],
    shared: tuple[Linear, Linear, Linear] | None = None,
    shared_gate: torch.Tensor | None = None,
) -> MoEWeights:
    """Stack per-expert (gate_proj, up_proj, down_proj) weights (all NVFP4 or all bf16) at load time."""
    mats = [*experts, *([shared] if shared is not None else [])]
    if (shared is None) != (shared_gate is None):
        raise ValueError("shared expert and shared_expert_gate must be given together")
    if len(experts) != router.shape[0]:
        raise ValueError(f"router: expected [{len(experts)}, D] for {len(experts)} experts, "
                         f"got {list(router.shape)}")
    shapes = {(g.shape, u.shape, d.shape) for g, u, d in mats}
    if len(shapes) != 1:
        raise ValueError(f"experts (and the shared expert) must share one shape to be stacked, "
                         f"got {sorted(shapes)}")
    quant = isinstance(mats[0][0], NVFP4Weight)
    if any(isinstance(w, NVFP4Weight) != quant for m in mats for w in m):
        raise ValueError("experts mix NVFP4 and dense weights; expected one format for all")
    rows = torch.cat([router, shared_gate.reshape(1, -1)]) if shared_gate is not None else router
    if not quant:
        w13 = torch.stack([torch.cat([g, u]) for g, u, _ in mats]).to(torch.bfloat16).contiguous()
        w2 = torch.stack([d for _, _, d in mats]).to(torch.bfloat16).contiguous()
        return MoEWeights(rows.to(torch.bfloat16).contiguous(), w13, w2, None, None, None, None,
                          len(experts), shared is not None)
    return MoEWeights(
        router=rows.to(torch.bfloat16).contiguous(),
        w13=torch.stack([torch.cat([g.packed, u.packed]) for g, u, _ in mats]),
        w2=torch.stack([d.packed for _, _, d in mats]),
        w13_scale=torch.stack([torch.cat([g.block_scale, u.block_scale]) for g, u, _ in mats]).view(
            torch.uint8
        ),
        w2_scale=torch.stack([d.block_scale for _, _, d in mats]).view(torch.uint8),
        w13_tensor_scale=torch.stack([torch.stack([g.tensor_scale, u.tensor_scale]) for g, u, _ in mats]),
        w2_tensor_scale=torch.stack([d.tensor_scale for _, _, d in mats]),
        num_experts=len(experts),
        has_shared=shared is not None,
    )


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """Launch configuration of the grouped GEMMs: BLOCK_M (also the alignment), then per GEMM
    (BLOCK_N, BLOCK_K, num_warps, num_stages)."""

    block_m: int
    gate_up: tuple[int, int, int, int]
    down: tuple[int, int, int, int]


def _moe_configs(numel: int, experts: int) -> MoEConfig:
    """By average entries per expert; a first guess, not yet tuned on the H200 (tune_kernels --kinds moe)."""
    if interpreting():
        return MoEConfig(16, (16, 32, 4, 1), (16, 32, 4, 1))
    avg = numel / experts
    if avg <= 16:
        return MoEConfig(16, (64, 128, 4, 4), (64, 128, 4, 4))
    if avg <= 48:
        return MoEConfig(32, (64, 128, 4, 4), (64, 128, 4, 4))
    return MoEConfig(64, (128, 64, 8, 3), (128, 64, 8, 3))


@triton.jit
def _moe_route_kernel(
    logits_ptr, ids_ptr, weights_ptr,  #
    E, stride_lt,  #
    TOP_K: tl.constexpr, E_PAD: tl.constexpr, RENORM: tl.constexpr, SHARED: tl.constexpr,  #
):
    t = tl.program_id(0)
    offs = tl.arange(0, E_PAD)
    logits = tl.load(logits_ptr + t * stride_lt + offs, mask=offs < E, other=-float("inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = p / tl.sum(p, axis=0)
    slots = tl.arange(0, TOP_K)
    top_w = tl.zeros((TOP_K,), dtype=tl.float32)
    top_i = tl.zeros((TOP_K,), dtype=tl.int32)
    for k in tl.static_range(TOP_K):  # ties go to the lower expert index, as torch.topk on CUDA
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, offs, E_PAD), axis=0)
        top_w = tl.where(slots == k, best, top_w)
        top_i = tl.where(slots == k, idx, top_i)
        p = tl.where(offs == idx, -1.0, p)
    if RENORM:
        top_w = top_w / tl.sum(top_w, axis=0)
    stride = TOP_K + SHARED
    tl.store(ids_ptr + t * stride + slots, top_i)
    tl.store(weights_ptr + t * stride + slots, top_w)
    if SHARED:
        gate = tl.load(logits_ptr + t * stride_lt + E).to(tl.float32)
        tl.store(ids_ptr + t * stride + TOP_K, E)
        tl.store(weights_ptr + t * stride + TOP_K, tl.sigmoid(gate))


def moe_route(
    logits: torch.Tensor, num_experts: int, top_k: int, renormalize: bool, shared: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits `[T, E (+1)]` -> (ids int32 `[T, A']`, weights fp32 `[T, A']`), A' = top_k (+1 shared).

    Softmax in fp32 over the E routed logits; with `shared`, column E is the shared expert's gate logit.
    """
    t = logits.shape[0]
    if logits.ndim != 2 or logits.shape[1] != num_experts + int(shared) or logits.stride(1) != 1:
        raise ValueError(f"logits: expected [T, {num_experts + int(shared)}] with unit column stride, "
                         f"got {list(logits.shape)} strides {logits.stride()}")
    if top_k & (top_k - 1) or not 0 < top_k <= num_experts:
        raise ValueError(f"top_k: expected a power of two in 1..{num_experts}, got {top_k}")
    a = top_k + int(shared)
    ids = torch.empty((t, a), dtype=torch.int32, device=logits.device)
    weights = torch.empty((t, a), dtype=torch.float32, device=logits.device)
    if t:
        _moe_route_kernel[(t,)](logits, ids, weights, num_experts, logits.stride(0), TOP_K=top_k,
                                E_PAD=triton.next_power_of_2(num_experts), RENORM=renormalize, SHARED=shared)
    return ids, weights


@triton.jit
def _load_w_tile(w_ptr, s_ptr, rows, offs_kb, offs_ks, offs_k, mask_k, mask_kb, mask_ks,  #
                 stride_wn, stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NVFP4: tl.constexpr):
    """bf16 weight tile [BLOCK_N, BLOCK_K] of rows `rows`; NVFP4 tiles carry a 2^-22 factor."""
    if NVFP4:
        b = tl.load(w_ptr + rows[:, None] * stride_wn + offs_kb[None, :], mask=mask_kb, other=0)
        s = tl.load(s_ptr + rows[:, None] * stride_sn + offs_ks[None, :], mask=mask_ks, other=0)
        w = _decode_nvfp4_tile(b, s, BLOCK_N, BLOCK_K)
    else:
        w = tl.load(w_ptr + rows[:, None] * stride_wn + offs_k[None, :], mask=mask_k, other=0.0)
    return w


@triton.jit
def _dot(a, b, acc, INTERPRET: tl.constexpr):
    if INTERPRET:  # the Triton 3.9 interpreter multiplies bf16 dot operands as raw bits
        acc = tl.dot(a.to(tl.float32), tl.trans(b).to(tl.float32), acc)
    else:
        acc = tl.dot(a, tl.trans(b), acc)
    return acc


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, s_ptr, ts_ptr, out_ptr, route_w_ptr,  #
    sorted_ptr, block_expert_ptr, num_padded_ptr,  #
    NUMEL, N, K, A_DIV,  #
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om,  #
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  #
    GATE_UP: tl.constexpr, NVFP4: tl.constexpr, INTERPRET: tl.constexpr,  #
):
    """GATE_UP: out[entry, n] = silu(a[tok] . gate[n]) * (a[tok] . up[n]), tok = entry // A_DIV.
    Else (down): out[entry, n] = route_w[entry] * (a[entry] . w[n])."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    entry = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = entry < NUMEL
    a_rows = entry // A_DIV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w_base = w_ptr + e * stride_we
    s_base = s_ptr + e * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        offs_kb = k // 2 + tl.arange(0, BLOCK_K // 2)
        offs_ks = k // 16 + tl.arange(0, BLOCK_K // 16)
        mask_k = mask_n[:, None] & (offs_k[None, :] < K)
        mask_kb = mask_n[:, None] & (offs_kb[None, :] * 2 < K)
        mask_ks = mask_n[:, None] & (offs_ks[None, :] * 16 < K)
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :],
                    mask=valid[:, None] & (offs_k[None, :] < K), other=0.0)
        w = _load_w_tile(w_base, s_base, offs_n, offs_kb, offs_ks, offs_k, mask_k, mask_kb, mask_ks,
                         stride_wn, stride_sn, BLOCK_N, BLOCK_K, NVFP4)
        acc = _dot(a, w, acc, INTERPRET)
        if GATE_UP:
            w_up = _load_w_tile(w_base, s_base, offs_n + N, offs_kb, offs_ks, offs_k, mask_k, mask_kb,
                                mask_ks, stride_wn, stride_sn, BLOCK_N, BLOCK_K, NVFP4)
            acc_up = _dot(a, w_up, acc_up, INTERPRET)
    if GATE_UP:
        if NVFP4:
            acc = acc * (tl.load(ts_ptr + e * 2) * 4194304.0)
            acc_up = acc_up * (tl.load(ts_ptr + e * 2 + 1) * 4194304.0)
        acc = acc * tl.sigmoid(acc) * acc_up
    else:
        if NVFP4:
            acc = acc * (tl.load(ts_ptr + e) * 4194304.0)
        acc = acc * tl.load(route_w_ptr + entry, mask=valid, other=0.0)[:, None]
    out_ptrs = out_ptr + entry.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    if INTERPRET:  # the interpreter truncates fp32 -> bf16; round to nearest even first, as the GPU does
        bits = acc.to(tl.uint32, bitcast=True)
        acc = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


def _launch_moe_gemm(a, w: MoEWeights, gate_up: bool, out, route_w, sorted_ids, block_expert, num_padded,
                     numel: int, a_div: int, cfg: MoEConfig) -> None:
    wt, st = (w.w13, w.w13_scale) if gate_up else (w.w2, w.w2_scale)
    ts = w.w13_tensor_scale if gate_up else w.w2_tensor_scale
    n = w.intermediate if gate_up else w.hidden
    k = a.shape[1]
    block_n, block_k, warps, stages = cfg.gate_up if gate_up else cfg.down
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a, wt, st if st is not None else wt, ts if ts is not None else route_w, out, route_w,  #
        sorted_ids, block_expert, num_padded,  #
        numel, n, k, a_div,  #
        a.stride(0), wt.stride(0), wt.stride(1), st.stride(0) if st is not None else 0,  #
        st.stride(1) if st is not None else 0, out.stride(0),  #
        BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=block_k,  #
        GATE_UP=gate_up, NVFP4=w.nvfp4, INTERPRET=interpreting(),  #
        num_warps=warps, num_stages=stages,  #
    )


def moe_experts(
    h: torch.Tensor, ids: torch.Tensor, route_w: torch.Tensor, w: MoEWeights, config: MoEConfig | None = None
) -> torch.Tensor:
    """`h [T, D]` bf16 through the experts `ids [T, A']` weighted by `route_w [T, A']` -> `[T, D]` bf16.

    `config` overrides the table (used by the tuner)."""
    t, d = h.shape
    if h.dtype != torch.bfloat16 or d != w.hidden or h.stride(1) != 1:
        raise ValueError(f"h: expected bfloat16 [T, {w.hidden}] with unit column stride, got {h.dtype} "
                         f"{list(h.shape)}")
    if ids.shape != route_w.shape or ids.shape[0] != t:
        raise ValueError(f"ids {list(ids.shape)} and route_w {list(route_w.shape)} must both be [T={t}, A]")
    a_slots = ids.shape[1]
    numel = t * a_slots
    if numel == 0:
        return torch.zeros_like(h)
    experts = w.w13.shape[0]
    cfg = config or _moe_configs(numel, experts)
    sorted_ids, block_expert, num_padded = moe_align(ids, experts, cfg.block_m)
    inter = torch.empty((numel, w.intermediate), dtype=torch.bfloat16, device=h.device)  # [T*A', I]
    y = torch.empty((numel, d), dtype=torch.bfloat16, device=h.device)  # [T*A', D]
    rw = route_w.contiguous().view(-1).float()
    _launch_moe_gemm(h, w, True, inter, rw, sorted_ids, block_expert, num_padded, numel, a_slots, cfg)
    _launch_moe_gemm(inter, w, False, y, rw, sorted_ids, block_expert, num_padded, numel, 1, cfg)
    return y.view(t, a_slots, d).sum(dim=1, dtype=torch.float32).to(torch.bfloat16)


def fused_moe(h: torch.Tensor, w: MoEWeights, top_k: int, renormalize: bool) -> torch.Tensor:
    """The whole sparse MoE block (routed experts, plus the gated shared expert if stacked) on `h [T, D]`."""
    logits = h @ w.router.t()  # [T, E (+1)] bf16, as the HF router computes it
    ids, route_w = moe_route(logits, w.num_experts, top_k, renormalize, w.has_shared)
    return moe_experts(h, ids, route_w, w)


def _expert_weights_f32(w: MoEWeights, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not w.nvfp4:
        return w.w13[e].float(), w.w2[e].float()
    i = w.intermediate
    gate = NVFP4Weight(w.w13[e, :i], w.w13_scale[e, :i].view(torch.float8_e4m3fn), w.w13_tensor_scale[e, 0])
    up = NVFP4Weight(w.w13[e, i:], w.w13_scale[e, i:].view(torch.float8_e4m3fn), w.w13_tensor_scale[e, 1])
    down = NVFP4Weight(w.w2[e], w.w2_scale[e].view(torch.float8_e4m3fn), w.w2_tensor_scale[e])
    return torch.cat([gate.dequantize(), up.dequantize()]), down.dequantize()


def moe_route_ref(logits: torch.Tensor, num_experts: int, top_k: int, renormalize: bool, shared: bool):
    """fp32 reference of `moe_route` (HF: softmax fp32, topk, optional renormalisation)."""
    p = torch.softmax(logits[:, :num_experts].float(), dim=-1)
    top_w, top_i = torch.topk(p, top_k, dim=-1)
    if renormalize:
        top_w = top_w / top_w.sum(-1, keepdim=True)
    if shared:
        top_i = torch.cat([top_i, torch.full_like(top_i[:, :1], num_experts)], dim=1)
        top_w = torch.cat([top_w, torch.sigmoid(logits[:, num_experts:].float())], dim=1)
    return top_i.int(), top_w


def moe_experts_ref(h: torch.Tensor, ids: torch.Tensor, route_w: torch.Tensor, w: MoEWeights) -> torch.Tensor:
    """fp32 loop over experts: each reads its dequantized weights and the rows routed to it.

    Rounds to bf16 where the kernels store bf16 (SiLU*up activations, each slot's weighted output), as
    the HF model does, so the comparison isolates accumulation order.
    """
    out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    x = h.float()
    i = w.intermediate
    for e in ids.unique().tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        w13, w2 = _expert_weights_f32(w, e)
        gu = x[rows] @ w13.t()  # [R, 2I]
        act = (torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]).bfloat16().float()
        y = ((act @ w2.t()) * route_w[rows, slots].float()[:, None]).bfloat16().float()
        out.index_add_(0, rows, y)
    return out


def fused_moe_ref(h: torch.Tensor, w: MoEWeights, top_k: int, renormalize: bool) -> torch.Tensor:
    """fp32 reference of `fused_moe` (router logits from the same bf16 matmul)."""
    ids, route_w = moe_route_ref(h @ w.router.t(), w.num_experts, top_k, renormalize, w.has_shared)
    return moe_experts_ref(h, ids, route_w, w)
