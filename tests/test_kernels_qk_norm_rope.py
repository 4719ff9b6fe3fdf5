"""Fused q/k RMSNorm + RoPE against its fp32 reference (interpreter on CPU, real shapes on the GPU)."""

import pytest
import torch
from batchinfer.kernels.kv_cache import store_kv
from batchinfer.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_ref, rope_inv_freq
from kernel_checks import DEV, rel_err
from test_kernels_gdn import poison_empty

DT = torch.bfloat16


def rnd(*shape, scale=1.0):
    return (torch.randn(*shape) * scale).to(DT).to(DEV)


# (4, 2, 64, 16, True): the demo model (head_dim 64, partial rotary 0.25: 8 frequencies, (1 + w) norms)
@pytest.mark.parametrize("H,Hkv,Dh,rot,one_plus", [(4, 2, 64, 16, True), (4, 1, 32, 32, False)])
def test_qk_norm_rope(monkeypatch, H, Hkv, Dh, rot, one_plus):
    poison_empty(monkeypatch)
    T = 5
    qg = rnd(T, H, 2 * Dh)  # q interleaved with its gate, as Qwen3.5's q_proj emits it
    q = qg[..., :Dh]
    k = rnd(T, Hkv, Dh)
    qw, kw = rnd(Dh, scale=0.3), rnd(Dh, scale=0.3)
    pos = torch.tensor([0, 1, 7, 300, 70000], device=DEV)
    inv_freq = rope_inv_freq(rot, 1e7, DEV)
    qo, ko = qk_norm_rope(q, k, qw, kw, pos, inv_freq, 1e-6, one_plus)
    qr, kr = qk_norm_rope_ref(q, k, qw, kw, pos, inv_freq, 1e-6, one_plus)
    assert rel_err(qo, qr) < 1e-2 and rel_err(ko, kr) < 1e-2
    if rot < Dh:  # pass-through dims are only normalised
        assert rel_err(qo[..., rot:], qr[..., rot:]) < 1e-2


def test_rope_rotates_pairs_half_apart():
    """NeoX rotate-half: position p rotates (x_i, x_{i+R/2}) by p * inv_freq_i; norms are preserved."""
    Dh = 16
    q = rnd(2, 1, Dh)
    k = rnd(2, 1, Dh)
    w = torch.zeros(Dh, device=DEV)
    inv_freq = rope_inv_freq(Dh, 1e4, DEV)
    qo, _ = qk_norm_rope(q, k, w, w, torch.tensor([0, 3], device=DEV), inv_freq, 1e-6, True)
    qn = qk_norm_rope_ref(q, k, w, w, torch.tensor([0, 0], device=DEV), inv_freq, 1e-6, True)[0]
    assert rel_err(qo[0], qn[0]) < 1e-2  # position 0 is the identity rotation
    a, b = qn[1, 0, 0].item(), qn[1, 0, Dh // 2].item()
    c, s = torch.cos(torch.tensor(3.0)).item(), torch.sin(torch.tensor(3.0)).item()
    assert abs(qo[1, 0, 0].item() - (a * c - b * s)) < 2e-2
    assert abs(qo[1, 0, Dh // 2].item() - (b * c + a * s)) < 2e-2


def test_rejects_bad_weight():
    with pytest.raises(ValueError, match="k_weight: expected shape"):
        qk_norm_rope(
            rnd(2, 4, 64),
            rnd(2, 1, 64),
            rnd(64),
            rnd(32),
            torch.arange(2, device=DEV),
            rope_inv_freq(16, 1e4, DEV),
            1e-6,
            True,
        )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "H,Hkv,Dh,rot,one_plus,gated",
    [(16, 2, 256, 64, True, True), (32, 4, 128, 128, False, False)],  # Qwen3.5/3.6, Qwen3-30B
)
def test_real_shapes_gpu(monkeypatch, H, Hkv, Dh, rot, one_plus, gated):
    poison_empty(monkeypatch)
    T = 512
    qg = rnd(T, H, 2 * Dh if gated else Dh)
    q = qg[..., :Dh]
    k = rnd(T, Hkv, Dh)
    qw, kw = rnd(Dh, scale=0.3), rnd(Dh, scale=0.3)
    pos = torch.randint(0, 40000, (T,), generator=torch.Generator().manual_seed(T)).to(DEV)
    inv_freq = rope_inv_freq(rot, 1e7 if gated else 1e6, DEV)
    qo, ko = qk_norm_rope(q, k, qw, kw, pos, inv_freq, 1e-6, one_plus)
    qr, kr = qk_norm_rope_ref(q, k, qw, kw, pos, inv_freq, 1e-6, one_plus)
    assert rel_err(qo, qr) < 1e-2 and rel_err(ko, kr) < 1e-2


def _store_case(fp8: bool, T: int = 4, H: int = 4, Hkv: int = 2, Dh: int = 32):
    """Inputs of a decode step whose k and v also go into the caches (rows 1 and 3 are padding: a negative
    slot, a negative position), and caches filled with 7 so that a stray write shows."""
    q, k = rnd(T, H, Dh), rnd(T, Hkv, Dh)
    v = rnd(T, Hkv, 2 * Dh)[..., :Dh]  # a view with its own row strides, as the engine's slice of q|k|v
    dtype = torch.float8_e4m3fn if fp8 else DT
    slots, max_len = 3, 8
    kc, vc = (torch.full((slots, Hkv, max_len, Dh), 7.0, device=DEV).to(dtype) for _ in range(2))
    ks, vs = (torch.full((slots, Hkv, max_len), 7.0, device=DEV) if fp8 else None for _ in range(2))
    slot_ids = torch.tensor([2, -1, 0, 2], dtype=torch.int32, device=DEV)[:T]
    pos = torch.tensor([5, 3, 0, -1], dtype=torch.int32, device=DEV)[:T]
    return q, k, v, (kc, vc, ks, vs), slot_ids, pos


@pytest.mark.parametrize("fp8", [False, True])
def test_store_writes_the_caches_as_store_kv(fp8):
    """With `store`, q and k are as without it and the caches hold what `store_kv` of the returned k and v
    writes, padded rows writing nothing (bf16: the kernel's own store; FP8: `store_kv` on the CPU)."""
    q, k, v, caches, slot_ids, pos = _store_case(fp8)
    qw, kw = rnd(32, scale=0.3), rnd(32, scale=0.3)
    inv_freq = rope_inv_freq(16, 1e4, DEV)
    qo, ko = qk_norm_rope(q, k, qw, kw, pos, inv_freq, 1e-6, True, store=(v, *caches, slot_ids))
    q_ref, k_ref = qk_norm_rope(q, k, qw, kw, pos, inv_freq, 1e-6, True)
    assert torch.equal(qo, q_ref) and torch.equal(ko, k_ref)
    expected = _store_case(fp8)[3]
    store_kv(k_ref, v, *expected, slot_ids, pos)
    for got, want in zip(caches, expected, strict=True):
        if got is not None:
            assert torch.equal(got.float(), want.float())
    assert (caches[0].float()[2, :, 5] != 7.0).any() and (caches[0].float()[0, :, 0] != 7.0).any()


def test_store_rejects_mismatched_caches():
    q, k, v, (kc, vc, ks, vs), slot_ids, pos = _store_case(False)
    args = (q, k, rnd(32), rnd(32), pos, rope_inv_freq(16, 1e4, DEV), 1e-6, True)
    with pytest.raises(ValueError, match="one dtype, shape and layout"):
        qk_norm_rope(*args, store=(v, kc, vc[:, :, :4], ks, vs, slot_ids))
    with pytest.raises(ValueError, match=r"slots .* expected integer \[4\]"):
        qk_norm_rope(*args, store=(v, kc, vc, ks, vs, slot_ids[:2]))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("H,Hkv,Dh,rot,one_plus", [(16, 2, 256, 64, True), (32, 4, 128, 128, False)])
def test_store_real_shapes_gpu(fp8, H, Hkv, Dh, rot, one_plus):
    """The kernel's KV store on the GPU, bf16 and FP8, bit for bit `store_kv`'s (PyTorch's E4M3 bits)."""
    q, k, v, caches, slot_ids, pos = _store_case(fp8, 4, H, Hkv, Dh)
    qw, kw = rnd(Dh, scale=0.3), rnd(Dh, scale=0.3)
    inv_freq = rope_inv_freq(rot, 1e7, DEV)
    qo, ko = qk_norm_rope(q, k, qw, kw, pos, inv_freq, 1e-6, one_plus, store=(v, *caches, slot_ids))
    expected = _store_case(fp8, 4, H, Hkv, Dh)[3]
    store_kv(ko, v, *expected, slot_ids, pos)
    for got, want in zip(caches, expected, strict=True):
        if got is not None:
            assert torch.equal(
                got.view(torch.uint8) if fp8 and got.dim() == 4 else got,
                want.view(torch.uint8) if fp8 and want.dim() == 4 else want,
            )
