"""The model forward of the GPU engine: both Qwen MoE families on our Triton kernels, over packed tokens.

Weights are laid out once at load time for the kernels:
- routed experts (and Qwen3.5's shared expert, stacked as one more expert) stay NVFP4 and run in the
  fused MoE kernel, which decodes FP4 in registers; bf16 experts run the same kernel unquantized
  (FP8 experts, which no supported checkpoint has, are dequantized to bf16). Prefill passes decode each
  layer's NVFP4 experts to bf16 for the grouped GEMMs, unless `bf16_experts` keeps those copies from
  load time (3.6x the experts' NVFP4 bytes: ~64 GB at Qwen3.6's shape, so fewer slots);
- every other linear (attention and DeltaNet projections, lm_head) is dequantized to bf16 once and
  runs on cuBLAS, with the projections that read the same input concatenated into one matrix
  (q|k|v, DeltaNet qkv|z|b|a). Measured on the H200 (docs/PERF.md), cuBLAS on the bf16 weight beats
  our NVFP4 and FP8 W-only kernels at these shapes from 8 rows up, and these weights are ~7% of the
  bytes of the model;
- except in single-stream decode (one row), where these linears are most of the bytes a step reads:
  the ones quantized in the checkpoint also keep their checkpoint bytes, stacked the same way, and one
  row runs a GEMV on them: FP8 projections (NVIDIA's mixed layout) as `FP8Rows` (DeltaNet's b|a, bf16
  there, as the stack's bf16 tail; q|k|v 7.5 us against cuBLAS's 11.8 us on the H200, session 10),
  NVFP4 ones (lm_head; every projection of an all-NVFP4 checkpoint) as group-major `NVFP4Rows`. An NVFP4
  lm_head also keeps its bytes in `moe_tc`'s paired layout, on which 2-64 rows (decode batches, a
  prefill's last tokens) run on the tensor cores (`nvfp4_rows_tc`: 135 us against cuBLAS's 349 at 32 rows
  on an H100, `conc32` +2.2%, session 37; the projections there were no faster than cuBLAS).
State lives in per-slot pools preallocated by the caller (`SlotState`): the KV cache
`[slots, Hkv, max_len, Dh]` per attention layer (bf16, or FP8 with a scale per token and head when asked,
`kv_cache`: half the bytes, at some accuracy; `kernels/kv_cache.py`), conv state `[slots, K - 1, C]`
and recurrent state `[slots, Hv, Dk, Dv]` per DeltaNet layer, fp32 as the checkpoints' `mamba_ssm_dtype`
says, or bf16 / fp16 when asked (`deltanet_state`): half the bytes a decode step moves through the delta
rule and half the slot memory, at some accuracy (the kernels compute in fp32 and round the state when
they store it; fp16 keeps 3 more mantissa bits than bf16 and saturates at +-65504).
The residual stream is kept in fp32 (`RESIDUAL`), where HF rounds it to bf16 at every layer: that
rounding is most of a bf16 forward's drift from fp32, and costs 2 bytes a hidden value more.
Two forwards: `prefill` runs whole prompts packed (`cu_seqlens`), each from an empty slot; `decode` runs
one token per row and is CUDA-graph safe (no host sync, shapes fixed by the row count). A decode step is
latency-bound (a few MB of work per launch at one row), so its small steps ride in their neighbours'
launches: the KV-cache write in the q/k norm + RoPE kernel, the next layer's input add + RMSNorm in the
MoE decode path's down kernel, and at one row the post-mixer add + RMSNorm with the router and the routing
(`norm_route`), DeltaNet's conv update in in_proj's GEMV and its gated RMSNorm in out_proj's.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from batchinfer.kernels.attention import decode_attention, prefill_attention, prefill_attention_cached
from batchinfer.kernels.causal_conv1d import causal_conv1d, causal_conv1d_update
from batchinfer.kernels.fp8_gemm import FP8Rows, fp8_gemv, stack_fp8
from batchinfer.kernels.gdn import gated_delta_rule, gated_rmsnorm
from batchinfer.kernels.gdn_chunk import chunk_gated_delta_rule
from batchinfer.kernels.kv_cache import store_kv
from batchinfer.kernels.moe import fused_moe, moe_experts_add_rmsnorm, moe_route, router_logits
from batchinfer.kernels.moe_grouped_mm import dequantize_experts
from batchinfer.kernels.moe_tc import pair_moe_weights
from batchinfer.kernels.moe_weights import MoEWeights, stack_moe_weights
from batchinfer.kernels.norm_route import norm_route
from batchinfer.kernels.nvfp4 import FP8Weight, NVFP4Weight
from batchinfer.kernels.nvfp4_gemm import NVFP4Rows, nvfp4_gemv, stack_nvfp4
from batchinfer.kernels.nvfp4_rows_tc import ROWS_TC_MAX_M, nvfp4_rows_tc, pair_nvfp4_rows
from batchinfer.kernels.qk_norm_rope import qk_norm_rope, rope_inv_freq
from batchinfer.kernels.small_ops import add_rmsnorm, embedding
from batchinfer.models.config import ModelConfig

if TYPE_CHECKING:
    from batchinfer.models.layers import Linear

RESIDUAL = torch.float32  # dtype of the residual stream
# `deltanet_state` choices: the recurrent state pools' dtype
STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_MLP = ("gate_proj", "up_proj", "down_proj")
# Prompts at most this long run the token-recurrent DeltaNet prefill; longer ones the chunked kernel.
RECURRENT_PREFILL_MAX = 64


def dense_bf16(w: Linear) -> torch.Tensor:
    """Any linear weight as bf16 `[N, K]`, dequantized exactly as the reference does at each use."""
    if isinstance(w, (NVFP4Weight, FP8Weight)):
        return w.dequantize(torch.bfloat16)
    return w.to(torch.bfloat16)


def _expert(w: Linear) -> Linear:
    return w if isinstance(w, NVFP4Weight) else dense_bf16(w)


OneRow = FP8Rows | NVFP4Rows | None


def _one_row(ws: Sequence[Linear], tail: Sequence[Linear] = ()) -> OneRow:
    """The weights stacked in their checkpoint format for one-row decode: FP8 ones with the `tail` weights'
    rows in bf16 after them; NVFP4 ones when the tail is NVFP4 too; otherwise none (cuBLAS on bf16)."""
    if all(isinstance(w, FP8Weight) for w in ws):
        return stack_fp8(ws, [dense_bf16(t) for t in tail])  # type: ignore[arg-type]
    if all(isinstance(w, NVFP4Weight) for w in [*ws, *tail]):
        return stack_nvfp4([*ws, *tail])  # type: ignore[list-item]
    return None


def _linear(h: torch.Tensor, dense: torch.Tensor, one_row: OneRow) -> torch.Tensor:
    """`h @ dense^T`; one row on the checkpoint's FP8 or NVFP4 bytes when it has them."""
    if h.shape[0] == 1 and isinstance(one_row, FP8Rows):
        return fp8_gemv(h, one_row)
    if h.shape[0] == 1 and isinstance(one_row, NVFP4Rows):
        return nvfp4_gemv(h, one_row)
    return h @ dense.t()


@dataclass(slots=True)
class AttentionWeights:
    qkv: torch.Tensor  # bf16 [H * Dh (* 2 with the output gate) + 2 * Hkv * Dh, D]
    o_proj: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    qkv_rows: OneRow = None  # the same rows in the checkpoint's FP8 or NVFP4 bytes (one-row decode)
    o_proj_rows: OneRow = None


@dataclass(slots=True)
class DeltaNetWeights:
    in_proj: torch.Tensor  # bf16 [conv_dim + Hv * Dv + 2 * Hv, D]: qkv | z | b | a
    conv: torch.Tensor  # [conv_dim, K]
    A_log: torch.Tensor  # fp32 [Hv]
    dt_bias: torch.Tensor  # fp32 [Hv]
    norm: torch.Tensor  # [Dv]
    out_proj: torch.Tensor
    in_proj_rows: OneRow = None  # qkv | z as FP8, b | a (bf16 in NVIDIA's checkpoints) as its tail; or NVFP4
    out_proj_rows: OneRow = None


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    mixer: AttentionWeights | DeltaNetWeights
    moe: MoEWeights


def pack_prompts(
    prompts: Sequence[Sequence[int]], slots: Sequence[int], starts: Sequence[int]
) -> tuple[torch.Tensor, ...]:
    """`KernelModel.prefill`'s packed inputs on the host: token ids (int64), positions from each start
    (int32), each token's slot (int64), cu_seqlens and slots (int32), and the starts as `past` (int32).

    Built in numpy: a graphed prefill's time to first token includes this, and a dozen small torch
    CPU ops took 0.7-3.7 ms of it on an H100 host (session 26), numpy 0.1-0.3 ms."""
    if not len(prompts) == len(slots) == len(starts):
        raise ValueError(f"{len(prompts)} prompts but {len(slots)} slots and {len(starts)} starts")
    lens = np.array([len(p) for p in prompts], dtype=np.int64)
    ids = np.fromiter(itertools.chain.from_iterable(prompts), dtype=np.int64, count=int(lens.sum()))
    cu = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    first = np.asarray(starts, dtype=np.int64) - cu[:-1]  # position minus packed index, per prompt
    positions = np.arange(cu[-1], dtype=np.int64) + np.repeat(first, lens)
    token_slots = np.repeat(np.asarray(slots, dtype=np.int64), lens)
    packed = (ids, positions.astype(np.int32), token_slots, cu.astype(np.int32))
    slot_ids, past = (np.asarray(xs, dtype=np.int32) for xs in (slots, starts))
    return tuple(torch.from_numpy(x) for x in (*packed, slot_ids, past))


@dataclass(slots=True)
class SlotState:
    """Per-slot state pools of every layer (index = layer; the other kind's entry is None)."""

    k: list[torch.Tensor | None]  # [slots, Hkv, max_len, Dh] bf16 (or float8_e4m3fn, `kv_cache`)
    v: list[torch.Tensor | None]
    conv: list[torch.Tensor | None]  # [slots, K - 1, conv_dim] bf16
    recurrent: list[torch.Tensor | None]  # [slots, Hv, Dk, Dv] fp32 (or bf16 / fp16, `deltanet_state`)
    k_scale: list[torch.Tensor | None]  # [slots, Hkv, max_len] fp32 with an FP8 cache, else None
    v_scale: list[torch.Tensor | None]

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """An attention layer's (K cache, V cache, K scales, V scales); the scales None for a bf16 cache."""
        k, v = self.k[layer], self.v[layer]
        if k is None or v is None:
            raise ValueError(f"layer {layer} is not an attention layer: it has no KV cache")
        return k, v, self.k_scale[layer], self.v_scale[layer]

    @property
    def max_len(self) -> int:
        return next(t.shape[2] for t in self.k if t is not None) if any(t is not None for t in self.k) else 0

    def _index(self, slots: Sequence[int]) -> torch.Tensor:
        dev = next(t.device for t in self.k + self.conv if t is not None)
        return torch.tensor(list(slots), dtype=torch.int64, device=dev)

    def copy_rows(self, slots: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Copies of the DeltaNet conv and recurrent state of `slots`: a prefill pass that fails part-way
        has advanced them in some layers, and a later piece of a chunked prefill starts from them."""
        idx = self._index(slots)
        pools = zip(self.conv, self.recurrent, strict=True)
        return [None if c is None else (c[idx], r[idx]) for c, r in pools]  # type: ignore[index]

    def restore_rows(
        self, slots: Sequence[int], rows: list[tuple[torch.Tensor, torch.Tensor] | None]
    ) -> None:
        """Put back what `copy_rows` took (KV entries need nothing: a retry rewrites the same positions)."""
        idx = self._index(slots)
        for c, r, saved in zip(self.conv, self.recurrent, rows, strict=True):
            if saved is not None:
                c[idx], r[idx] = saved  # type: ignore[index]


class KernelModel:
    """Weights in kernel layouts plus the prefill and decode forwards (see the module docstring)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, Linear],
        deltanet_state: torch.dtype = torch.float32,
        kv_cache: torch.dtype = torch.bfloat16,
        bf16_experts: bool = False,
    ) -> None:
        if deltanet_state not in STATE_DTYPES.values():
            choices = ", ".join(STATE_DTYPES)
            raise ValueError(f"deltanet_state: expected one of {choices}, got {deltanet_state}")
        if kv_cache not in (torch.bfloat16, torch.float8_e4m3fn):
            raise ValueError(f"kv_cache: expected bfloat16 or float8_e4m3fn, got {kv_cache}")
        if not isinstance(bf16_experts, bool):
            raise ValueError(f"bf16_experts: expected a bool, got {bf16_experts!r}")
        self.deltanet_state = deltanet_state
        self.kv_cache = kv_cache
        self.bf16_experts = bf16_experts
        c = self.config = config
        self.device = weights["embed_tokens"].device
        self.dtype = torch.bfloat16
        self.embed = dense_bf16(weights["embed_tokens"]).contiguous()
        lm_head = weights.get("lm_head", weights["embed_tokens"] if c.tie_word_embeddings else None)
        if lm_head is None:
            raise ValueError(
                "weights: missing tensor 'lm_head' (and the config does not tie it to embed_tokens)"
            )
        self.lm_head = dense_bf16(lm_head).contiguous()
        self.lm_head_rows = _one_row([lm_head])
        paired = isinstance(lm_head, NVFP4Weight) and lm_head.shape[1] % 32 == 0
        self.lm_head_paired = pair_nvfp4_rows([lm_head]) if paired else None
        self.norm = weights["norm"].to(torch.bfloat16)
        self.inv_freq = rope_inv_freq(c.rotary_dim, c.rope_theta, self.device)
        self.layers = [self._layer(weights, i, kind) for i, kind in enumerate(c.layer_types)]

    def _layer(self, w: Mapping[str, Linear], i: int, kind: str) -> LayerWeights:
        c, p = self.config, f"layers.{i}."
        mixer: AttentionWeights | DeltaNetWeights
        if kind == "full_attention":
            a = p + "self_attn."
            qkv = [w[a + n] for n in ("q_proj", "k_proj", "v_proj")]
            mixer = AttentionWeights(
                qkv=torch.cat([dense_bf16(x) for x in qkv]).contiguous(),
                o_proj=dense_bf16(w[a + "o_proj"]).contiguous(),
                q_norm=w[a + "q_norm"].to(torch.bfloat16),
                k_norm=w[a + "k_norm"].to(torch.bfloat16),
                qkv_rows=_one_row(qkv),
                o_proj_rows=_one_row([w[a + "o_proj"]]),
            )
        else:
            a = p + "linear_attn."
            parts = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
            mixer = DeltaNetWeights(
                in_proj=torch.cat([dense_bf16(w[a + n]) for n in parts]).contiguous(),
                conv=w[a + "conv1d"].to(torch.bfloat16).reshape(-1, c.linear_conv_kernel_dim).contiguous(),
                A_log=w[a + "A_log"].float().contiguous(),
                dt_bias=w[a + "dt_bias"].float().contiguous(),
                norm=w[a + "norm"].to(torch.bfloat16),
                out_proj=dense_bf16(w[a + "out_proj"]).contiguous(),
                in_proj_rows=_one_row([w[a + n] for n in parts[:2]], [w[a + n] for n in parts[2:]]),
                out_proj_rows=_one_row([w[a + "out_proj"]]),
            )
        m = p + "mlp."
        experts = [tuple(_expert(w[f"{m}experts.{e}.{n}"]) for n in _MLP) for e in range(c.num_experts)]
        shared = (
            tuple(_expert(w[f"{m}shared_expert.{n}"]) for n in _MLP)
            if c.shared_expert_intermediate_size
            else None
        )
        moe = stack_moe_weights(
            dense_bf16(w[m + "gate"]),
            experts,
            shared,  # type: ignore[arg-type]
            dense_bf16(w[m + "shared_expert_gate"]) if shared is not None else None,
        )
        if moe.nvfp4 and moe.hidden % 32 == 0 and moe.intermediate % 32 == 0:
            # the tensor-core MoE kernels read this layout (the decode path and grouped_mm too); other
            # widths keep the standard layout and the fused grouped GEMMs
            moe = pair_moe_weights(moe)
        if self.bf16_experts and moe.nvfp4:
            moe.decoded = dequantize_experts(moe)
        return LayerWeights(
            w[p + "input_layernorm"].to(torch.bfloat16),
            w[p + "post_attention_layernorm"].to(torch.bfloat16),
            mixer,
            moe,
        )

    # ---- state ----

    def slot_bytes(self, max_len: int) -> int:
        """Bytes of state one slot holds with room for `max_len` tokens."""
        c = self.config
        total = 0
        fp8 = self.kv_cache == torch.float8_e4m3fn
        for kind in c.layer_types:
            if kind == "full_attention":  # K and V, with a fp32 scale per token and head if FP8
                total += 2 * c.num_key_value_heads * max_len * (c.head_dim * self.kv_cache.itemsize + 4 * fp8)
            else:
                total += (c.linear_conv_kernel_dim - 1) * self._conv_dim * 2
                state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
                total += state * self.deltanet_state.itemsize
        return total

    @property
    def _conv_dim(self) -> int:
        c = self.config
        return (
            2 * c.linear_num_key_heads * c.linear_key_head_dim
            + c.linear_num_value_heads * c.linear_value_head_dim
        )

    def new_state(self, slots: int, max_len: int) -> SlotState:
        """Zeroed pools for `slots` sequences of up to `max_len` tokens each."""
        c, dev = self.config, self.device
        state = SlotState([], [], [], [], [], [])
        fp8 = self.kv_cache == torch.float8_e4m3fn
        for kind in c.layer_types:
            attn = kind == "full_attention"
            kv = (slots, c.num_key_value_heads, max_len, c.head_dim)
            state.k.append(torch.zeros(kv, dtype=self.kv_cache, device=dev) if attn else None)
            state.v.append(torch.zeros(kv, dtype=self.kv_cache, device=dev) if attn else None)
            scales = attn and fp8
            state.k_scale.append(torch.ones(kv[:3], dtype=torch.float32, device=dev) if scales else None)
            state.v_scale.append(torch.ones(kv[:3], dtype=torch.float32, device=dev) if scales else None)
            conv = (slots, c.linear_conv_kernel_dim - 1, self._conv_dim)
            state.conv.append(None if attn else torch.zeros(conv, dtype=torch.bfloat16, device=dev))
            rec = (slots, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
            state.recurrent.append(None if attn else torch.zeros(rec, dtype=self.deltanet_state, device=dev))
        return state

    # ---- forwards ----

    def prefill(
        self,
        state: SlotState,
        ids: torch.Tensor,
        positions: torch.Tensor,
        token_slots: torch.Tensor,
        cu_seqlens: torch.Tensor,
        slots: torch.Tensor,
        max_seqlen: int,
        all_logits: bool = False,
        past: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Prompts packed: `ids`, `positions` (int32), `token_slots` (int64) `[T]`; `cu_seqlens` int32
        `[N + 1]`, `slots` int32 `[N]`. Fills the slots' state; returns bf16 logits `[N, V]` of each
        prompt's last token, or with `all_logits` those of every token `[T, V]` (teacher forcing). With
        `past` (int32 `[N]`, chunked prefill) sequence n is a piece of a prompt whose first `past[n]`
        tokens are in its slot already (0: a fresh start)."""
        c = self.config
        x, residual = embedding(ids, self.embed), None
        for i, layer in enumerate(self.layers):
            h, residual = add_rmsnorm(
                x, residual, layer.input_norm, c.rms_norm_eps, c.one_plus_norm, RESIDUAL
            )
            if isinstance(layer.mixer, AttentionWeights):
                q, k, v, gate = self._qkv(h, layer.mixer, positions)
                kc, vc, ks, vs = state.kv(i)
                store_kv(k, v, kc, vc, ks, vs, token_slots, positions)
                if past is None:  # a fresh prompt attends to its own bf16 K/V, whatever the cache keeps
                    o = prefill_attention(q, k, v, cu_seqlens, max_seqlen, gate=gate)
                else:
                    o = prefill_attention_cached(
                        q, kc, vc, cu_seqlens, slots, past, max_seqlen, gate=gate, k_scale=ks, v_scale=vs
                    )
                h = o.reshape(len(ids), -1) @ layer.mixer.o_proj.t()
            else:
                h = self._deltanet(h, layer.mixer, state, i, slots, cu_seqlens, max_seqlen, past)
            h, residual = add_rmsnorm(h, residual, layer.post_norm, c.rms_norm_eps, c.one_plus_norm)
            x = fused_moe(h, layer.moe, c.num_experts_per_tok, c.norm_topk_prob)
        if all_logits:
            return self._logits(add_rmsnorm(x, residual, self.norm, c.rms_norm_eps, c.one_plus_norm)[0])
        last = cu_seqlens[1:].long() - 1  # each prompt's last token
        h, _ = add_rmsnorm(
            x[last].contiguous(), residual[last].contiguous(), self.norm, c.rms_norm_eps, c.one_plus_norm
        )
        return self._logits(h)

    def prefill_prompts(
        self,
        state: SlotState,
        prompts: Sequence[Sequence[int]],
        slots: Sequence[int],
        all_logits: bool = False,
        starts: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """`prefill` of prompts (token-id lists) into `slots`; packs them on the host. `starts` (chunked
        prefill): where each list begins in its sequence, whose earlier tokens are in the slot already."""
        starts = starts or [0] * len(prompts)
        *packed, past = pack_prompts(prompts, slots, starts)
        inputs = [x.to(self.device) for x in packed]
        past = past.to(self.device) if any(starts) else None
        return self.prefill(state, *inputs, max(len(p) for p in prompts), all_logits, past)

    def decode(
        self, state: SlotState, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """One token per row: `ids [B]` at `positions [B]` (int32) of the sequences in `slots [B]` (int32).
        Appends to the slots' state; returns bf16 logits `[B, V]`. No host sync (CUDA-graph safe). A row
        with slot and position -1 pads a batch: it reads and writes no state and attends to nothing."""
        c = self.config
        eps, one_plus = c.rms_norm_eps, c.one_plus_norm
        seq_lens = positions + 1
        x = embedding(ids, self.embed)
        h, residual = add_rmsnorm(x, None, self.layers[0].input_norm, eps, one_plus, RESIDUAL)
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mixer, AttentionWeights):
                kc, vc, ks, vs = state.kv(i)
                q, _, _, gate = self._qkv(h, layer.mixer, positions, (kc, vc, ks, vs, slots))
                o = decode_attention(q, kc, vc, slots, seq_lens, gate=gate, k_scale=ks, v_scale=vs)
                h = _linear(o.reshape(len(ids), -1), layer.mixer.o_proj, layer.mixer.o_proj_rows)
            else:
                h = self._deltanet(h, layer.mixer, state, i, slots, None, 1)
            moe, top_k, renorm = layer.moe, c.num_experts_per_tok, c.norm_topk_prob
            if len(ids) == 1:  # the add + norm, the router GEMV and the routing in one launch
                h, residual, experts, weights = norm_route(
                    h, residual, layer.post_norm, eps, one_plus, moe, top_k, renorm
                )
            else:
                h, residual = add_rmsnorm(h, residual, layer.post_norm, eps, one_plus)
                experts, weights = moe_route(
                    router_logits(h, moe), moe.num_experts, top_k, renorm, moe.has_shared
                )
            # the experts, then the next layer's input norm (the final norm after the last layer), fused on
            # the MoE decode path
            norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            h, residual = moe_experts_add_rmsnorm(h, experts, weights, moe, residual, norm, eps, one_plus)
        return self._logits(h)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """lm_head: one row on its checkpoint bytes' GEMV, 2-ROWS_TC_MAX_M rows of an NVFP4 lm_head on the
        tensor cores, more (or a bf16 lm_head) on cuBLAS."""
        if 1 < h.shape[0] <= ROWS_TC_MAX_M and self.lm_head_paired is not None:
            return nvfp4_rows_tc(h, self.lm_head_paired)
        return _linear(h, self.lm_head, self.lm_head_rows)

    def _qkv(self, h: torch.Tensor, w: AttentionWeights, positions: torch.Tensor, cache: tuple | None = None):
        """q, k (normed, rotated), v `[T, heads, Dh]` and the output gate (or None) of one attention layer;
        with `cache = (k_cache, v_cache, k_scale, v_scale, slots)` k and v also go into the cache (decode)."""
        c = self.config
        T, H, Hkv, Dh = h.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qkv = _linear(h, w.qkv, w.qkv_rows)
        q_width = H * Dh * (2 if c.attn_output_gate else 1)
        q = qkv[:, :q_width].view(T, H, -1)  # Qwen3.5 interleaves per head: [h0 q | h0 gate | h1 q ...]
        gate = q[..., Dh:] if c.attn_output_gate else None
        k = qkv[:, q_width : q_width + Hkv * Dh].view(T, Hkv, Dh)
        v = qkv[:, q_width + Hkv * Dh :].view(T, Hkv, Dh)
        store = None if cache is None else (v, *cache)
        eps, one_plus, inv_freq = c.rms_norm_eps, c.one_plus_norm, self.inv_freq
        q, k = qk_norm_rope(q[..., :Dh], k, w.q_norm, w.k_norm, positions, inv_freq, eps, one_plus, store)
        return q, k, v, gate

    def _deltanet(
        self,
        h: torch.Tensor,
        w: DeltaNetWeights,
        state: SlotState,
        i: int,
        slots: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        max_seqlen: int,
        past: torch.Tensor | None = None,
    ) -> torch.Tensor:
        c = self.config
        T = h.shape[0]
        Hk, Hv = c.linear_num_key_heads, c.linear_num_value_heads
        Dk, Dv = c.linear_key_head_dim, c.linear_value_head_dim
        C = self._conv_dim
        conv_state, rec = state.conv[i], state.recurrent[i]
        if T == 1 and cu_seqlens is None and isinstance(w.in_proj_rows, FP8Rows):  # conv in in_proj's GEMV
            proj, mixed = fp8_gemv(h, w.in_proj_rows, conv=(w.conv, conv_state, slots))  # type: ignore[arg-type]
        else:
            proj = _linear(h, w.in_proj, w.in_proj_rows)  # [T, C + Hv * Dv + 2 * Hv]
            if cu_seqlens is None:
                mixed = causal_conv1d_update(proj[:, :C], w.conv, conv_state, slots)  # type: ignore[arg-type]
            else:
                mixed = causal_conv1d(proj[:, :C], w.conv, cu_seqlens, max_seqlen, conv_state, slots, past)  # type: ignore[arg-type]
        q = mixed[:, : Hk * Dk].view(T, Hk, Dk)
        k = mixed[:, Hk * Dk : 2 * Hk * Dk].view(T, Hk, Dk)
        v = mixed[:, 2 * Hk * Dk :].view(T, Hv, Dv)
        z = proj[:, C : C + Hv * Dv].view(T, Hv, Dv)
        b = proj[:, C + Hv * Dv : C + Hv * Dv + Hv]
        a = proj[:, C + Hv * Dv + Hv :]
        if cu_seqlens is None or max_seqlen <= RECURRENT_PREFILL_MAX:
            o = gated_delta_rule(q, k, v, a, b, w.A_log, w.dt_bias, rec, slots, cu_seqlens, past=past)  # type: ignore[arg-type]
        else:
            o = chunk_gated_delta_rule(
                q,
                k,
                v,
                a,
                b,
                w.A_log,
                w.dt_bias,
                rec,
                slots,
                cu_seqlens,  # type: ignore[arg-type]
                max_seqlen,
                past=past,
            )
        if T == 1 and isinstance(w.out_proj_rows, FP8Rows):  # the norm inside out_proj's GEMV: one launch
            gated_norm = (z.view(1, Hv * Dv), w.norm, c.rms_norm_eps)
            return fp8_gemv(o.view(1, Hv * Dv), w.out_proj_rows, gated_norm=gated_norm)
        o = gated_rmsnorm(o, z, w.norm, c.rms_norm_eps)
        return _linear(o.reshape(T, Hv * Dv), w.out_proj, w.out_proj_rows)
