"""Chunked gated delta rule against the token-loop reference, in bf16 (the interpreter takes the kernels'
fp32-dot path)."""

import pytest
import torch
from batchinfer.kernels import gdn_chunk
from batchinfer.kernels.gdn import gated_delta_rule, gated_delta_rule_ref
from batchinfer.kernels.gdn_chunk import chunk_gated_delta_rule
from kernel_checks import DEV, rel_err
from test_kernels_gdn import poison_empty

DT = torch.bfloat16


def _inputs(T, Hk, Hv, D, slow_decay=False):
    mixed = torch.randn(T, 2 * Hk * D + Hv * D).to(DT).to(DEV)
    q = mixed[:, : Hk * D].view(T, Hk, D)
    k = mixed[:, Hk * D : 2 * Hk * D].view(T, Hk, D)
    v = mixed[:, 2 * Hk * D :].view(T, Hv, D)
    ab = torch.randn(T, 2 * Hv).to(DT).to(DEV)
    A_log = (torch.rand(Hv) * 2 - 1).to(DEV)
    dt_bias = (torch.full((Hv,), -6.0) if slow_decay else torch.randn(Hv)).to(DEV)  # -6: decay ~0.998
    return q, k, v, ab[:, :Hv], ab[:, Hv:], A_log, dt_bias


@pytest.mark.parametrize(
    "lens,Hk,Hv,D,slow",
    [
        ([5, 40, 16], 2, 4, 32, False),
        ([37], 1, 2, 16, True),
        ([5, 40, 16], 2, 4, 48, True),  # 48: demo heads
        ([3, 21], 1, 2, 128, True),  # 128: Qwen3.5's heads
    ],
)
def test_chunk_matches_token_loop(monkeypatch, lens, Hk, Hv, D, slow):
    """Chunk boundaries (16 here), ragged tails and a single-token sequence; long memory when slow."""
    poison_empty(monkeypatch)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    q, k, v, a, b, A_log, dt_bias = _inputs(int(cu[-1]), Hk, Hv, D, slow)
    state = torch.full((len(lens) + 1, Hv, D, D), float("nan"), device=DEV)
    slots = torch.arange(len(lens), 0, -1, device=DEV)
    out = chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, slots, cu, max(lens))
    ref, ref_final = gated_delta_rule_ref(q, k, v, a, b, A_log, dt_bias, cu)
    assert rel_err(out, ref) < 1e-2
    assert rel_err(state[slots], ref_final) < 1e-2
    assert torch.isnan(state[0]).all()


def test_chunk_agrees_with_recurrent_kernel():
    cu = torch.tensor([0, 33], dtype=torch.int32, device=DEV)
    q, k, v, a, b, A_log, dt_bias = _inputs(33, 1, 1, 16)
    s1, s2 = torch.empty(1, 1, 16, 16, device=DEV), torch.empty(1, 1, 16, 16, device=DEV)
    slot = torch.zeros(1, dtype=torch.long, device=DEV)
    o1 = chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, s1, slot, cu, 33)
    o2 = gated_delta_rule(q, k, v, a, b, A_log, dt_bias, s2, slot, cu_seqlens=cu)
    assert rel_err(o1, o2) < 1e-2 and rel_err(s1, s2) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("Hk,Hv,D", [(16, 32, 128), (2, 4, 48)])  # Qwen3.5, the demo model (padded heads)
def test_real_shapes_gpu(monkeypatch, Hk, Hv, D):
    poison_empty(monkeypatch)
    lens = [1000, 1, 300, 64]
    cu = torch.tensor([0, 1000, 1001, 1301, 1365], dtype=torch.int32, device=DEV)
    q, k, v, a, b, A_log, dt_bias = _inputs(1365, Hk, Hv, D, slow_decay=True)
    state = torch.full((len(lens), Hv, D, D), float("nan"), device=DEV)
    slots = torch.arange(len(lens), device=DEV)
    out = chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, slots, cu, max(lens))
    ref, ref_final = gated_delta_rule_ref(q, k, v, a, b, A_log, dt_bias, cu)
    assert rel_err(out, ref) < 1e-2 and rel_err(state, ref_final) < 1e-2


@pytest.mark.parametrize(
    "D,change",
    [(32, {}), (48, {}), (48, {"BLOCK_V": 32}), (32, {"BT": 32})],  # 48 in 64-wide k; v tiles cross 48
)
def test_production_chunk(monkeypatch, D, change):
    """The H200 chunk (64 tokens: four 16-row blocks in the inverse launch; the tuner's 32, two) and v-tile
    on sequences that end mid-chunk."""
    monkeypatch.setattr(gdn_chunk, "_interpreted", lambda: False)
    poison_empty(monkeypatch)
    assert gdn_chunk._chunk_configs()["BT"] == 64
    cfg = gdn_chunk._chunk_configs() | change
    cu = torch.tensor([0, 150, 213], dtype=torch.int32, device=DEV)
    q, k, v, a, b, A_log, dt_bias = _inputs(213, 1, 2, D, slow_decay=True)
    state = torch.empty(2, 2, D, D, device=DEV)
    slots = torch.arange(2, device=DEV)
    out = chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, slots, cu, 150, config=cfg)
    ref, ref_final = gated_delta_rule_ref(q, k, v, a, b, A_log, dt_bias, cu)
    assert rel_err(out, ref) < 1e-2 and rel_err(state, ref_final) < 1e-2


@pytest.mark.gpu
def test_fla_core_computes_the_same_rule_gpu():
    """The fla-core peer of the kernel benchmark (skipped without fla-core): same inputs, same outputs and
    final states as our kernel and the fp32 reference, so its timings compare like with like."""
    from batchinfer.bench.kernel_cases_attn import fla_chunk_rule, fla_prefill

    fla_rule = fla_chunk_rule()
    if fla_rule is None:
        pytest.skip("fla-core is not installed")
    lens = [1000, 1, 300, 64]
    cu = torch.tensor([0, 1000, 1001, 1301, 1365], dtype=torch.int32, device=DEV)
    q, k, v, a, b, A_log, dt_bias = _inputs(1365, 16, 32, 128, slow_decay=True)
    state = torch.empty((len(lens), 32, 128, 128), device=DEV)
    ours = chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, torch.arange(4, device=DEV), cu, 1000)
    packed = [x.contiguous() for x in (q, k, v, a, b)]
    theirs, final = fla_prefill(fla_rule, *packed, A_log, dt_bias, cu)
    ref, ref_final = gated_delta_rule_ref(q, k, v, a, b, A_log, dt_bias, cu)
    assert rel_err(theirs, ref) < 1e-2 and rel_err(final, ref_final) < 1e-2
    assert rel_err(theirs, ours) < 1e-2 and rel_err(final, state) < 1e-2


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("chunked", [True, False])
def test_later_pieces_continue_from_the_slot_state(monkeypatch, chunked, state_dtype):
    """Chunked prefill: a 40-token sequence as 29 + 11 tokens (the second piece with `past` > 0 starts from
    its slot's state), beside a fresh sequence in the second pass whose stale slot state must not leak in;
    outputs and final states as the whole sequences give. Both prefill kernels (chunked and token loop),
    on the fp32 state and on the 16-bit one that round-trips between the pieces."""
    poison_empty(monkeypatch)
    D, Hv = 32, 4
    cu_full = torch.tensor([0, 40, 63], dtype=torch.int32, device=DEV)
    q, k, v, a, b, A_log, dt_bias = _inputs(63, 2, Hv, D, slow_decay=True)
    ref, ref_final = gated_delta_rule_ref(q, k, v, a, b, A_log, dt_bias, cu_full)

    def run(rows, cu, slots, past, longest):
        cu = torch.tensor(cu, dtype=torch.int32, device=DEV)
        slots = torch.tensor(slots, device=DEV)
        past = None if past is None else torch.tensor(past, dtype=torch.int32, device=DEV)
        x = [t[rows].contiguous() for t in (q, k, v, a, b)]
        if chunked:
            return chunk_gated_delta_rule(*x, A_log, dt_bias, state, slots, cu, longest, past=past)
        return gated_delta_rule(*x, A_log, dt_bias, state, slots, cu_seqlens=cu, past=past)

    state = torch.full((3, Hv, D, D), float("nan"), dtype=state_dtype, device=DEV)  # slot 2's stale state
    first = run(list(range(29)), [0, 29], [0], None, 29)
    second = run(list(range(29, 63)), [0, 11, 34], [0, 2], [29, 0], 23)
    assert rel_err(torch.cat([first, second]), ref) < 1e-2
    assert rel_err(state[[0, 2]], ref_final) < 1e-2
    assert torch.isnan(state[1]).all()
    with pytest.raises(ValueError, match="past"):
        run(list(range(29, 40)), [0, 11], [0], [29, 0], 11)
