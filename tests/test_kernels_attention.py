"""Attention kernels against their fp32 references (tiny shapes in the interpreter, real ones on the GPU)."""

import pytest
import torch
from batchinfer.kernels import attention
from batchinfer.kernels.attention import (
    decode_attention,
    decode_attention_ref,
    prefill_attention,
    prefill_attention_cached,
    prefill_attention_ref,
)
from batchinfer.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_ref, rope_inv_freq
from kernel_checks import DEV, rel_err
from test_kernels_gdn import poison_empty

# bf16, the engine's dtype, in the interpreter too (where the kernels take their fp32-dot path).
DT = torch.bfloat16


def rnd(*shape, scale=1.0):
    return (torch.randn(*shape) * scale).to(DT).to(DEV)


@pytest.mark.parametrize(
    "H,Hkv,Dh,gated",
    [(4, 2, 64, True), (8, 2, 64, True), (4, 1, 32, False)],  # (4, 2, 64, True): demo; (8, 2): GQA group 4
)
def test_prefill_attention(monkeypatch, H, Hkv, Dh, gated):
    poison_empty(monkeypatch)
    lens = [1, 37, 16]
    cu = torch.tensor([0, 1, 38, 54], dtype=torch.int32, device=DEV)
    T = sum(lens)
    qg = rnd(T, H, 2 * Dh)
    q, gate = qg[..., :Dh], (qg[..., Dh:] if gated else None)
    k, v = rnd(T, Hkv, Dh), rnd(T, Hkv, Dh)
    out = prefill_attention(q, k, v, cu, max(lens), gate=gate)
    ref = prefill_attention_ref(q, k, v, cu, gate=gate)
    assert rel_err(out, ref) < 1e-2
    # causality: changing the last token's k/v leaves every earlier output unchanged
    k2, v2 = k.clone(), v.clone()
    k2[37], v2[37] = rnd(Hkv, Dh), rnd(Hkv, Dh)
    out2 = prefill_attention(q, k2, v2, cu, max(lens), gate=gate)
    assert torch.equal(out2[:37], out[:37]) and not torch.equal(out2[37], out[37])


@pytest.mark.parametrize("H,Hkv,Dh,gated", [(4, 2, 64, True), (4, 1, 32, False)])
def test_cached_prefill_attention_continues_sequences(monkeypatch, H, Hkv, Dh, gated):
    """Chunks of three sequences after 21, 0 and 5 cached tokens (not tile-aligned: the diagonal tile
    starts mid-chunk) attend over their slots' caches exactly as the whole sequences would."""
    poison_empty(monkeypatch)
    past, chunk = [21, 0, 5], [19, 7, 1]
    slots, max_len = [3, 0, 1], 48
    kc, vc = _cache(4, Hkv, max_len, Dh)
    full = [p + n for p, n in zip(past, chunk, strict=True)]
    fcu = torch.tensor([0, *torch.tensor(full).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    qg = rnd(sum(full), H, 2 * Dh)
    q, gate = qg[..., :Dh], (qg[..., Dh:] if gated else None)
    k, v = rnd(sum(full), Hkv, Dh), rnd(sum(full), Hkv, Dh)
    rows = []  # each sequence's chunk rows in the packed full batch
    for n, (s, p, c) in enumerate(zip(fcu.tolist()[:-1], past, chunk, strict=True)):
        kc[slots[n], :, : p + c] = k[s : s + p + c].transpose(0, 1)
        vc[slots[n], :, : p + c] = v[s : s + p + c].transpose(0, 1)
        kc[slots[n], :, p + c :] = float("nan")  # never read: past the chunk's end
        rows += range(s + p, s + p + c)
    cu = torch.tensor([0, *torch.tensor(chunk).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    ids = torch.tensor(slots, dtype=torch.int32, device=DEV)
    out = prefill_attention_cached(
        q[rows],
        kc,
        vc,
        cu,
        ids,
        torch.tensor(past, dtype=torch.int32, device=DEV),
        max(chunk),
        gate=gate[rows] if gated else None,
    )
    ref = prefill_attention_ref(q, k, v, fcu, gate=gate)[rows]
    assert out.shape == ref.shape and rel_err(out, ref) < 1e-2
    with pytest.raises(ValueError, match="past"):
        prefill_attention_cached(q[rows], kc, vc, cu, ids, torch.tensor(past, device=DEV), max(chunk))


def _cache(slots, Hkv, max_len, Dh):
    return rnd(slots, Hkv, max_len, Dh), rnd(slots, Hkv, max_len, Dh)


@pytest.mark.parametrize(
    "H,Hkv,Dh,gated,max_seqlen", [(4, 2, 64, True, None), (8, 2, 64, True, None), (8, 1, 32, False, 50)]
)
def test_decode_attention(monkeypatch, H, Hkv, Dh, gated, max_seqlen):
    poison_empty(monkeypatch)
    B, slots, max_len = 3, 5, 64
    kc, vc = _cache(slots, Hkv, max_len, Dh)
    slot_ids = torch.tensor([4, 0, 2], device=DEV)
    seq_lens = torch.tensor([50, 1, 33], dtype=torch.int32, device=DEV)
    qg = rnd(B, H, 2 * Dh)
    q, gate = qg[..., :Dh], (qg[..., Dh:] if gated else None)
    out = decode_attention(q, kc, vc, slot_ids, seq_lens, max_seqlen=max_seqlen, gate=gate)
    ref = decode_attention_ref(q, kc, vc, slot_ids, seq_lens, gate=gate)
    assert rel_err(out, ref) < 1e-2
    # tokens past seq_len are never read
    kc[4, :, 50:] = float("nan")
    vc[0, :, 1:] = float("nan")
    out = decode_attention(q, kc, vc, slot_ids, seq_lens, max_seqlen=max_seqlen, gate=gate)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("max_len", [32, 64, 160])  # several KV splits and their combine: 64 under the
# interpreter's tiles, 160 under a GPU's too
def test_decode_attention_padded_rows_are_zero(max_len):
    """A padding row of the engine's graphs (slot -1, length 0) reads no cache and returns zeros, also
    through the split combine and the output gate."""
    kc, vc = _cache(2, 1, max_len, 32)
    q, gate = rnd(2, 2, 32), rnd(2, 2, 32)
    slots, lens = (
        torch.tensor([1, -1], device=DEV),
        torch.tensor([max_len - 3, 0], dtype=torch.int32, device=DEV),
    )
    out = decode_attention(q, kc, vc, slots, lens, gate=gate)
    assert torch.equal(out[1].float().cpu(), torch.zeros(2, 32))
    ref = decode_attention_ref(q, kc, vc, torch.tensor([1, 0]), lens.cpu(), gate=gate)
    assert rel_err(out[0], ref[0]) < 1e-2


def test_decode_rejects_bad_cache():
    kc, vc = _cache(2, 1, 32, 32)
    with pytest.raises(ValueError, match="v_cache: expected shape"):
        decode_attention(
            rnd(1, 2, 32),
            kc,
            vc[:, :, :16],
            torch.zeros(1, dtype=torch.long, device=DEV),
            torch.ones(1, dtype=torch.int32, device=DEV),
        )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "H,Hkv,Dh,gated,rot,one_plus",
    [(16, 2, 256, True, 64, True), (32, 4, 128, False, 128, False), (4, 2, 64, True, 16, True)],  # + demo
)
def test_real_shapes_gpu(H, Hkv, Dh, gated, rot, one_plus):
    lens = [1000, 3096, 17]
    cu = torch.tensor([0, 1000, 4096, 4113], dtype=torch.int32, device=DEV)
    T = cu[-1].item()
    qg = rnd(T, H, 2 * Dh)
    q, gate = qg[..., :Dh], (qg[..., Dh:] if gated else None)
    k, v = rnd(T, Hkv, Dh), rnd(T, Hkv, Dh)
    pos = torch.cat([torch.arange(n, device=DEV) for n in lens])
    qw, kw = rnd(Dh, scale=0.3), rnd(Dh, scale=0.3)
    inv_freq = rope_inv_freq(rot, 1e7, DEV)
    qo, ko = qk_norm_rope(q, k, qw, kw, pos, inv_freq, 1e-6, one_plus)
    qr, kr = qk_norm_rope_ref(q, k, qw, kw, pos, inv_freq, 1e-6, one_plus)
    assert rel_err(qo, qr) < 1e-2 and rel_err(ko, kr) < 1e-2
    out = prefill_attention(qo, ko, v, cu, max(lens), gate=gate)
    assert rel_err(out, prefill_attention_ref(qo, ko, v, cu, gate=gate)) < 1e-2
    B, max_len = 64, 4096
    kc, vc = _cache(B + 3, Hkv, max_len, Dh)
    slot_ids = torch.randperm(B + 3, device=DEV)[:B]
    seq_lens = torch.randint(0, max_len + 1, (B,), dtype=torch.int32, device=DEV)
    out = decode_attention(qo[:B], kc, vc, slot_ids, seq_lens, gate=None if gate is None else gate[:B])
    ref = decode_attention_ref(qo[:B], kc, vc, slot_ids, seq_lens, gate=None if gate is None else gate[:B])
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("Dh,gated,Hkv", [(256, True, 1), (128, False, 1), (64, True, 2)])  # 64: demo model
def test_production_tiles(monkeypatch, Dh, gated, Hkv):
    """The H200 tile configs (not the small interpreter ones) on shapes that cross their tile edges."""
    monkeypatch.setattr(attention, "_interpreted", lambda: False)
    poison_empty(monkeypatch)
    prefill_cfg, decode_cfg = attention._prefill_configs(Dh), attention._decode_configs(Dh)
    H = 4
    lens = [150, 3]
    cu = torch.tensor([0, 150, 153], dtype=torch.int32, device=DEV)
    qg = rnd(153, H, 2 * Dh)
    q, gate = qg[..., :Dh], (qg[..., Dh:] if gated else None)
    k, v = rnd(153, Hkv, Dh), rnd(153, Hkv, Dh)
    out = prefill_attention(q, k, v, cu, max(lens), gate=gate, config=prefill_cfg)
    assert rel_err(out, prefill_attention_ref(q, k, v, cu, gate=gate)) < 1e-2
    kc, vc = _cache(3, Hkv, 600, Dh)
    slot_ids = torch.tensor([2, 0], device=DEV)
    seq_lens = torch.tensor([600, 257], dtype=torch.int32, device=DEV)  # split-KV, ragged last split
    out = decode_attention(
        q[:2], kc, vc, slot_ids, seq_lens, gate=None if gate is None else gate[:2], config=decode_cfg
    )
    ref = decode_attention_ref(q[:2], kc, vc, slot_ids, seq_lens, gate=None if gate is None else gate[:2])
    assert rel_err(out, ref) < 1e-2
