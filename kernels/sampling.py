"""Token sampling on the device: greedy, temperature, top-k and top-p, with a seed per row.

Input: fp32/bf16 logits `[B, V]` (last dim contiguous) and per-row parameter tensors; output int64
tokens `[B]`; no host round trip. Every row is cut into `BLOCK_V` chunks that run on many SMs:
- greedy and plain-temperature rows are decided in one pass: per chunk the max and the Gumbel-max
  winner (`x / T - log(-log(u))`, u from Philox keyed on (seed * SEED_MIX + step, token)), then a
  per-row combine. Gumbel-max draws exactly from softmax(x / T).
- top-k / top-p rows need the cut threshold on the logit value: the largest t with count(x >= t) >= k,
  then (among those) the largest t with mass(x >= t) >= top_p * their mass. Each is found by an
  8-way search: a launch counts, per chunk, 7 candidate thresholds at once (3 bits of the threshold per
  launch, `_ROUNDS` launches per cut) and the next launch folds the per-chunk totals in a fixed order,
  so the result is deterministic. Then the Gumbel-max winner among tokens >= t.
Ties at a threshold keep every tied token. Numerics fp32. GPU: nothing beyond Triton.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_SEED_MIX = 1000003  # step is folded into the Philox seed: seed * _SEED_MIX + step
_ROUNDS = 11  # 8-way search launches per cut: (range + 1) / 8**11 ~ 1e-10 * range resolution
_K, _KEPT, _P = 0, 1, 2  # search modes: top-k count, top-k survivors' mass, top-p mass


@triton.jit
def _gumbel(x, offs, seed, inv_t):
    """`x / T + Gumbel noise`; the noise of token i in a row depends only on (seed, i)."""
    return x * inv_t - tl.log(-tl.log(tl.rand(seed, offs)))


@triton.jit
def _row_params(temp_ptr, top_k_ptr, top_p_ptr, row, V):
    temp = tl.load(temp_ptr + row).to(tl.float32)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row).to(tl.float32)
    use_k = (temp > 0.0) & (top_k > 0) & (top_k < V)
    use_p = (temp > 0.0) & (top_p < 1.0)
    return temp, top_k, top_p, use_k, use_p


@triton.jit
def _partial_kernel(
    logits_ptr, temp_ptr, seed_ptr, step_ptr, part_ptr,  #
    V, NC,  #
    stride_logits,  #
    SEED_MIX: tl.constexpr, BLOCK_V: tl.constexpr,  #
):
    """Per (row, chunk): max, min, argmax and the Gumbel-max winner -> part [B, NC, 8]."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    ok = offs < V
    x = tl.load(logits_ptr + row * stride_logits + offs, mask=ok, other=-float("inf")).to(tl.float32)
    temp = tl.load(temp_ptr + row).to(tl.float32)
    seed = tl.load(seed_ptr + row) * SEED_MIX + tl.load(step_ptr + row)
    score = tl.where(ok, _gumbel(x, offs, seed, 1.0 / tl.maximum(temp, 1e-30)), -float("inf"))
    base = part_ptr + (row * NC + chunk) * 8
    tl.store(base, tl.max(x, axis=0))
    tl.store(base + 1, tl.min(tl.where(ok, x, float("inf")), axis=0))
    tl.store(base + 2, (chunk * BLOCK_V + tl.argmax(x, axis=0)).to(tl.float32))  # exact below 2**24
    tl.store(base + 3, tl.max(score, axis=0))
    tl.store(base + 4, (chunk * BLOCK_V + tl.argmax(score, axis=0)).to(tl.float32))


@triton.jit
def _init_kernel(
    part_ptr, temp_ptr, bounds_ptr, out_ptr,  #
    NC,  #
    BLOCK_NC: tl.constexpr,  #
):
    """Per row: the greedy / plain-temperature token, and the search bounds [x_min, x_max + 1]."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_NC)
    p = part_ptr + (row * NC + offs) * 8
    ok = offs < NC
    c_max = tl.load(p, mask=ok, other=-float("inf"))
    g_max = tl.load(p + 3, mask=ok, other=-float("inf"))
    x_max = tl.max(c_max, axis=0)
    x_min = tl.min(tl.load(p + 1, mask=ok, other=float("inf")), axis=0)
    arg = tl.sum(tl.where(offs == tl.argmax(c_max, axis=0), tl.load(p + 2, mask=ok, other=0.0), 0.0))
    g_arg = tl.sum(tl.where(offs == tl.argmax(g_max, axis=0), tl.load(p + 4, mask=ok, other=0.0), 0.0))
    temp = tl.load(temp_ptr + row).to(tl.float32)
    tl.store(out_ptr + row, tl.where(temp > 0.0, g_arg, arg).to(tl.int64))
    b = bounds_ptr + row * 8  # bounds [2, B, 8]: lo, hi, kept mass, x_max / T, x_max
    tl.store(b, x_min)
    tl.store(b + 1, x_max + 1.0)
    tl.store(b + 3, x_max / tl.maximum(temp, 1e-30))
    tl.store(b + 4, x_max)


@triton.jit
def _search_kernel(
    logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, bounds_ptr, acc_ptr,  #
    V, B, NC, SRC, DST,  #
    stride_logits,  #
    MODE: tl.constexpr, FOLD: tl.constexpr, COUNT: tl.constexpr, BLOCK_V: tl.constexpr,  #
    BLOCK_NC: tl.constexpr,  #
):
    """One launch of the 8-way threshold search; reads bounds/acc[SRC], writes bounds/acc[DST].

    FOLD narrows [lo, hi) with the totals counted at the previous launch's 7 thresholds; COUNT counts
    (MODE _K) or weighs (MODE _P) this chunk's tokens at the new 7 thresholds, or (MODE _KEPT) weighs
    the tokens >= lo, the top-k survivors, whose total the first _P launch stores as `kept`."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temp, top_k, top_p, use_k, use_p = _row_params(temp_ptr, top_k_ptr, top_p_ptr, row, V)
    src = bounds_ptr + (SRC * B + row) * 8
    dst = bounds_ptr + (DST * B + row) * 8
    lo = tl.load(src)
    hi = tl.load(src + 1)
    kept = tl.load(src + 2)
    y_max = tl.load(src + 3)
    x_max = tl.load(src + 4)
    j = tl.arange(0, 8)
    if MODE == 0:
        active = use_k
    else:
        active = use_p
    if active:
        if FOLD | (MODE == 2):
            offs_c = tl.arange(0, BLOCK_NC)
            a = acc_ptr + ((SRC * B + row) * NC + offs_c)[:, None] * 8 + j[None, :]
            totals = tl.sum(tl.load(a, mask=(offs_c < NC)[:, None], other=0.0), axis=0)  # [8], fixed order
            if FOLD:
                mids = lo + (hi - lo) * ((j + 1).to(tl.float32) / 8.0)
                need = top_k.to(tl.float32) if MODE == 0 else top_p * kept
                passed = (totals >= need) & (j < 7)  # monotone: true for a prefix of the 7 thresholds
                n = tl.sum(passed.to(tl.int32), axis=0)
                new_lo = tl.max(tl.where(passed, mids, lo), axis=0)
                hi = tl.min(tl.where((j == n) & (j < 7), mids, hi), axis=0)
                lo = new_lo
            else:  # first top-p launch: the survivors' mass, weighed by the _KEPT launch
                kept = tl.sum(tl.where(j == 0, totals, 0.0), axis=0)
                hi = x_max + 1.0
    if chunk == 0:  # inactive rows carry their bounds through unchanged
        tl.store(dst, lo)
        tl.store(dst + 1, hi)
        tl.store(dst + 2, kept)
        tl.store(dst + 3, y_max)
        tl.store(dst + 4, x_max)
    if COUNT & active:
        offs = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
        x = tl.load(logits_ptr + row * stride_logits + offs, mask=offs < V, other=-float("inf"))
        x = x.to(tl.float32)
        if MODE == 1:
            thr = tl.where(j == 0, lo, float("inf"))
        else:
            thr = tl.where(j < 7, lo + (hi - lo) * ((j + 1).to(tl.float32) / 8.0), float("inf"))
        above = x[:, None] >= thr[None, :]  # [BLOCK_V, 8]
        if MODE == 0:
            w = above.to(tl.float32)
        else:
            w = tl.where(above, tl.exp(x * (1.0 / temp) - y_max)[:, None], 0.0)
        tl.store(acc_ptr + ((DST * B + row) * NC + chunk) * 8 + j, tl.sum(w, axis=0))


@triton.jit
def _draw_kernel(
    logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, seed_ptr, step_ptr, bounds_ptr, part_ptr,  #
    V, B, NC, SRC,  #
    stride_logits,  #
    SEED_MIX: tl.constexpr, BLOCK_V: tl.constexpr,  #
):
    """Per (filtered row, chunk): the Gumbel-max winner among tokens >= the final threshold."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temp, top_k, top_p, use_k, use_p = _row_params(temp_ptr, top_k_ptr, top_p_ptr, row, V)
    if use_k | use_p:
        lo = tl.load(bounds_ptr + (SRC * B + row) * 8)
        offs = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
        x = tl.load(logits_ptr + row * stride_logits + offs, mask=offs < V, other=-float("inf"))
        x = x.to(tl.float32)
        seed = tl.load(seed_ptr + row) * SEED_MIX + tl.load(step_ptr + row)
        score = tl.where((x >= lo) & (offs < V), _gumbel(x, offs, seed, 1.0 / temp), -float("inf"))
        base = part_ptr + (row * NC + chunk) * 8
        tl.store(base + 5, tl.max(score, axis=0))
        tl.store(base + 6, (chunk * BLOCK_V + tl.argmax(score, axis=0)).to(tl.float32))


@triton.jit
def _finish_kernel(
    part_ptr, temp_ptr, top_k_ptr, top_p_ptr, out_ptr,  #
    V, NC,  #
    BLOCK_NC: tl.constexpr,  #
):
    row = tl.program_id(0).to(tl.int64)
    temp, top_k, top_p, use_k, use_p = _row_params(temp_ptr, top_k_ptr, top_p_ptr, row, V)
    if use_k | use_p:
        offs = tl.arange(0, BLOCK_NC)
        p = part_ptr + (row * NC + offs) * 8
        score = tl.load(p + 5, mask=offs < NC, other=-float("inf"))
        idx = tl.load(p + 6, mask=offs < NC, other=0.0)
        win = tl.sum(tl.where(offs == tl.argmax(score, axis=0), idx, 0.0))
        tl.store(out_ptr + row, win.to(tl.int64))


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    seeds: torch.Tensor, steps: torch.Tensor, filtered: bool = True,
) -> torch.Tensor:
    """Draw one token per row of `logits [B, V]`; returns int64 `[B]`.

    Per-row tensors `[B]` on the logits' device: temperature (0 = greedy argmax), top_k (0 = off),
    top_p (1 = off), seeds and steps (int64; a row's draw depends only on its logits, parameters and
    (seed, step), never on its batch mates). Order as in HF: temperature, then top-k, then top-p.
    `filtered=False` is the caller's promise that no row uses top-k / top-p (known on the host from
    the requests): it skips the threshold search, 2 launches instead of ~30.
    """
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits: expected [B, V] with a contiguous last dim, got {tuple(logits.shape)}")
    B, V = logits.shape
    for name, t, dtypes in (("temperature", temperature, (torch.float32,)), ("top_k", top_k, (torch.int32,)),
                            ("top_p", top_p, (torch.float32,)), ("seeds", seeds, (torch.int64,)),
                            ("steps", steps, (torch.int64,))):
        if t.shape != (B,) or t.dtype not in dtypes or t.device != logits.device:
            raise ValueError(f"{name}: expected shape ({B},) dtype in {dtypes} on {logits.device}, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    block = min(triton.next_power_of_2(V), 1024 if interp else 4096)
    nc = triton.cdiv(V, block)
    dev = logits.device
    out = torch.empty(B, dtype=torch.int64, device=dev)
    part = torch.empty((B, nc, 8), dtype=torch.float32, device=dev)
    bounds = torch.zeros((2, B, 8), dtype=torch.float32, device=dev)
    warps = 1 if interp else 8
    _partial_kernel[(B, nc)](logits, temperature, seeds, steps, part, V, nc, logits.stride(0),
                             SEED_MIX=_SEED_MIX, BLOCK_V=block, num_warps=warps)
    block_nc = triton.next_power_of_2(nc)
    _init_kernel[(B,)](part, temperature, bounds, out, nc, BLOCK_NC=block_nc)
    if not filtered:
        return out
    acc = torch.empty((2, B, nc, 8), dtype=torch.float32, device=dev)
    cur = 0

    def search(mode: int, fold: bool, count: bool) -> None:
        nonlocal cur
        _search_kernel[(B, nc)](logits, temperature, top_k, top_p, bounds, acc, V, B, nc, cur, 1 - cur,
                                logits.stride(0), MODE=mode, FOLD=fold, COUNT=count, BLOCK_V=block,
                                BLOCK_NC=block_nc, num_warps=warps)
        cur = 1 - cur

    for mode in (_K, _P):
        if mode == _P:
            search(_KEPT, False, True)
        search(mode, False, True)
        for _ in range(_ROUNDS - 1):
            search(mode, True, True)
        search(mode, True, False)
    _draw_kernel[(B, nc)](logits, temperature, top_k, top_p, seeds, steps, bounds, part, V, B, nc, cur,
                          logits.stride(0), SEED_MIX=_SEED_MIX, BLOCK_V=block, num_warps=warps)
    _finish_kernel[(B,)](part, temperature, top_k, top_p, out, V, nc, BLOCK_NC=block_nc)
    return out


def sample_probs_ref(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """The fp32 distribution `sample` draws from, `[B, V]` (one-hot argmax on greedy rows)."""
    x = logits.float()
    probs = torch.zeros_like(x)
    for b in range(x.shape[0]):
        if float(temperature[b]) == 0.0:
            probs[b, x[b].argmax()] = 1.0
            continue
        y = x[b] / float(temperature[b])
        keep = torch.ones_like(y, dtype=torch.bool)
        k = int(top_k[b])
        if 0 < k < y.numel():
            keep &= y >= torch.topk(y, k).values[-1]  # reads y, writes the top-k mask
        p = torch.softmax(y.masked_fill(~keep, -float("inf")), -1)
        if float(top_p[b]) < 1.0:
            sorted_p, _ = p.sort(descending=True)
            before = sorted_p.cumsum(0) - sorted_p  # mass strictly above each token
            keep &= p >= sorted_p[before < float(top_p[b])][-1]  # down to the smallest kept probability
            p = torch.softmax(y.masked_fill(~keep, -float("inf")), -1)
        probs[b] = p
    return probs


def sample_ref(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    seeds: torch.Tensor, steps: torch.Tensor,
) -> torch.Tensor:
    """CPU reference of `sample`: the same distribution and keying, but torch's RNG stream, not Philox."""
    probs = sample_probs_ref(logits, temperature, top_k, top_p)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    for b in range(logits.shape[0]):
        gen = torch.Generator().manual_seed((int(seeds[b]) * _SEED_MIX + int(steps[b])) % 2**63)
        out[b] = torch.multinomial(probs[b].cpu(), 1, generator=gen)[0]
    return out
