"""Offline tuner for the attention and DeltaNet config tables, plus the bf16-state accuracy measurement.

Run on the H200 (`python -m batchinfer.bench.tune_attn --out tune_attn.json`); winners go by hand into
`_prefill_configs` / `_decode_configs` (kernels/attention.py), `_delta_rule_configs` (kernels/gdn.py) and
`_chunk_configs` (kernels/gdn_chunk.py; `--parts gdn_chunk` times it alone), `_conv_configs`
(kernels/causal_conv1d.py, `--parts conv`).
Every candidate is checked against a reference before it is timed, so a tile that miscompiles is
reported, not picked.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from batchinfer.bench.kernels import time_per_call
from batchinfer.kernels.attention import (
    _decode_configs,
    _prefill_configs,
    decode_attention,
    decode_attention_ref,
    prefill_attention,
)
from batchinfer.kernels.causal_conv1d import _conv_configs, causal_conv1d
from batchinfer.kernels.gdn import _delta_rule_configs, gated_delta_rule
from batchinfer.kernels.gdn_chunk import _chunk_configs, chunk_gated_delta_rule

log = logging.getLogger(__name__)
BF16 = torch.bfloat16

PREFILL = [
    (64, 32, 4, 2),
    (64, 64, 4, 2),
    (64, 64, 8, 2),
    (64, 64, 4, 3),
    (128, 64, 8, 2),
    (128, 32, 8, 2),
    (128, 64, 8, 3),
    (128, 128, 8, 2),
    (64, 32, 4, 3),
]
DECODE = [(16, 4, 3), (32, 4, 2), (32, 4, 3), (32, 8, 3), (64, 4, 2), (64, 4, 3), (64, 8, 3), (32, 4, 4)]
GDN_DECODE = [(bv, w) for bv in (16, 32, 64) for w in (2, 4, 8)]
GDN_PREFILL = [(bv, w) for bv in (8, 16, 32) for w in (1, 2, 4)]
# The chunked rule: changes to `_chunk_configs`' choice for the pass (BT, BLOCK_V, warps and pipeline
# stages of the sequential launch, warps of the other four). BLOCK_V sets the sequential launch's programs
# (sequences x 32 v-heads x 128 / BLOCK_V; sm_90 compile: one CTA an SM at 3 stages, two at 2), so it is
# timed at the engine's pass shapes: one 512-token prompt (`single`'s TTFT), 16 x 1,024 and 8 x 2,048
# (16,384-token passes, the default before session 21) and 32 x 2,048 (65,536 tokens, the default since:
# `offline`, `extract`). The warps of the scores, inverse and W/U launches trade
# registers (CTAs an SM) against instructions (session 17's compile report).
GDN_CHUNK = [
    {"BLOCK_V": 16, "num_warps": 4},
    {"BLOCK_V": 32, "num_warps": 8},
    {"BLOCK_V": 32, "num_warps": 4},
    {"BLOCK_V": 64, "num_warps": 4},
    {"BLOCK_V": 64, "num_warps": 4, "state_stages": 2},
    {"BLOCK_V": 32, "num_warps": 4, "state_stages": 2},
    {"BLOCK_V": 64, "num_warps": 8, "state_stages": 2},
    {"scores_warps": 8},
    {"state_stages": 3},
    {"inv_warps": 2},
    {"wu_warps": 8},
    {"out_warps": 4},
    {"BT": 32, "BLOCK_V": 32, "num_warps": 4},
]
GDN_CHUNK_PASSES = [(1, 512), (16, 1024), (8, 2048), (32, 2048)]  # sequences x tokens
# The prefill conv1d: BLOCK_T, BLOCK_C, warps (sm_90 compile: 210 registers at the table's 32, 256 on 4
# warps, 128 on 8; in an 8 x 2,048-token pass it moved its bytes at ~41% of copy bandwidth, session 13).
CONV = [(32, 256, 8), (16, 256, 4), (16, 256, 8), (64, 256, 8), (32, 128, 4), (64, 128, 8), (16, 512, 8)]


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def _sweep(
    name: str,
    configs: list[dict[str, int]],
    run: Callable[[dict[str, int], int], torch.Tensor],
    check: Callable[[dict[str, int]], torch.Tensor],
    ref: torch.Tensor,
    sets: int,
    extra: dict[str, Any],
) -> list[dict[str, Any]]:
    """Check each config's output (`check(cfg)` vs ref), then time `run(cfg, i)` over `sets` input sets."""
    rows = []
    for cfg in configs:
        try:
            err = _rel(check(cfg), ref)
            ok = err < 2e-2
            sec = time_per_call(lambda i, c=cfg: run(c, i), sets, budget_s=0.05) if ok else math.nan
        except Exception as e:  # a tile that does not fit (shared memory, registers) is reported and skipped
            rows.append({"case": name, "config": cfg, "error": str(e).splitlines()[0][:160], **extra})
            continue
        rows.append({"case": name, "config": cfg, "rel_err": err, "us": sec * 1e6, **extra})
        log.info("%s %s: err %.1e, %.1f us", name, cfg, err, sec * 1e6)
    return rows


def _prefill_point(dev: torch.device, H: int, Hkv: int, Dh: int, gated: bool, T: int = 4096) -> list[dict]:
    q, k, v = (torch.randn(T, h, Dh, device=dev, dtype=BF16) for h in (H, Hkv, Hkv))
    gate = torch.randn(T, H, Dh, device=dev, dtype=BF16) if gated else None
    cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
    rep = H // Hkv
    ref = F.scaled_dot_product_attention(
        q.float().transpose(0, 1),
        k.float().repeat_interleave(rep, 1).transpose(0, 1),
        v.float().repeat_interleave(rep, 1).transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)
    if gated:
        ref = ref * torch.sigmoid(gate.float())
    configs = [_prefill_configs(Dh)] + [
        dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s) for bm, bn, w, s in PREFILL
    ]
    run = lambda c, i: prefill_attention(q, k, v, cu, T, gate=gate, config=dict(c))
    rows = _sweep(f"prefill Dh={Dh}", configs, run, lambda c: run(c, 0), ref, 1, {"tokens": T})
    for row in rows:
        row["tflop_s"] = 2 * H * T * T * Dh / row.get("us", math.nan) / 1e6
    return rows


def sweep_prefill(dev: torch.device) -> list[dict[str, Any]]:
    return _prefill_point(dev, 16, 2, 256, True) + _prefill_point(dev, 32, 4, 128, False)


def _decode_point(dev: torch.device, H: int, Hkv: int, Dh: int, B: int, L: int) -> list[dict]:
    caches = [tuple(torch.randn(B, Hkv, L, Dh, device=dev, dtype=BF16) for _ in range(2)) for _ in range(2)]
    q = torch.randn(B, H, Dh, device=dev, dtype=BF16)
    slots = torch.arange(B, device=dev)
    lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    ref = decode_attention_ref(q, *caches[0], slots, lens)
    configs = [_decode_configs(Dh)] + [
        dict(BLOCK_N=bn, num_warps=w, num_stages=s, MIN_SPLIT=256) for bn, w, s in DECODE
    ]
    configs += [dict(_decode_configs(Dh), MIN_SPLIT=ms) for ms in (128, 256, 512)]
    run = lambda c, i: decode_attention(q, *caches[i], slots, lens, max_seqlen=L, config=dict(c))
    rows = _sweep(f"decode Dh={Dh} B={B}", configs, run, lambda c: run(c, 0), ref, 2, {"batch": B, "ctx": L})
    for row in rows:
        row["tb_s"] = 2 * B * Hkv * L * Dh * 2 / row.get("us", math.nan) / 1e6
    return rows


def sweep_decode(dev: torch.device) -> list[dict[str, Any]]:
    return [
        row
        for H, Hkv, Dh in ((16, 2, 256), (32, 4, 128))
        for B in (32, 128)
        for row in _decode_point(dev, H, Hkv, Dh, B, 4096)
    ]


def _gdn_inputs(T: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """Qwen3.5 shapes with Mamba-style gate parameters (decays between 0.9 and 0.9999 per token)."""
    Hk, Hv, D = 16, 32, 128
    mixed = torch.randn(T, 2 * Hk * D + Hv * D, device=dev, dtype=BF16)
    q = mixed[:, : Hk * D].view(T, Hk, D)
    k = mixed[:, Hk * D : 2 * Hk * D].view(T, Hk, D)
    v = mixed[:, 2 * Hk * D :].view(T, Hv, D)
    a = (torch.randn(T, Hv, device=dev) * 0.5).to(BF16)
    b = torch.randn(T, Hv, device=dev, dtype=BF16)
    A_log = torch.empty(Hv, device=dev).uniform_(1, 16).log()
    dt = torch.exp(torch.empty(Hv, device=dev).uniform_(math.log(1e-3), math.log(1e-1)))
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    return q, k, v, a, b, A_log, dt_bias


def _gdn_decode_point(dev: torch.device, B: int) -> list[dict]:
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(B, dev)
    base = torch.randn(B, 32, 128, 128, device=dev) * 0.1
    states = [base.clone() for _ in range(max(2, math.ceil(240e6 / base.nbytes)))]
    slots = torch.arange(B, device=dev)
    step = lambda c, s: gated_delta_rule(q, k, v, a, b, A_log, dt_bias, s, slots, config=c)

    def checked(c: dict[str, int]) -> torch.Tensor:  # the outputs and the state written back
        s = base.clone()
        return torch.cat([step(c, s).float().flatten(), s.flatten()])

    ref = checked(_delta_rule_configs(True, 4, B))
    configs = [_delta_rule_configs(True, 4, B)] + [dict(BLOCK_V=bv, num_warps=w) for bv, w in GDN_DECODE]
    rows = _sweep(
        f"gdn decode B={B}",
        configs,
        lambda c, i: step(c, states[i]),
        checked,
        ref,
        len(states),
        {"batch": B},
    )
    for row in rows:
        row["tb_s"] = 2 * base.nbytes / row.get("us", math.nan) / 1e6
    return rows


def sweep_gdn(dev: torch.device) -> list[dict[str, Any]]:
    rows = [row for B in (32, 128, 512) for row in _gdn_decode_point(dev, B)]
    T, seqs = 4096, 4
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(T, dev)
    cu = torch.arange(0, T + 1, T // seqs, dtype=torch.int32, device=dev)
    state = torch.empty(seqs, 32, 128, 128, device=dev)
    slots = torch.arange(seqs, device=dev)
    run = lambda c, i: gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, slots, cu_seqlens=cu, config=c)
    ref = run(_delta_rule_configs(False), 0)
    configs = [_delta_rule_configs(False)] + [dict(BLOCK_V=bv, num_warps=w) for bv, w in GDN_PREFILL]
    return rows + _sweep(
        f"gdn prefill T={T} seqs={seqs}", configs, run, lambda c: run(c, 0), ref, 1, {"tokens": T}
    )


def _gdn_chunk_point(dev: torch.device, seqs: int, length: int) -> list[dict[str, Any]]:
    """The chunked rule's launch configs on `seqs` sequences of `length` tokens from a zero state, checked
    against the token-loop kernel."""
    T = seqs * length
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(T, dev)
    cu = torch.arange(0, T + 1, length, dtype=torch.int32, device=dev)
    state = torch.empty(seqs, 32, 128, 128, device=dev)
    slots = torch.arange(seqs, device=dev)
    ref = gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, slots, cu_seqlens=cu)
    chunk = lambda c, i: chunk_gated_delta_rule(
        q, k, v, a, b, A_log, dt_bias, state, slots, cu, length, config=c
    )
    default = _chunk_configs(seqs)
    candidates = [default] + [default | change for change in GDN_CHUNK]
    configs = [c for i, c in enumerate(candidates) if c not in candidates[:i]]  # a change may be the default
    name = f"gdn chunked prefill {seqs} x {length}"
    return _sweep(name, configs, chunk, lambda c: chunk(c, 0), ref, 1, {"tokens": T, "seqs": seqs})


def sweep_gdn_chunk(dev: torch.device) -> list[dict[str, Any]]:
    rows = []
    for seqs, length in GDN_CHUNK_PASSES:
        rows += _gdn_chunk_point(dev, seqs, length)
        torch.cuda.empty_cache()
    return rows


def sweep_conv(dev: torch.device) -> list[dict[str, Any]]:
    """The prefill conv1d's tiles on a 16 x 1,024-token pass of Qwen3.5's conv width (8,192 channels),
    checked against the table's config."""
    seqs, length, C = 16, 1024, 8192
    T = seqs * length
    x = torch.randn(T, C, device=dev, dtype=BF16)
    weight = torch.randn(C, 4, device=dev, dtype=BF16)
    cu = torch.arange(0, T + 1, length, dtype=torch.int32, device=dev)
    state = torch.empty(seqs, 3, C, device=dev, dtype=BF16)
    slots = torch.arange(seqs, device=dev)
    run = lambda c, i: causal_conv1d(x, weight, cu, length, state, slots, config=c)
    ref = run(_conv_configs(), 0)
    configs = [_conv_configs()] + [dict(BLOCK_T=bt, BLOCK_C=bc, num_warps=w) for bt, bc, w in CONV]
    rows = _sweep(
        f"conv1d prefill {seqs} x {length}", configs, run, lambda c: run(c, 0), ref, 1, {"tokens": T}
    )
    for row in rows:
        row["tb_s"] = 2 * x.nbytes / row.get("us", math.nan) / 1e6
    return rows


def bf16_state_drift(dev: torch.device, batch: int = 32, steps: int = 512) -> dict[str, Any]:
    """Decode `steps` tokens from one prefilled state with fp32 and with bf16 state; the relative error
    of the bf16 path's outputs and state against the fp32 path's, at several depths."""
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(batch * steps, dev)
    s32 = torch.randn(batch, 32, 128, 128, device=dev) * 0.1
    s16 = s32.to(BF16)
    slots = torch.arange(batch, device=dev)
    out: dict[str, Any] = {"batch": batch, "steps": steps, "at": {}}
    for t in range(steps):
        sl = slice(t * batch, (t + 1) * batch)
        o32 = gated_delta_rule(q[sl], k[sl], v[sl], a[sl], b[sl], A_log, dt_bias, s32, slots)
        o16 = gated_delta_rule(q[sl], k[sl], v[sl], a[sl], b[sl], A_log, dt_bias, s16, slots)
        if t + 1 in (1, 8, 64, 256, 512):
            out["at"][t + 1] = {"out_rel_err": _rel(o16, o32), "state_rel_err": _rel(s16, s32)}
            log.info(
                "bf16 state after %d steps: out err %.2e, state err %.2e",
                t + 1,
                out["at"][t + 1]["out_rel_err"],
                out["at"][t + 1]["state_rel_err"],
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="decode,gdn,gdn_chunk,conv,drift,prefill")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dev = torch.device("cuda")
    parts = {
        "decode": sweep_decode,
        "gdn": sweep_gdn,
        "gdn_chunk": sweep_gdn_chunk,
        "conv": sweep_conv,
        "drift": bf16_state_drift,
        "prefill": sweep_prefill,
    }
    results: dict[str, Any] = {}
    for name in args.parts.split(","):
        results[name] = parts[name](dev)
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
