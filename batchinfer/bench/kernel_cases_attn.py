"""Benchmark cases for attention, Gated DeltaNet and the small fused ops at the real shapes of both models.

M is the batch (decode ops, sampling) or the token count (prefill ops, row ops). Bytes are the fewest a
call must move: decode attention reads the KV of every row once (context `_ctx(m)`), the recurrent
DeltaNet step reads and writes each row's state once. Baselines: "sdpa" (torch
`scaled_dot_product_attention`, KV heads pre-expanded so the flash backend applies), "varlen_flash" (torch's
packed flash attention, `torch.nn.attention.varlen`, where this torch has it: the one peer that takes
`cu_seqlens` as our prefill does) and "torch" (the same math in vectorised torch ops, for DeltaNet and
sampling).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from batchinfer.bench.kernels import KernelCase, Target, Timed, register, rotating_sets
from batchinfer.kernels.attention import decode_attention, prefill_attention
from batchinfer.kernels.causal_conv1d import causal_conv1d, causal_conv1d_update
from batchinfer.kernels.gdn import gated_delta_rule, gated_rmsnorm
from batchinfer.kernels.gdn_chunk import chunk_gated_delta_rule
from batchinfer.kernels.qk_norm_rope import qk_norm_rope, rope_inv_freq
from batchinfer.kernels.sampling import sample
from batchinfer.kernels.small_ops import add_rmsnorm, embedding, silu_mul
from batchinfer.models.config import ModelConfig

BF16 = torch.bfloat16
DECODE_MAX_BATCH = 512
PREFILL_MIN_TOKENS = 512


def _ctx(batch: int) -> int:
    """Context length of the decode-attention cases: 4k, 1k at the largest batches (memory)."""
    return 4096 if batch <= 128 else 1024


def _decode_attn(cfg: ModelConfig, batch: int, dev: torch.device, fp8: bool = False) -> Timed:
    """bf16 caches, or (fp8) E4M3 caches with a scale per token and head (`kv_cache.py`); the sdpa
    baseline reads bf16 either way."""
    H, Hkv, Dh, L = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, _ctx(batch)
    kv_bytes = 2 * batch * Hkv * L * (Dh + 4 if fp8 else 2 * Dh)
    sets = rotating_sets(kv_bytes)
    caches = [
        (
            torch.randn(batch, Hkv, L, Dh, device=dev, dtype=BF16),
            torch.randn(batch, Hkv, L, Dh, device=dev, dtype=BF16),
        )
        for _ in range(sets)
    ]
    scales: list[dict] = [{}] * sets
    if fp8:  # scales rotate with their caches, so they are not read from L2
        fp8_caches = [(k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)) for k, v in caches]
        scales = [
            {n: torch.ones(batch, Hkv, L, device=dev) for n in ("k_scale", "v_scale")} for _ in range(sets)
        ]
    qs = [torch.randn(batch, H, Dh, device=dev, dtype=BF16) for _ in range(sets)]
    gate = torch.randn(batch, H, Dh, device=dev, dtype=BF16) if cfg.attn_output_gate else None
    slots = torch.arange(batch, device=dev)
    lens = torch.full((batch,), L, dtype=torch.int32, device=dev)
    rep = H // Hkv

    def sdpa(i: int) -> torch.Tensor:  # expands the GQA heads itself: what an unfused path must do
        k, v = caches[i]
        q = qs[i][:, :, None]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))

    ours = fp8_caches if fp8 else caches
    return Timed(
        run=lambda i: decode_attention(qs[i], *ours[i], slots, lens, max_seqlen=L, gate=gate, **scales[i]),
        n_sets=sets,
        bytes=kv_bytes + 2 * 2 * batch * H * Dh,
        flops=4 * batch * H * L * Dh,
        baselines={"sdpa": sdpa},
    )


def _varlen_flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, tokens: int
) -> dict[str, Callable[[int], torch.Tensor]]:
    """torch's causal varlen flash attention over the packed tensors, as a baseline; {} where this torch
    lacks it. Its causal flag and GQA support changed between releases, so both are read off its signature."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return {}
    params = inspect.signature(varlen_attn).parameters
    kw: dict[str, object] = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        kw["enable_gqa"] = True
    else:
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], 1) for x in (k, v))
    return {"varlen_flash": lambda i: varlen_attn(q, k, v, cu, cu, tokens, tokens, **kw)}


def _prefill_attn(cfg: ModelConfig, tokens: int, dev: torch.device) -> Timed:
    H, Hkv, Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = torch.randn(tokens, H, Dh, device=dev, dtype=BF16)
    k = torch.randn(tokens, Hkv, Dh, device=dev, dtype=BF16)
    v = torch.randn(tokens, Hkv, Dh, device=dev, dtype=BF16)
    gate = torch.randn(tokens, H, Dh, device=dev, dtype=BF16) if cfg.attn_output_gate else None
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=dev)
    qt = q.transpose(0, 1)[None]
    kt = k.repeat_interleave(H // Hkv, 1).transpose(0, 1)[None]
    vt = v.repeat_interleave(H // Hkv, 1).transpose(0, 1)[None]
    return Timed(
        run=lambda i: prefill_attention(q, k, v, cu, tokens, gate=gate),
        n_sets=1,
        bytes=2 * tokens * (2 * H + 2 * Hkv) * Dh,
        flops=2 * H * tokens * tokens * Dh,  # QK^T and PV, each 2*T*T*Dh, halved by the causal mask
        baselines={
            "sdpa": lambda i: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True),
            **_varlen_flash(q, k, v, cu, tokens),
        },
    )


def _gdn_shapes(cfg: ModelConfig) -> tuple[int, int, int, int]:
    return (
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    )


def _gdn_decode(cfg: ModelConfig, batch: int, state_dtype: torch.dtype, dev: torch.device) -> Timed:
    Hk, Hv, Dk, Dv = _gdn_shapes(cfg)
    state_bytes = batch * Hv * Dk * Dv * state_dtype.itemsize
    sets = rotating_sets(2 * state_bytes)
    states = [torch.randn(batch, Hv, Dk, Dv, device=dev).to(state_dtype) * 0.1 for _ in range(sets)]
    mixed = torch.randn(batch, 2 * Hk * Dk + Hv * Dv, device=dev, dtype=BF16)
    q = mixed[:, : Hk * Dk].view(batch, Hk, Dk)
    k = mixed[:, Hk * Dk : 2 * Hk * Dk].view(batch, Hk, Dk)
    v = mixed[:, 2 * Hk * Dk :].view(batch, Hv, Dv)
    a, b = torch.randn(batch, Hv, device=dev, dtype=BF16), torch.randn(batch, Hv, device=dev, dtype=BF16)
    A_log, dt_bias = torch.rand(Hv, device=dev), torch.randn(Hv, device=dev)
    slots = torch.arange(batch, device=dev)

    def torch_step(i: int) -> torch.Tensor:  # HF's recurrent step, vectorised over rows and heads
        S = states[i].float()
        qf = F.normalize(q.float(), dim=-1, eps=1e-6).repeat_interleave(Hv // Hk, 1) * Dk**-0.5
        kf = F.normalize(k.float(), dim=-1, eps=1e-6).repeat_interleave(Hv // Hk, 1)
        g = (-A_log.exp() * F.softplus(a.float() + dt_bias)).exp()[..., None, None]
        S = S * g
        delta = (v.float() - (S * kf[..., None]).sum(-2)) * torch.sigmoid(b.float())[..., None]
        S = S + kf[..., None] * delta[..., None, :]
        states[i].copy_(S)
        return (S * qf[..., None]).sum(-2)

    return Timed(
        run=lambda i: gated_delta_rule(q, k, v, a, b, A_log, dt_bias, states[i], slots),
        n_sets=sets,
        bytes=2 * state_bytes + 2 * mixed.numel() + 2 * batch * Hv * Dv,
        flops=batch * Hv * Dk * Dv * 7,
        baselines={"torch": torch_step},
    )


def fla_chunk_rule() -> Callable | None:
    """fla-core's `chunk_gated_delta_rule` (issue 5's candidate peer for the chunked DeltaNet prefill), or
    None where fla-core is not installed (it is no dependency of ours) or older than 0.6: `fla_prefill`
    passes the in-kernel gate options as keyword arguments, which 0.6 reads from `**kwargs` and an older
    version could swallow silently (timing another rule)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        if tuple(int(p) for p in version("fla-core").split(".")[:2]) < (0, 6):
            return None
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule
    except (PackageNotFoundError, ImportError, ValueError):
        return None
    return fla_rule


def fla_prefill(
    fla_rule: Callable,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla-core on our raw inputs (packed `[T, H, D]`), computing what `chunk_gated_delta_rule` does: q/k L2
    norm, sigmoid(b), the decay from A_log and dt_bias all inside its kernels, GVA heads, final states
    out. Returns (o `[T, Hv, Dv]`, final states `[N, Hv, Dk, Dv]` fp32)."""
    o, ht = fla_rule(
        q[None],
        k[None],
        v[None],
        a[None],
        b[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        use_gate_in_kernel=True,
        A_log=A_log,
        dt_bias=dt_bias,
        cu_seqlens=cu_seqlens.long(),
    )
    return o[0], ht


def _gdn_prefill(cfg: ModelConfig, tokens: int, chunked: bool, dev: torch.device) -> Timed:
    """Sequences of 1024 tokens from a zero state: the chunked kernel (beside fla-core's, where installed,
    on contiguous copies of the same inputs), or the token recurrence."""
    Hk, Hv, Dk, Dv = _gdn_shapes(cfg)
    seqs = max(1, tokens // 1024)
    cu = torch.linspace(0, tokens, seqs + 1, device=dev).round().to(torch.int32)
    mixed = torch.randn(tokens, 2 * Hk * Dk + Hv * Dv, device=dev, dtype=BF16)
    q = mixed[:, : Hk * Dk].view(tokens, Hk, Dk)
    k = mixed[:, Hk * Dk : 2 * Hk * Dk].view(tokens, Hk, Dk)
    v = mixed[:, 2 * Hk * Dk :].view(tokens, Hv, Dv)
    a, b = torch.randn(tokens, Hv, device=dev, dtype=BF16), torch.randn(tokens, Hv, device=dev, dtype=BF16)
    A_log, dt_bias = torch.rand(Hv, device=dev), torch.randn(Hv, device=dev)
    state = torch.empty(seqs, Hv, Dk, Dv, device=dev)
    slots = torch.arange(seqs, device=dev)
    baselines = {}
    if chunked:
        run = lambda i: chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, slots, cu, 1024)
        fla_rule = fla_chunk_rule()
        if fla_rule is not None:
            qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
            baselines["fla"] = lambda i: fla_prefill(fla_rule, qc, kc, vc, a, b, A_log, dt_bias, cu)
    else:
        run = lambda i: gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, slots, cu)
    return Timed(
        run=run,
        n_sets=1,
        bytes=2 * mixed.numel() + 2 * tokens * Hv * Dv + state.numel() * 4,
        flops=tokens * Hv * Dk * Dv * 7,
        baselines=baselines,
        eager=frozenset({"fla"}),  # fla-core reads cu_seqlens on the host (chunk indices): not capturable
    )


def _conv(cfg: ModelConfig, m: int, decode: bool, dev: torch.device) -> Timed:
    Hk, Hv, Dk, Dv = _gdn_shapes(cfg)
    C, K = 2 * Hk * Dk + Hv * Dv, cfg.linear_conv_kernel_dim
    sets = rotating_sets(2 * 2 * m * C)
    xs = [torch.randn(m, C, device=dev, dtype=BF16) for _ in range(sets)]
    w = torch.randn(C, K, device=dev, dtype=BF16)
    slots = torch.arange(m if decode else 1, device=dev)
    state = torch.randn(len(slots), K - 1, C, device=dev, dtype=BF16)
    if decode:
        run = lambda i: causal_conv1d_update(xs[i], w, state, slots)
        io = 2 * m * C * 2 + 2 * m * (K - 1) * C * 2
    else:
        cu = torch.tensor([0, m], dtype=torch.int32, device=dev)
        run = lambda i: causal_conv1d(xs[i], w, cu, m, state, slots)
        io = 2 * m * C * 2
    return Timed(run=run, n_sets=sets, bytes=io, flops=2 * m * C * K)


def _rows(
    m: int, width: int, n_in: int, fn: Callable[..., object], out_bytes: int, dev: torch.device
) -> Timed:
    """A row op on `n_in` bf16 inputs `[m, width]` that writes `out_bytes`."""
    nbytes = 2 * m * width * n_in + out_bytes
    sets = rotating_sets(nbytes)
    ins = [[torch.randn(m, width, device=dev, dtype=BF16) for _ in range(n_in)] for _ in range(sets)]
    return Timed(run=lambda i: fn(*ins[i]), n_sets=sets, bytes=nbytes, flops=0)


def _sample(cfg: ModelConfig, batch: int, filtered: bool, dev: torch.device) -> Timed:
    V = cfg.vocab_size
    sets = rotating_sets(4 * batch * V)
    logits = [torch.randn(batch, V, device=dev) * 3 for _ in range(sets)]
    temp = torch.full((batch,), 0.7 if filtered else 0.0, device=dev)
    top_k = torch.full((batch,), 50 if filtered else 0, dtype=torch.int32, device=dev)
    top_p = torch.full((batch,), 0.9 if filtered else 1.0, device=dev)
    seeds = torch.arange(batch, device=dev)
    steps = torch.zeros(batch, dtype=torch.int64, device=dev)

    def torch_sample(i: int) -> torch.Tensor:  # HF-style: temperature, top-k, sorted top-p, multinomial
        x = logits[i] / 0.7
        kth = torch.topk(x, 50, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, -float("inf"))
        srt, idx = x.sort(-1, descending=True)
        cum = srt.softmax(-1).cumsum(-1)
        srt = srt.masked_fill(cum - srt.softmax(-1) >= 0.9, -float("inf"))
        return idx.gather(1, torch.multinomial(srt.softmax(-1), 1))

    baselines = {"torch": torch_sample} if filtered else {"argmax": lambda i: logits[i].argmax(-1)}
    return Timed(
        run=lambda i: sample(logits[i], temp, top_k, top_p, seeds, steps, filtered=filtered),
        n_sets=sets,
        bytes=4 * batch * V,
        flops=0,
        baselines=baselines,
    )


@register
def attention_cases(model: str, cfg: ModelConfig, ms: Sequence[int]) -> Iterator[KernelCase]:
    H, Hkv, Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    for m in ms:
        if m <= DECODE_MAX_BATCH:
            yield KernelCase(
                "decode_attention",
                model,
                f"GQA {H}/{Hkv} Dh={Dh} ctx={_ctx(m)}",
                m,
                lambda dev, m=m: _decode_attn(cfg, m, dev),
                Target("bandwidth", 0.70) if m >= 32 else None,
            )
            yield KernelCase(
                "decode_attention_fp8",
                model,
                f"GQA {H}/{Hkv} Dh={Dh} ctx={_ctx(m)}, FP8 cache",
                m,
                lambda dev, m=m: _decode_attn(cfg, m, dev, fp8=True),
                Target("bandwidth", 0.70) if m >= 32 else None,
            )
        if m >= PREFILL_MIN_TOKENS:
            yield KernelCase(
                "prefill_attention",
                model,
                f"causal GQA {H}/{Hkv} Dh={Dh}",
                m,
                lambda dev, m=m: _prefill_attn(cfg, m, dev),
                Target("flops", 0.50) if m >= 4096 else None,
            )

        def norm_rope(dev: torch.device, m: int = m) -> Timed:
            inv_freq = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, dev)
            sets = rotating_sets(4 * m * (H + Hkv) * Dh)
            qk = [
                (
                    torch.randn(m, H, Dh, device=dev, dtype=BF16),
                    torch.randn(m, Hkv, Dh, device=dev, dtype=BF16),
                )
                for _ in range(sets)
            ]
            w = torch.randn(Dh, device=dev, dtype=BF16)
            pos = torch.arange(m, device=dev)
            return Timed(
                run=lambda i: qk_norm_rope(*qk[i], w, w, pos, inv_freq, 1e-6, cfg.one_plus_norm),
                n_sets=sets,
                bytes=4 * m * (H + Hkv) * Dh,
                flops=0,
            )

        yield KernelCase("qk_norm_rope", model, f"H={H}+{Hkv} Dh={Dh} rot={cfg.rotary_dim}", m, norm_rope)


@register
def gdn_cases(model: str, cfg: ModelConfig, ms: Sequence[int]) -> Iterator[KernelCase]:
    if not cfg.has_linear_attention:
        return
    Hk, Hv, Dk, Dv = _gdn_shapes(cfg)
    for m in ms:
        if m <= DECODE_MAX_BATCH:
            for dt in (torch.float32, BF16):
                yield KernelCase(
                    f"gdn_decode_{str(dt)[6:]}_state",
                    model,
                    f"Hk={Hk} Hv={Hv} D={Dk}",
                    m,
                    lambda dev, m=m, dt=dt: _gdn_decode(cfg, m, dt, dev),
                    Target("bandwidth", 0.70) if m >= 32 else None,
                )
            yield KernelCase(
                "conv1d_update",
                model,
                f"C={2 * Hk * Dk + Hv * Dv} K=4",
                m,
                lambda dev, m=m: _conv(cfg, m, True, dev),
            )
        if m >= PREFILL_MIN_TOKENS:
            for chunked in (True, False):
                yield KernelCase(
                    "gdn_prefill_chunk" if chunked else "gdn_prefill_recurrent",
                    model,
                    f"Hk={Hk} Hv={Hv} D={Dk} seqs of 1024",
                    m,
                    lambda dev, m=m, c=chunked: _gdn_prefill(cfg, m, c, dev),
                )
            yield KernelCase(
                "conv1d",
                model,
                f"C={2 * Hk * Dk + Hv * Dv} K=4",
                m,
                lambda dev, m=m: _conv(cfg, m, False, dev),
            )
        yield KernelCase(
            "gated_rmsnorm", model, f"{Hv} heads x {Dv}", m, lambda dev, m=m: _norm(m * Hv, Dv, True, dev)
        )


def _norm(m: int, width: int, gated: bool, dev: torch.device) -> Timed:
    """gated_rmsnorm (x, z in; y out) or add_rmsnorm with a residual (x, r in; y, r out)."""
    w = torch.randn(width, device=dev, dtype=BF16)
    if gated:
        return _rows(m, width, 2, lambda x, z: gated_rmsnorm(x, z, w, 1e-6), 2 * m * width, dev)
    return _rows(m, width, 2, lambda x, r: add_rmsnorm(x, r, w, 1e-6, True), 2 * 2 * m * width, dev)


def _embedding(m: int, cfg: ModelConfig, dev: torch.device) -> Timed:
    """m token ids gathered from the real [V, D] bf16 table (0.5-1 GB, so rows come from HBM)."""
    V, D = cfg.vocab_size, cfg.hidden_size
    table = torch.randn(V, D, device=dev, dtype=BF16)
    sets = rotating_sets(4 * m * D)
    ids = [torch.randint(0, V, (m,), device=dev) for _ in range(sets)]
    return Timed(
        run=lambda i: embedding(ids[i], table),
        n_sets=sets,
        bytes=4 * m * D + 8 * m,
        flops=0,
        baselines={"torch": lambda i: F.embedding(ids[i], table)},
    )


@register
def small_op_cases(model: str, cfg: ModelConfig, ms: Sequence[int]) -> Iterator[KernelCase]:
    D = cfg.hidden_size
    I = cfg.shared_expert_intermediate_size or cfg.moe_intermediate_size
    for m in ms:
        yield KernelCase(
            "embedding", model, f"V={cfg.vocab_size} D={D}", m, lambda dev, m=m: _embedding(m, cfg, dev)
        )
        yield KernelCase("add_rmsnorm", model, f"D={D}", m, lambda dev, m=m: _norm(m, D, False, dev))
        yield KernelCase(
            "silu_mul", model, f"I={I}", m, lambda dev, m=m: _rows(m, 2 * I, 1, silu_mul, 2 * m * I, dev)
        )
        if m <= DECODE_MAX_BATCH:
            for filtered in (False, True):
                name = "sample_topk_topp" if filtered else "sample_greedy"
                yield KernelCase(
                    name,
                    model,
                    f"V={cfg.vocab_size}",
                    m,
                    lambda dev, m=m, f=filtered: _sample(cfg, m, f, dev),
                )
