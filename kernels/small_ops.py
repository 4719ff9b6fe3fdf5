"""Small fused ops of the decoder loop: residual add + RMSNorm, SiLU x mul, embedding gather, sampling.

Layouts: every activation is a row-major `[T, D]` bf16/fp16/fp32 tensor (last dim contiguous).
Numerics: reductions and math in fp32, one cast at the store; the residual sum is rounded to the
activation dtype before it is normalised, as in HF (`x + r` in bf16, then RMSNorm), so results match
`*_ref` to bf16 rounding (<= 1e-2 relative, usually ~4e-3). Sampling draws its noise on the GPU
(Philox, keyed on the row's seed and step), so it needs no host round trip and a row's token does not
depend on which other rows share the batch. GPU assumptions: none beyond Triton; these are
bandwidth-bound row kernels (one program per row).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_SEED_MIX = 1000003  # step is folded into the Philox seed: seed * _SEED_MIX + step
_SEARCH_STEPS = 40  # bisection steps for the top-k / top-p thresholds: (range + 1) / 2**40 resolution


def _row_configs(d: int) -> dict[str, int]:
    """Block and warps for a row kernel of width d (one program per row, whole row in registers)."""
    block = triton.next_power_of_2(d)
    if "PYTEST_VERSION" in os.environ or os.environ.get("TRITON_INTERPRET") == "1":
        return {"BLOCK_D": block, "num_warps": 1}
    return {"BLOCK_D": block, "num_warps": 4 if block <= 2048 else 8}


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,  #
    D, eps,  #
    stride_x, stride_res, stride_out, stride_res_out,  #
    HAS_RESIDUAL: tl.constexpr, ONE_PLUS: tl.constexpr, BLOCK_D: tl.constexpr,  #
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)  # rounded as in HF
        tl.store(res_out_ptr + row * stride_res_out + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ONE_PLUS:
        w = w + 1.0
    tl.store(out_ptr + row * stride_out + offs, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(
    x_ptr, out_ptr,  #
    I,  #
    stride_x, stride_out,  #
    BLOCK_I: tl.constexpr,  #
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = offs < I
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _embedding_kernel(
    ids_ptr, table_ptr, out_ptr,  #
    D,  #
    stride_table, stride_out,  #
    BLOCK_D: tl.constexpr,  #
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    tok = tl.load(ids_ptr + row).to(tl.int64)
    vals = tl.load(table_ptr + tok * stride_table + offs, mask=mask)
    tl.store(out_ptr + row * stride_out + offs, vals, mask=mask)


@triton.jit
def _mass_above(x_ptr, V, t, y_max, inv_t, BLOCK_V: tl.constexpr):
    """Count and softmax mass (unnormalised, at temperature 1/inv_t) of the logits >= t."""
    count = 0.0
    mass = 0.0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(x_ptr + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
        keep = x >= t
        count += tl.sum(keep.to(tl.float32), axis=0)
        mass += tl.sum(tl.where(keep, tl.exp(x * inv_t - y_max), 0.0), axis=0)
    return count, mass


@triton.jit
def _gumbel_score(x, offs, seed, inv_t):
    """`x / T + Gumbel noise`; the noise of token i in a row depends only on (seed, i)."""
    return x * inv_t - tl.log(-tl.log(tl.rand(seed, offs)))


@triton.jit
def _sample_partial_kernel(
    logits_ptr, temp_ptr, seed_ptr, step_ptr, part_f_ptr, part_i_ptr,  #
    V, NC,  #
    stride_logits,  #
    SEED_MIX: tl.constexpr, BLOCK_V: tl.constexpr,  #
):
    """Per (row, chunk): max, argmax, min and the Gumbel-max winner, so unfiltered rows need no
    second pass over the vocabulary (the chunks of one row run on many SMs)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    ok = offs < V
    x = tl.load(logits_ptr + row * stride_logits + offs, mask=ok, other=-float("inf")).to(tl.float32)
    temp = tl.load(temp_ptr + row).to(tl.float32)
    seed = tl.load(seed_ptr + row) * SEED_MIX + tl.load(step_ptr + row)
    score = tl.where(ok, _gumbel_score(x, offs, seed, 1.0 / tl.maximum(temp, 1e-30)), -float("inf"))
    base = (row * NC + chunk) * 4
    tl.store(part_f_ptr + base, tl.max(x, axis=0))
    tl.store(part_f_ptr + base + 1, tl.min(tl.where(ok, x, float("inf")), axis=0))
    tl.store(part_f_ptr + base + 2, tl.max(score, axis=0))
    tl.store(part_i_ptr + base, chunk * BLOCK_V + tl.argmax(x, axis=0))
    tl.store(part_i_ptr + base + 2, chunk * BLOCK_V + tl.argmax(score, axis=0))


@triton.jit
def _sample_kernel(
    logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, seed_ptr, step_ptr, part_f_ptr, part_i_ptr, out_ptr,  #
    V, NC,  #
    stride_logits,  #
    SEED_MIX: tl.constexpr, SEARCH_STEPS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_NC: tl.constexpr,  #
):
    row = tl.program_id(0).to(tl.int64)
    x_ptr = logits_ptr + row * stride_logits
    offs_c = tl.arange(0, BLOCK_NC)
    c_ok = offs_c < NC
    base = (row * NC + offs_c) * 4
    c_max = tl.load(part_f_ptr + base, mask=c_ok, other=-float("inf"))
    x_max = tl.max(c_max, axis=0)
    x_min = tl.min(tl.load(part_f_ptr + base + 1, mask=c_ok, other=float("inf")), axis=0)
    g_max = tl.load(part_f_ptr + base + 2, mask=c_ok, other=-float("inf"))
    c_arg = tl.load(part_i_ptr + base, mask=c_ok, other=0)
    best = tl.sum(tl.where(offs_c == tl.argmax(c_max, axis=0), c_arg, 0))  # first chunk holding the max
    temp = tl.load(temp_ptr + row).to(tl.float32)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row).to(tl.float32)
    filtered = ((top_k > 0) & (top_k < V)) | (top_p < 1.0)
    if temp > 0.0:
        if filtered:
            inv_t = 1.0 / temp
            y_max = x_max * inv_t
            # Top-k: the largest threshold t with count(x >= t) >= k, by bisection on the logit value.
            lo = x_min
            if (top_k > 0) & (top_k < V):
                hi = x_max + 1.0
                for _ in range(SEARCH_STEPS):
                    mid = lo + (hi - lo) * 0.5
                    count, _m = _mass_above(x_ptr, V, mid, y_max, inv_t, BLOCK_V)
                    lo = tl.where(count >= top_k, mid, lo)
                    hi = tl.where(count >= top_k, hi, mid)
            # Top-p over the top-k survivors: the largest t whose mass above is >= top_p of theirs.
            if top_p < 1.0:
                _c, kept = _mass_above(x_ptr, V, lo, y_max, inv_t, BLOCK_V)
                hi = x_max + 1.0
                for _ in range(SEARCH_STEPS):
                    mid = lo + (hi - lo) * 0.5
                    _c, mass = _mass_above(x_ptr, V, mid, y_max, inv_t, BLOCK_V)
                    lo = tl.where(mass >= top_p * kept, mid, lo)
                    hi = tl.where(mass >= top_p * kept, hi, mid)
            # Gumbel-max over the survivors draws exactly from softmax(x / T) restricted to them.
            seed = tl.load(seed_ptr + row) * SEED_MIX + tl.load(step_ptr + row)
            best_score = -float("inf")
            for start in range(0, V, BLOCK_V):
                offs = start + tl.arange(0, BLOCK_V)
                x = tl.load(x_ptr + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
                score = tl.where(x >= lo, _gumbel_score(x, offs, seed, inv_t), -float("inf"))
                s_max = tl.max(score, axis=0)
                s_arg = tl.argmax(score, axis=0) + start
                best = tl.where(s_max > best_score, s_arg, best)
                best_score = tl.maximum(best_score, s_max)
        else:  # plain temperature: the winner of the per-chunk Gumbel maxima
            g_idx = tl.load(part_i_ptr + base + 2, mask=c_ok, other=0)
            best = tl.sum(tl.where(offs_c == tl.argmax(g_max, axis=0), g_idx, 0))
    tl.store(out_ptr + row, best.to(tl.int64))


def _check_rows(name: str, t: torch.Tensor, rows: int | None = None, width: int | None = None) -> None:
    if t.dim() != 2 or t.stride(-1) != 1:
        raise ValueError(f"{name}: expected a 2-D tensor with a contiguous last dim, got shape "
                         f"{tuple(t.shape)} strides {t.stride()}")
    if rows is not None and t.shape[0] != rows:
        raise ValueError(f"{name}: expected {rows} rows, got {t.shape[0]}")
    if width is not None and t.shape[1] != width:
        raise ValueError(f"{name}: expected width {width}, got {t.shape[1]}")


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, one_plus: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-norm residual step: `r = x + residual; return rmsnorm(r), r` in one pass.

    x, residual `[T, D]`; weight `[D]`. With `residual=None` the sum is x itself (first layer) and
    x is returned as the new residual. `one_plus` selects Qwen3.5's `(1 + w)` scale, else `w`.
    """
    _check_rows("x", x)
    T, D = x.shape
    if residual is not None:
        _check_rows("residual", residual, T, D)
        if residual.dtype != x.dtype:
            raise ValueError(f"residual: expected dtype {x.dtype}, got {residual.dtype}")
    if weight.shape != (D,):
        raise ValueError(f"weight: expected shape ({D},), got {tuple(weight.shape)}")
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    cfg = _row_configs(D)
    _add_rmsnorm_kernel[(T,)](
        x, residual if residual is not None else x, weight, out, res_out,
        D, eps,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), res_out.stride(0),
        HAS_RESIDUAL=residual is not None, ONE_PLUS=one_plus,
        BLOCK_D=cfg["BLOCK_D"], num_warps=cfg["num_warps"],
    )
    return out, res_out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, one_plus: bool) -> torch.Tensor:
    """RMSNorm over the last dim of `[T, D]` x: `x * rsqrt(mean(x^2) + eps) * (1 + w if one_plus else w)`."""
    return add_rmsnorm(x, None, weight, eps, one_plus)[0]


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """`[T, 2I]` -> `[T, I]`: `silu(x[:, :I]) * x[:, I:]` (gate first, then up, as a fused gate_up)."""
    _check_rows("x", x)
    T, two_i = x.shape
    if two_i % 2:
        raise ValueError(f"x: expected an even width (gate | up), got {two_i}")
    I = two_i // 2
    out = torch.empty((T, I), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(I))
    _silu_mul_kernel[(T, triton.cdiv(I, block))](x, out, I, x.stride(0), out.stride(0), BLOCK_I=block)
    return out


def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Gather rows of `table [V, D]` for `ids [T]` (int32/int64, each in [0, V): the tokenizer's contract)."""
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids: expected a 1-D int32/int64 tensor, got {tuple(ids.shape)} {ids.dtype}")
    _check_rows("table", table)
    D = table.shape[1]
    out = torch.empty((ids.shape[0], D), dtype=table.dtype, device=table.device)
    block = min(1024, triton.next_power_of_2(D))
    _embedding_kernel[(ids.shape[0], triton.cdiv(D, block))](
        ids.contiguous(), table, out, D, table.stride(0), out.stride(0), BLOCK_D=block
    )
    return out


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
) -> torch.Tensor:
    """Draw one token per row of `logits [B, V]` on the device; returns int64 `[B]`.

    Per-row tensors `[B]` on the logits' device: temperature (0 = greedy argmax), top_k (0 = off),
    top_p (1 = off), seeds and steps (int64; the noise is keyed on (seed, step), so a row's draw is
    reproducible and independent of its batch mates). Order as in HF: temperature, top-k, top-p.
    Ties at a top-k / top-p threshold keep every tied token.
    """
    _check_rows("logits", logits)
    B, V = logits.shape
    for name, t, dtypes in (
        ("temperature", temperature, (torch.float32,)),
        ("top_k", top_k, (torch.int32, torch.int64)),
        ("top_p", top_p, (torch.float32,)),
        ("seeds", seeds, (torch.int64,)),
        ("steps", steps, (torch.int64,)),
    ):
        if t.shape != (B,) or t.dtype not in dtypes or t.device != logits.device:
            raise ValueError(f"{name}: expected shape ({B},) dtype in {dtypes} on {logits.device}, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    block = min(triton.next_power_of_2(V), 1024 if interp else 4096)
    nc = triton.cdiv(V, block)
    part_f = torch.empty((B, nc, 4), dtype=torch.float32, device=logits.device)  # max, min, gumbel max, -
    part_i = torch.empty((B, nc, 4), dtype=torch.int32, device=logits.device)  # argmax, -, gumbel argmax, -
    _sample_partial_kernel[(B, nc)](
        logits, temperature, seeds, steps, part_f, part_i,
        V, nc, logits.stride(0),
        SEED_MIX=_SEED_MIX, BLOCK_V=block, num_warps=1 if interp else 8,
    )
    _sample_kernel[(B,)](
        logits, temperature, top_k, top_p, seeds, steps, part_f, part_i, out,
        V, nc, logits.stride(0),
        SEED_MIX=_SEED_MIX, SEARCH_STEPS=_SEARCH_STEPS, BLOCK_V=block, BLOCK_NC=triton.next_power_of_2(nc),
        num_warps=1 if interp else 8,
    )
    return out


def add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, one_plus: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 reference of `add_rmsnorm`; returns fp32 (normed, residual sum rounded to x.dtype)."""
    r = x if residual is None else (x.float() + residual.float()).to(x.dtype)  # reads x, residual; writes r
    rf = r.float()
    w = weight.float() + 1.0 if one_plus else weight.float()
    return rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps) * w, r  # reads r, w; writes out


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """fp32 reference of `silu_mul`."""
    gate, up = x.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def embedding_ref(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[ids.long()]


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
            keep &= y >= torch.topk(y, k).values[-1]
        p = torch.softmax(y.masked_fill(~keep, -float("inf")), -1)
        if float(top_p[b]) < 1.0:
            sorted_p, order = p.sort(descending=True)
            before = sorted_p.cumsum(0) - sorted_p  # mass strictly above each token
            cut = sorted_p[before < float(top_p[b])][-1]  # the smallest kept probability
            keep &= p >= cut
            p = torch.softmax(y.masked_fill(~keep, -float("inf")), -1)
        probs[b] = p
    return probs


def sample_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
) -> torch.Tensor:
    """CPU reference of `sample`: same distribution and keying, but torch's RNG stream, not Philox."""
    probs = sample_probs_ref(logits, temperature, top_k, top_p)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    for b in range(logits.shape[0]):
        gen = torch.Generator().manual_seed((int(seeds[b]) * _SEED_MIX + int(steps[b])) % 2**63)
        out[b] = torch.multinomial(probs[b].cpu(), 1, generator=gen)[0]
    return out
