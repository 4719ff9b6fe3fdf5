"""The GPU engine (`engine.kernel_model`, `engine.fast`, `engine.gpu`): exactness against the fp32 reference,
the slot scheduler, stop handling, out-of-memory splitting and the job path.

On the CPU the Triton kernels run under the interpreter (conftest sets it), at tiny shapes and short
prompts; on a GPU machine the same tests run on the GPU, and the `gpu` tests add CUDA graphs, real widths
and the whole demo job.
"""

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from batchinfer.kernels import moe
from batchinfer.kernels.moe import MoEGroupedMMConfig
from batchinfer.kernels.moe_grouped_mm import dequantize_experts
from click.testing import CliRunner
from kernel_checks import rel_err

from batchinfer.bench.exactness import engine_exactness
from batchinfer.checkpoint.loader import load_checkpoint
from batchinfer.checkpoint.presets import build_checkpoint
from batchinfer.cli import cli
from batchinfer.engine import fast
from batchinfer.engine.api import SamplingParams
from batchinfer.engine.fast import FastGenerator, padded_prompt, prefill_bucket
from batchinfer.engine.kernel_model import AttentionWeights, DeltaNetWeights, KernelModel, pack_prompts
from batchinfer.engine.loader import load_engine
from batchinfer.errors import ConfigError
from batchinfer.models.generate import generate, teacher_forcing_logits
from batchinfer.models.qwen_moe import QwenMoeModel

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "models" / "demo-qwen3.5-moe"
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _models(preset: str, quant: str, device: str = DEVICE):
    raw, tensors = build_checkpoint(preset, quant=quant, device=device)
    cfg, w = load_checkpoint(tensors, config=raw, device=device, dtype=torch.bfloat16)
    return cfg, QwenMoeModel(cfg, w, dtype=torch.float32), KernelModel(cfg, w)


def _random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("preset,quant", [("tiny-qwen3.5-moe", "mixed"), ("tiny-qwen3-moe", "nvfp4")])
def test_teacher_forced_logits_match_the_fp32_reference(preset, quant):
    """Both paths (packed prefill, token-by-token decode) against the fp32 reference; the 70-token
    sequence takes the chunked DeltaNet prefill, the 24-token one the recurrent one. The issue's limits
    on rel. L2 and prefill top-1 (94 positions); decode top-1 over only 8 positions is a coin toss on a
    random tiny model's near-ties, so there its rel. L2 stands in (the GPU test checks all at real widths)."""
    cfg, ref, km = _models(preset, quant)
    bf16 = QwenMoeModel(cfg, dict(ref.weights), dtype=torch.bfloat16)
    seqs = _random_prompts(cfg.vocab_size, [24, 70])
    prefills = []  # the packed prefill's logits, kept to recount the prefill path at the decode positions
    prefill = km.prefill_prompts
    km.prefill_prompts = lambda *a, **k: prefills.append(prefill(*a, **k)) or prefills[-1]
    result = engine_exactness(km, ref, seqs, decode_tail=4, bf16_reference=bf16)
    assert max(result.prefill_rel_l2, result.decode_rel_l2) <= 2e-2 and result.prefill_top1 >= 0.95, result
    pairs = zip(prefills[0].split([24, 70]), teacher_forcing_logits(ref, seqs), strict=True)
    agree = sum(int((x[-4:].float().argmax(-1).cpu() == r[-4:].argmax(-1).cpu()).sum()) for x, r in pairs)
    assert result.prefill_top1_at_decode == pytest.approx(agree / 8), result
    # No worse than the plain bf16 PyTorch forward by more than half again.
    assert result.prefill_rel_l2 <= 1.5 * result.bf16_reference_rel_l2 + 2e-3, result


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_deltanet_state_halves_its_bytes_and_stays_accurate(dtype):
    """The `deltanet_state=bfloat16|float16` options: the recurrent pools in 16 bits (half the bytes of a
    slot's DeltaNet state) and the teacher-forced logits still within the issue's limits."""
    cfg, ref, km = _models("tiny-qwen3.5-moe", "mixed")
    km16 = KernelModel(cfg, dict(ref.weights), deltanet_state=dtype)
    state = km16.new_state(2, 8)
    assert {t.dtype for t in state.recurrent if t is not None} == {dtype}
    rec = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    deltanet_layers = sum(kind != "full_attention" for kind in cfg.layer_types)
    assert km.slot_bytes(8) - km16.slot_bytes(8) == 2 * rec * deltanet_layers
    # one 70-token sequence: the chunked DeltaNet prefill, then the decode path
    result = engine_exactness(km16, ref, _random_prompts(cfg.vocab_size, [70]), decode_tail=4)
    assert max(result.prefill_rel_l2, result.decode_rel_l2) <= 2e-2 and result.prefill_top1 >= 0.95, result
    with pytest.raises(ValueError, match="deltanet_state: expected one of float32, bfloat16, float16"):
        KernelModel(cfg, dict(ref.weights), deltanet_state=torch.float64)


def test_bf16_experts_keep_every_layers_decoded_copy_and_the_same_outputs(monkeypatch):
    """The `bf16_experts` option: each layer's NVFP4 experts decoded once at load time and kept, and the
    prefill, on the grouped GEMMs that read them, gives the same logits as decoding in every pass."""
    cfg, ref, km = _models("tiny-qwen3.5-moe", "mixed")
    kept = KernelModel(cfg, dict(ref.weights), bf16_experts=True)
    for plain, layer in zip(km.layers, kept.layers, strict=True):
        assert plain.moe.decoded is None and layer.moe.nvfp4
        for a, b in zip(layer.moe.decoded, dequantize_experts(plain.moe), strict=True):
            assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    monkeypatch.setattr(moe, "_moe_configs", lambda *a, **k: MoEGroupedMMConfig())  # every pass grouped
    prompts = _random_prompts(cfg.vocab_size, [24, 70])
    logits = [m.prefill_prompts(m.new_state(2, 80), prompts, [0, 1]) for m in (km, kept)]
    assert torch.equal(*logits)
    w13, w2 = kept.layers[0].moe.decoded
    kept.layers[0].moe.decoded = (w13, w2 * 0)  # the pass reads the copy, not the codes
    assert not torch.equal(kept.prefill_prompts(kept.new_state(2, 80), prompts, [0, 1]), logits[0])


@pytest.mark.parametrize("preset,quant", [("tiny-qwen3.5-moe", "mixed"), ("tiny-qwen3-moe", "nvfp4")])
def test_fp8_kv_cache_halves_its_bytes_and_stays_accurate(preset, quant):
    """The `kv_cache=fp8` option: E4M3 caches with fp32 scales per token and head (slot bytes: 1 + 4 / Dh
    of the bf16 cache's half), teacher-forced logits within the issue's limits (decode reads the FP8
    cache; so does a prompt prefilled in pieces), and generation through it end to end."""
    cfg, ref, km = _models(preset, quant)
    km8 = KernelModel(cfg, dict(ref.weights), kv_cache=torch.float8_e4m3fn)
    state = km8.new_state(2, 8)
    assert {t.dtype for t in state.k + state.v if t is not None} == {torch.float8_e4m3fn}
    attn = sum(kind == "full_attention" for kind in cfg.layer_types)
    kv = 2 * attn * cfg.num_key_value_heads * 8
    assert km.slot_bytes(8) - km8.slot_bytes(8) == kv * (cfg.head_dim - 4)
    seqs = _random_prompts(cfg.vocab_size, [24, 70])
    result = engine_exactness(km8, ref, seqs, decode_tail=4)
    assert max(result.prefill_rel_l2, result.decode_rel_l2) <= 2e-2 and result.prefill_top1 >= 0.95, result
    # a prompt in two pieces: the second attends to the first through the FP8 cache
    state = km8.new_state(1, 80)
    km8.prefill_prompts(state, [seqs[1][:40]], [0])
    pieces = km8.prefill_prompts(state, [seqs[1][40:]], [0], starts=[40]).float()
    whole = km.prefill_prompts(km.new_state(1, 80), [seqs[1]], [0]).float()
    assert rel_err(pieces, whole) < 2e-2
    prompts = _random_prompts(cfg.vocab_size, [9, 30], seed=3)
    params = [SamplingParams(max_tokens=6, ignore_eos=True)] * 2
    bf16 = [o.token_ids for o in FastGenerator(km, max_slots=2).generate(prompts, params)]
    fp8 = [o.token_ids for o in FastGenerator(km8, max_slots=2).generate(prompts, params)]
    assert [len(t) for t in fp8] == [6, 6]
    assert [t[0] for t in fp8] == [t[0] for t in bf16]  # a fresh prompt's own K/V stay bf16 in prefill
    with pytest.raises(ValueError, match="kv_cache: expected bfloat16 or float8_e4m3fn"):
        KernelModel(cfg, dict(ref.weights), kv_cache=torch.float16)


@pytest.mark.parametrize("quant", ["mixed", "nvfp4"])
def test_one_row_decode_reads_the_checkpoint_bytes(monkeypatch, quant):
    """One-row decode reads the quantized linears' checkpoint bytes (stacked like their bf16 copies) with a
    GEMV. NVIDIA's mixed layout: the projections' FP8 (DeltaNet's bf16 b|a as the tail) and lm_head's
    NVFP4. All-NVFP4: the NVFP4 projections, except DeltaNet's in_proj, whose b|a stay bf16 there (and so
    does lm_head). The logits and the slot state match the same step on the bf16 copies."""
    import copy
    import dataclasses

    from batchinfer.kernels.fp8_gemm import FP8Rows
    from batchinfer.kernels.nvfp4_gemm import NVFP4Rows

    cfg, ref, km = _models("tiny-qwen3.5-moe", quant)
    fields = {
        AttentionWeights: ("qkv_rows", "o_proj_rows"),
        DeltaNetWeights: ("in_proj_rows", "out_proj_rows"),
    }
    expect = {"fp8_gemv": 0, "nvfp4_gemv": 0}
    for layer in km.layers:
        for f in fields[type(layer.mixer)]:
            if quant == "nvfp4" and f == "in_proj_rows":
                assert getattr(layer.mixer, f) is None
                continue
            assert isinstance(getattr(layer.mixer, f), FP8Rows if quant == "mixed" else NVFP4Rows)
            expect["fp8_gemv" if quant == "mixed" else "nvfp4_gemv"] += 1
    if quant == "mixed":
        assert isinstance(km.lm_head_rows, NVFP4Rows)
        expect["nvfp4_gemv"] += 2  # lm_head: the one-prompt prefill's last token and the step
    else:
        assert km.lm_head_rows is None
    plain = copy.copy(km)
    plain.lm_head_rows = plain.lm_head_paired = None
    plain.layers = [
        dataclasses.replace(x, mixer=dataclasses.replace(x.mixer, **dict.fromkeys(fields[type(x.mixer)])))
        for x in km.layers
    ]
    from batchinfer.engine import kernel_model

    calls = {name: [] for name in expect}
    for name, got in calls.items():
        real = getattr(kernel_model, name)
        counted = lambda *a, real=real, got=got, **k: got.append(1) or real(*a, **k)  # noqa: E731
        monkeypatch.setattr(kernel_model, name, counted)
    (prompt,) = _random_prompts(cfg.vocab_size, [21])
    states, logits = [], []
    for model in (km, plain):
        state = model.new_state(2, 40)
        nxt = model.prefill_prompts(state, [prompt], [1]).argmax(-1)
        pos = torch.tensor([len(prompt)], dtype=torch.int32, device=DEVICE)
        logits.append(
            model.decode(state, nxt, pos, torch.tensor([1], dtype=torch.int32, device=DEVICE)).float()
        )
        states.append(state)
        # a GEMV a stacked weight in the one-row step (and lm_head's in the prefill); none on bf16 copies
        assert {name: len(got) for name, got in calls.items()} == expect
    assert rel_err(logits[0], logits[1]) < 1e-2 and torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))
    _assert_slot_state_matches(states[1], states[0], 1, len(prompt) + 1)
    _, _, bf16 = _models("tiny-qwen3.5-moe", "bf16")
    assert bf16.lm_head_rows is None and bf16.lm_head_paired is None
    assert all(getattr(x.mixer, f) is None for x in bf16.layers for f in fields[type(x.mixer)])


def test_lm_head_of_a_few_rows_runs_on_its_nvfp4_bytes(monkeypatch):
    """An NVFP4 lm_head (NVIDIA's mixed layout) keeps its bytes paired too, and 2-64 rows of logits (a
    prefill's last tokens, a decode batch) run on them on the tensor cores (`nvfp4_rows_tc`), one launch a
    call; the logits match cuBLAS on the bf16 copy. An all-NVFP4 checkpoint's lm_head is bf16: no copy."""
    import copy

    from batchinfer.kernels.nvfp4_rows_tc import NVFP4PairedRows

    from batchinfer.engine import kernel_model

    cfg, _, km = _models("tiny-qwen3.5-moe", "mixed")
    assert isinstance(km.lm_head_paired, NVFP4PairedRows)
    assert _models("tiny-qwen3.5-moe", "nvfp4")[2].lm_head_paired is None
    plain = copy.copy(km)
    plain.lm_head_paired = None
    calls = []
    real = kernel_model.nvfp4_rows_tc
    monkeypatch.setattr(kernel_model, "nvfp4_rows_tc", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompts = _random_prompts(cfg.vocab_size, [21, 9, 14])
    slots = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    logits = []
    for model, launches in ((km, [1, 2]), (plain, [2, 2])):  # calls after the prefill, after the step
        state = model.new_state(3, 40)
        first = model.prefill_prompts(state, prompts, [0, 1, 2])
        assert len(calls) == launches[0]
        pos = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=DEVICE)
        step = model.decode(state, first.argmax(-1), pos, slots)
        assert len(calls) == launches[1]
        logits.append(torch.cat([first.float(), step.float()]))
    assert rel_err(logits[0], logits[1]) < 1e-2 and torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))


def test_one_row_decode_fuses_its_small_steps(monkeypatch):
    """A one-row step of the mixed layout runs DeltaNet's conv update inside in_proj's GEMV and its gated
    RMSNorm inside out_proj's, writes the KV cache from the q/k norm + RoPE kernel, routes with `norm_route`
    and norms the next layer's input in the MoE call: no `causal_conv1d_update`, `gated_rmsnorm`, `store_kv`
    or router launch of its own, one `add_rmsnorm` (the embedding's). (What they compute is checked against
    the unfused kernels in their own tests and by the logits of the test above.)"""
    from batchinfer.engine import kernel_model

    cfg, _, km = _models("tiny-qwen3.5-moe", "mixed")
    names = ("gated_rmsnorm", "store_kv", "fp8_gemv", "qk_norm_rope", "add_rmsnorm", "norm_route")
    names += ("causal_conv1d_update",)
    calls: dict[str, list] = {name: [] for name in (*names, "moe_route", "moe_experts_add_rmsnorm")}
    for name, got in calls.items():
        real = getattr(kernel_model, name)
        spy = lambda *a, real=real, got=got, **k: got.append((a, k)) or real(*a, **k)  # noqa: E731
        monkeypatch.setattr(kernel_model, name, spy)
    (prompt,) = _random_prompts(cfg.vocab_size, [9])
    state = km.new_state(2, 20)
    nxt = km.prefill_prompts(state, [prompt], [1]).argmax(-1)
    for got in calls.values():
        got.clear()
    pos = torch.tensor([len(prompt)], dtype=torch.int32, device=DEVICE)
    km.decode(state, nxt, pos, torch.tensor([1], dtype=torch.int32, device=DEVICE))
    deltanet = sum(isinstance(x.mixer, DeltaNetWeights) for x in km.layers)
    attention = len(km.layers) - deltanet
    assert not calls["gated_rmsnorm"] and not calls["store_kv"] and not calls["moe_route"]
    assert len(calls["add_rmsnorm"]) == 1
    assert len(calls["norm_route"]) == len(calls["moe_experts_add_rmsnorm"]) == len(km.layers)
    assert sum("gated_norm" in k for _, k in calls["fp8_gemv"]) == deltanet
    assert not calls["causal_conv1d_update"] and sum("conv" in k for _, k in calls["fp8_gemv"]) == deltanet
    assert sum(len(a) > 8 and a[8] is not None for a, _ in calls["qk_norm_rope"]) == attention


def test_slots_refill_and_stop_rules():
    """More requests than slots (refill), exact max_tokens, a stop token, and a stop from on_step."""
    cfg, ref, km = _models("tiny-qwen3.5-moe", "bf16")
    prompts = _random_prompts(cfg.vocab_size, [5, 9, 3, 30, 12])
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (6, 4, 8, 3, 5)]
    gen = FastGenerator(km, max_slots=2)
    outs = gen.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [6, 4, 8, 3, 5]
    assert all(o.finish_reason == "length" for o in outs)
    assert gen.stats["prefill_passes"] >= 3  # two slots for five requests: refilled as rows finished
    # Greedy, alone, gives the same tokens: a row's output does not depend on its batch.
    assert (
        FastGenerator(km, max_slots=1).generate([prompts[3]], [params[3]])[0].token_ids == outs[3].token_ids
    )

    first = outs[0].token_ids
    stop_at = first[2]
    out = gen.generate([prompts[0]], [SamplingParams(max_tokens=6)], stop_token_ids={stop_at})[0]
    assert out.finish_reason == "stop" and out.token_ids == first[: first.index(stop_at) + 1]

    def stop_second_step(tokens: dict[int, int]) -> list[int]:
        stop_second_step.calls += 1
        return list(tokens) if stop_second_step.calls == 2 else []

    stop_second_step.calls = 0
    out = gen.generate(
        [prompts[1]], [SamplingParams(max_tokens=6, ignore_eos=True)], on_step=stop_second_step
    )[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == 2
    assert stop_second_step.calls == 2  # the step after the stop computed a token for it, never reported


def test_padded_rows_touch_no_state():
    """Once the short request is done, three rows run in a batch bucket of 4: the padding row reads and
    writes no KV, conv or DeltaNet state (the scratch slot, used by nothing else without CUDA graphs,
    stays zero), and each row's tokens are those it gives alone. Eager steps: a graph capture's warm-up
    runs on the scratch slot."""
    cfg, ref, km = _models("tiny-qwen3.5-moe", "bf16")
    prompts = _random_prompts(cfg.vocab_size, [5, 9, 7, 4], seed=3)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (5, 5, 5, 2)]
    gen = FastGenerator(km, max_slots=4, cuda_graphs=False)
    outs = gen.generate(prompts, params)
    assert gen.slots == 4 and fast._buckets(4) == [1, 2, 4] and 3 in gen.batch_sizes
    alone = FastGenerator(km, max_slots=1)
    assert [o.token_ids for o in outs] == [
        alone.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params, strict=True)
    ]
    pools = [
        p for p in (*gen._state.k, *gen._state.v, *gen._state.conv, *gen._state.recurrent) if p is not None
    ]
    assert pools and all(not p[gen.slots].any() for p in pools)


def test_decode_tokens_are_read_one_step_late(monkeypatch):
    """The host records a step's tokens while the next step runs. Rows that reach their limit leave the
    batch on the device with no extra step; a row stopped by a stop token computes one extra token, which
    is dropped; no row's tokens depend on the others leaving."""
    cfg, ref, km = _models("tiny-qwen3.5-moe", "bf16")
    prompts = _random_prompts(cfg.vocab_size, [5, 9, 3])
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (7, 3, 5)]
    one = FastGenerator(km, max_slots=1)
    alone = [one.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    launched, read = [], []  # steps as launched; (which step, steps launched by then) at each read
    fetch, wait = FastGenerator._fetch, fast._Step.wait

    def fetch_counted(self, *args):
        launched.append(fetch(self, *args))
        return launched[-1]

    def wait_counted(step):
        read.append((launched.index(step), len(launched)))
        return wait(step)

    monkeypatch.setattr(FastGenerator, "_fetch", fetch_counted)
    monkeypatch.setattr(fast._Step, "wait", wait_counted)
    gen = FastGenerator(km, max_slots=3)
    assert [o.token_ids for o in gen.generate(prompts, params)] == alone
    assert gen.stats["decode_steps"] == 6 and gen.batch_sizes == [3, 3, 2, 2, 1, 1]  # one token from prefill
    assert read == [(0, 2), (1, 3), (2, 4), (3, 5), (4, 6), (5, 6)]  # each step read after the next launch
    monkeypatch.undo()

    stop_at = alone[0][3]  # row 0 alone honours stop tokens
    want = alone[0][: alone[0].index(stop_at) + 1]
    gen = FastGenerator(km, max_slots=3)
    stopped = [SamplingParams(max_tokens=7)] + params[1:]
    outs = gen.generate(prompts, stopped, stop_token_ids={stop_at})
    assert outs[0].token_ids == want and outs[0].finish_reason == "stop"
    assert [o.token_ids for o in outs[1:]] == alone[1:]
    assert gen.stats["decode_steps"] == max(len(want), 5) - 1


def test_prompt_pieces_continue_the_slot_state():
    """Chunked prefill at the model level: a 90-token prompt prefilled as 70 + 20 (the first piece on the
    chunked DeltaNet kernel, the second on the token loop), beside a fresh prompt in the second pass,
    gives the logits of one whole prefill."""
    cfg, ref, km = _models("tiny-qwen3.5-moe", "mixed")
    long, short = _random_prompts(cfg.vocab_size, [90, 11])
    state = km.new_state(3, 100)
    whole = km.prefill_prompts(state, [long, short], [0, 1]).float()
    state = km.new_state(3, 100)
    km.prefill_prompts(state, [long[:70]], [2])
    pieces = km.prefill_prompts(state, [long[70:], short], [2, 0], starts=[70, 0]).float()
    assert rel_err(pieces, whole) < 1e-2
    assert torch.equal(pieces.argmax(-1), whole.argmax(-1))


def _assert_slot_state_matches(want, got, slot: int, n: int) -> None:
    """The slot's KV entries at its first n positions, conv and DeltaNet state agree (bf16 tolerance)."""
    for name in ("k", "v", "conv", "recurrent"):
        for a, b in zip(getattr(want, name), getattr(got, name), strict=True):
            if a is not None:
                mine = (slot, slice(None), slice(0, n)) if name in ("k", "v") else (slot,)
                assert rel_err(b[mine].float(), a[mine].float()) < 1e-2, (name, n)


def test_pack_prompts_lays_out_tokens_positions_and_slots():
    """`prefill`'s packed inputs: token ids in prompt order, each token's position from its prompt's start,
    its slot, cu_seqlens, slots and starts, with the dtypes `prefill` takes; an empty prompt (a graphed
    prefill's filler when the prompt fills its bucket) adds no tokens."""
    ids, pos, token_slots, cu, slots, past = pack_prompts([[5, 6, 7], [], [8, 9]], [4, 0, 2], [0, 3, 10])
    assert ids.tolist() == [5, 6, 7, 8, 9] and ids.dtype == torch.int64
    assert pos.tolist() == [0, 1, 2, 10, 11] and pos.dtype == torch.int32
    assert token_slots.tolist() == [4, 4, 4, 2, 2] and token_slots.dtype == torch.int64
    assert cu.tolist() == [0, 3, 3, 5] and cu.dtype == torch.int32
    assert slots.tolist() == [4, 0, 2] and past.tolist() == [0, 3, 10]
    assert slots.dtype == past.dtype == torch.int32
    with pytest.raises(ValueError, match="2 prompts but 2 slots and 1 starts"):
        pack_prompts([[1], [2]], [0, 1], [0])  # numpy would broadcast the one start


def test_a_padded_prompt_fills_only_its_own_slot():
    """The graphed prefill's packing: the prompt, then a filler sequence in the scratch slot up to the
    bucket. The prompt's logits, KV entries and DeltaNet state are those of the prompt prefilled alone, and
    nothing else of its slot's rows is touched."""
    assert [prefill_bucket(n) for n in (1, 64, 65, 512, 513)] == [64, 64, 128, 512, 1024]
    cfg, ref, km = _models("tiny-qwen3.5-moe", "mixed")
    (prompt,) = _random_prompts(cfg.vocab_size, [37])
    alone, padded = km.new_state(3, 80), km.new_state(3, 80)
    want = km.prefill_prompts(alone, [prompt], [1]).float()
    bucket = prefill_bucket(len(prompt))
    packed = [x.to(km.device) for x in padded_prompt(prompt, 1, 2, bucket)]  # built on the host
    got = km.prefill(padded, *packed, bucket)[:1].float()
    assert rel_err(got, want) < 1e-2 and torch.equal(got.argmax(-1), want.argmax(-1))
    _assert_slot_state_matches(alone, padded, 1, len(prompt))
    pools = lambda st: st.k + st.v + st.conv + st.recurrent  # noqa: E731
    for a, b in zip(pools(alone), pools(padded), strict=True):
        assert a is None or torch.equal(b[0], a[0])  # slot 0, which no sequence uses: still zero


def test_long_prompts_are_prefilled_in_pieces_between_decode_steps():
    """A prompt longer than a pass is prefilled over several passes while the other rows keep decoding;
    greedy outputs are those of unchunked prefill."""
    cfg, ref, km = _models("tiny-qwen3.5-moe", "mixed")
    prompts = _random_prompts(cfg.vocab_size, [6, 40, 4, 9], seed=3)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (6, 2, 5, 2)]
    expected = FastGenerator(km, max_slots=3).generate(prompts, params)
    gen = FastGenerator(km, max_slots=3, prefill_tokens=12)
    steps: list[dict[int, int]] = []
    outs = gen.generate(prompts, params, on_step=lambda t: steps.append(dict(t)))
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert gen.stats["prefill_passes"] >= 5  # 40 tokens in pieces of at most 12, after the first pass
    first_long = next(i for i, t in enumerate(steps) if 1 in t)
    assert sum(0 in t for t in steps[:first_long]) >= 3  # request 0 decoded while the long one filled


def test_nvfp4_experts_load_paired_where_the_widths_allow():
    """Experts are repacked for the tensor-core MoE when D and I are multiples of 32; an intermediate
    size of 48 (NVFP4 needs only 16) keeps the standard layout, and both run."""
    import dataclasses

    from batchinfer.checkpoint.loader import model_config_from_hf
    from batchinfer.checkpoint.presets import preset_config, random_weights

    base = model_config_from_hf(preset_config("tiny-qwen3-moe"))
    for inter, paired in ((base.moe_intermediate_size, True), (48, False)):
        cfg = dataclasses.replace(
            base, moe_intermediate_size=inter, num_hidden_layers=1, layer_types=base.layer_types[:1]
        )
        km = KernelModel(cfg, random_weights(cfg, device=DEVICE, scheme="nvfp4"))
        assert km.layers[0].moe.paired is paired
        logits = km.prefill_prompts(km.new_state(1, 16), _random_prompts(cfg.vocab_size, [9]), [0])
        assert torch.isfinite(logits).all()


def test_prefill_out_of_memory_is_split_and_retried(monkeypatch, caplog):
    cfg, ref, km = _models("tiny-qwen3.5-moe", "bf16")
    prompts = _random_prompts(cfg.vocab_size, [5, 7, 9])
    params = [SamplingParams(max_tokens=2, ignore_eos=True)] * 3
    expected = FastGenerator(km).generate(prompts, params)
    gen = FastGenerator(km)
    real = gen._prefill_pass

    def small_only(group):
        if len(group) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(group)

    monkeypatch.setattr(gen, "_prefill_pass", small_only)
    outs = gen.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert "ran out of GPU memory; retrying" in caplog.text
    # a 21-token pass failing says nothing about a budget of thousands: it stays
    assert gen.pass_tokens == gen.prefill_tokens and "now hold at most" not in caplog.text
    assert gen.stats["prefill_out_of_memory"] == 2  # the pass of three, then its half of two


def test_a_pass_that_runs_out_of_memory_lowers_the_budget_of_later_passes(monkeypatch, caplog):
    """Four slots, eight 6-token prompts, a 24-token budget where more than 12 tokens a pass fail: the first
    pass (four prompts, the whole budget) fails once and is split; every later pass is planned within 12
    tokens, so no other pass fails, and the outputs are those of a generator that never ran out."""
    cfg, ref, km = _models("tiny-qwen3.5-moe", "bf16")
    prompts = _random_prompts(cfg.vocab_size, [6] * 8, seed=5)
    params = [SamplingParams(max_tokens=3, ignore_eos=True)] * 8
    expected = FastGenerator(km, max_slots=4).generate(prompts, params)
    gen = FastGenerator(km, max_slots=4, prefill_tokens=24)
    real, passes = gen._prefill_pass, []

    def at_most_12(pieces):
        passes.append(sum(n for _, n in pieces))
        if passes[-1] > 12:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(pieces)

    monkeypatch.setattr(gen, "_prefill_pass", at_most_12)
    outs = gen.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert passes[0] == 24 and all(n <= 12 for n in passes[1:]) and len(passes) > 3
    assert (gen.prefill_tokens, gen.pass_tokens, gen.stats["prefill_out_of_memory"]) == (24, 12, 1)
    assert "prefill passes now hold at most 12 tokens (was 24)" in caplog.text


def test_chunked_prefill_out_of_memory_restores_the_state(monkeypatch, caplog):
    """A pass with a later piece of a chunked prompt that fails after touching the DeltaNet state (as a
    real out-of-memory part-way through the layers would; here it leaves NaN) is retried from the state
    the earlier pieces left."""
    cfg, ref, km = _models("tiny-qwen3.5-moe", "bf16")
    prompts = _random_prompts(cfg.vocab_size, [20, 3], seed=4)  # passes: 12; 8 + 3 (fails); 8; 3
    params = [SamplingParams(max_tokens=2, ignore_eos=True)] * 2
    expected = FastGenerator(km).generate(prompts, params)
    gen = FastGenerator(km, prefill_tokens=12)
    real = gen._prefill_pass

    def fail_part_way(pieces):
        if len(pieces) == 1:
            return real(pieces)
        rows = [s.slot for s, _ in pieces]
        for pool in gen._state.conv + gen._state.recurrent:
            if pool is not None:
                pool[rows] = float("nan")
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(gen, "_prefill_pass", fail_part_way)
    outs = gen.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert "ran out of GPU memory; retrying" in caplog.text


def test_prepare_sizes_the_pools_once_for_a_whole_workload(monkeypatch):
    """`prepare` (the benchmark's untimed warm-up) allocates for the whole workload; later calls with
    smaller needs keep the same pools (no reallocation, no graph recapture inside a timed run)."""
    cfg, ref, km = _models("tiny-qwen3-moe", "bf16")
    gen = FastGenerator(km)
    gen.prepare(3, 40)
    state = gen._state
    assert state is not None and gen.slots == 3 and state.max_len == 40
    out = gen.generate(_random_prompts(cfg.vocab_size, [5, 7]), [SamplingParams(max_tokens=2)] * 2)
    assert [len(o.token_ids) for o in out] == [2, 2] and gen._state is state

    # More requests than fit (free memory, here: 60 slots, 100 below 26 tokens): capped pools are kept
    # while a new plan, their memory counted as free, would give no more slots; sequences short enough
    # to fit more get a new plan.
    monkeypatch.setattr(
        gen, "_plan_slots", lambda n, max_len, held=0: min(n, gen.max_slots, 60 if max_len > 25 else 100)
    )
    gen.prepare(100, 40)
    state = gen._state
    assert gen.slots == 60 and state is not None
    gen.prepare(100, 40)
    gen.prepare(80, 30)
    assert gen._state is state
    gen.prepare(100, 20)
    assert gen._state is not state and gen.slots == 100
    gen.release()
    assert gen.slots == 100  # the record of the last plan outlives the pools


def test_bench_record_keeps_the_slots_the_run_planned():
    """`bench run` describes the engine after the run, when its pools are freed again."""
    from batchinfer.bench.e2e import FastTokenEngine

    cfg, ref, km = _models("tiny-qwen3-moe", "bf16")
    engine = FastTokenEngine(FastGenerator(km, max_slots=2))
    prompts = _random_prompts(cfg.vocab_size, [5, 7, 4])
    engine.generate_ids(prompts, [SamplingParams(max_tokens=2, ignore_eos=True)] * 3, lambda tokens: None)
    assert engine.generator._state is None and engine.describe()["slots"] == "2"


def test_bad_prompts_are_refused_with_their_index():
    cfg, ref, km = _models("tiny-qwen3-moe", "bf16")
    gen = FastGenerator(km)
    with pytest.raises(ValueError, match="sequence 1 has token ids outside"):
        gen.generate([[5, 6], [5, cfg.vocab_size]], [SamplingParams(max_tokens=2)] * 2)
    with pytest.raises(ValueError, match="sequence 0 is empty"):
        gen.generate([[]], [SamplingParams(max_tokens=2)])


def _demo_job(tmp_path: Path, engine: str, rows: int, max_tokens: int) -> dict[int, str]:
    """`batchinfer run` of the demo model over the first `rows` held-out prompts in 2 shards: shard 0
    first, then a rerun that resumes with shard 1 (the job path a user runs). Texts by id."""
    out = tmp_path / engine
    args = ["run", "--input", str(tmp_path / "in.parquet"), "--model", str(DEMO), "--output", str(out),
            "--max-tokens", str(max_tokens), "--shards", "2", "--engine-arg", f"engine={engine}",
            "--engine-arg", f"device={DEVICE}", "--progress", "none"]  # fmt: skip
    if engine == "reference":
        args += ["--engine-arg", "dtype=float32"]  # the fp32 yardstick, also on a GPU
    for extra in (["--shard", "0"], []):
        result = CliRunner().invoke(cli, args + extra, catch_exceptions=False)
        assert result.exit_code == 0, result.output
    done = [pq.read_table(p).to_pylist() for p in sorted((out / "shards").rglob("*.parquet"))]
    texts = {r["id"]: r["text"] for part in done for r in part}
    assert len(texts) == rows
    return texts


def _demo_inputs(tmp_path: Path, rows: int) -> dict[int, str]:
    table = pq.read_table(ROOT / "examples" / "demo-prompts.parquet").slice(0, rows)
    pq.write_table(table, tmp_path / "in.parquet")
    return dict(zip(table["id"].to_pylist(), table["answer"].to_pylist(), strict=True))


def test_demo_model_through_the_job_path(tmp_path):
    """The trained demo model, `batchinfer run --engine-arg engine=fast` vs `engine=reference` (fp32): shards,
    resume, Parquet, and the same answers (its logits are decisive, so bf16 rounding does not flip them)."""
    answers = _demo_inputs(tmp_path, 4)
    fast, reference = (_demo_job(tmp_path, engine, 4, 16) for engine in ("fast", "reference"))
    assert fast == reference
    assert sum(fast[i].strip() == a for i, a in answers.items()) >= 3


@GPU
@pytest.mark.gpu
def test_demo_job_on_the_gpu_matches_the_reference_engine(tmp_path):
    """Issue 6's acceptance: the whole held-out demo set through `batchinfer run` on the GPU engine (CUDA
    graphs, bf16) and through the fp32 reference engine: the same texts (>= 99% of rows) and task
    accuracy within 1 point."""
    answers = _demo_inputs(tmp_path, 2000)
    fast, reference = (_demo_job(tmp_path, engine, 2000, 32) for engine in ("fast", "reference"))
    same = sum(fast[i] == reference[i] for i in answers) / len(answers)
    acc = {name: sum(t[i].strip() == a.strip() for i, a in answers.items()) / len(answers)
           for name, t in (("fast", fast), ("reference", reference))}  # fmt: skip
    assert same >= 0.99 and abs(acc["fast"] - acc["reference"]) <= 0.01, (same, acc)


def test_deltanet_state_engine_argument_is_checked():
    with pytest.raises(ConfigError, match="deltanet_state='fp16': expected one of float32, bfloat16, float1"):
        load_engine(DEMO, device="cpu", engine="fast", deltanet_state="fp16")
    with pytest.raises(ConfigError, match="deltanet_state=float16 applies to the fast engine"):
        load_engine(DEMO, device="cpu", engine="reference", deltanet_state="float16")


def test_bf16_experts_engine_argument_is_checked():
    with pytest.raises(ConfigError, match="bf16_experts='maybe': expected true or false"):
        load_engine(DEMO, device="cpu", engine="fast", bf16_experts="maybe")
    with pytest.raises(ConfigError, match="bf16_experts=true applies to the fast engine"):
        load_engine(DEMO, device="cpu", engine="reference", bf16_experts="true")
    engine = load_engine(
        DEMO.with_name(DEMO.name + "-nvfp4"), device="cpu", engine="fast", bf16_experts="true"
    )
    assert all(layer.moe.decoded is not None for layer in engine.generator.model.layers)


def test_kv_cache_engine_argument_is_checked():
    with pytest.raises(ConfigError, match="kv_cache='int8': expected one of bfloat16, fp8"):
        load_engine(DEMO, device="cpu", engine="fast", kv_cache="int8")
    with pytest.raises(ConfigError, match="kv_cache=fp8 applies to the fast engine"):
        load_engine(DEMO, device="cpu", engine="reference", kv_cache="fp8")
    engine = load_engine(DEMO, device="cpu", engine="fast", kv_cache="fp8", deltanet_state="bfloat16")
    assert engine.describe()["quantization"].endswith(", KV cache fp8, DeltaNet state bfloat16")
    assert engine.generator.model.kv_cache == torch.float8_e4m3fn


def test_schedule_engine_arguments_are_checked_and_reach_the_generator():
    for arg, match in (
        (dict(prefill_tokens="0"), "prefill_tokens=0 must be >= 1"),
        (dict(prefill_tokens="many"), "prefill_tokens='many' is not an integer"),
        (dict(refill_fraction="1.5"), r"refill_fraction=1.5 must be in \(0, 1\]"),
        (dict(refill_fraction="half"), "refill_fraction='half' is not a number"),
        (dict(prefill_graph_tokens="-1"), "prefill_graph_tokens=-1 must be >= 0"),
    ):
        with pytest.raises(ConfigError, match=match):
            load_engine(DEMO, device="cpu", engine="fast", **arg)
    with pytest.raises(ConfigError, match="apply to the fast engine"):
        load_engine(DEMO, device="cpu", engine="reference", refill_fraction="0.5")
    with pytest.raises(ConfigError, match="apply to the fast engine"):
        load_engine(DEMO, device="cpu", engine="reference", prefill_graph_tokens="512")
    engine = load_engine(
        DEMO,
        device="cpu",
        engine="fast",
        prefill_tokens="4096",
        refill_fraction="0.5",
        prefill_graph_tokens="512",
    )
    g = engine.generator
    assert (g.prefill_tokens, g.refill_fraction, g.prefill_graph_tokens) == (4096, 0.5, 512)


def test_refill_fraction_sets_how_often_prompts_are_prefilled():
    """Waiting for every slot to free up (fraction 1) batches prompts into fewer, larger prefill passes
    than refilling at the first free slot (a quarter of 4 slots); greedy outputs are the same."""
    cfg, ref, km = _models("tiny-qwen3.5-moe", "bf16")
    prompts = _random_prompts(cfg.vocab_size, [5, 7, 9, 6, 8, 5, 7, 6], seed=4)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (2, 6, 3, 8, 2, 5, 4, 3)]
    runs = {}
    for fraction in (0.25, 1.0):
        gen = FastGenerator(km, max_slots=4, refill_fraction=fraction)
        runs[fraction] = ([o.token_ids for o in gen.generate(prompts, params)], gen.stats["prefill_passes"])
    assert runs[0.25][0] == runs[1.0][0]
    assert runs[1.0][1] < runs[0.25][1], runs
    with pytest.raises(ValueError, match="refill_fraction=0"):
        FastGenerator(km, refill_fraction=0)


def test_fast_engine_refuses_a_cpu_without_the_interpreter(monkeypatch):
    with pytest.raises(ConfigError, match="the fast engine computes in bfloat16"):
        load_engine(DEMO, device="cpu", engine="fast", dtype="float32")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="engine=fast runs Triton kernels and needs a CUDA device"):
        load_engine(DEMO, device="cpu", engine="fast")


@pytest.mark.gpu
@GPU
def test_cuda_graphs_match_eager_decode():
    cfg, ref, km = _models("tiny-qwen3.5-moe", "mixed", "cuda")
    prompts = _random_prompts(cfg.vocab_size, [5, 90, 17, 33, 64])
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (20, 7, 33, 12, 25)]
    graphed = FastGenerator(km, max_slots=3, cuda_graphs=True)
    eager = FastGenerator(km, max_slots=3, cuda_graphs=False)
    assert [o.token_ids for o in graphed.generate(prompts, params)] == [
        o.token_ids for o in eager.generate(prompts, params)
    ]
    assert graphed.stats["graph_captures"] >= 2


@pytest.mark.gpu
@GPU
def test_programmatic_dependent_launch_changes_no_token(monkeypatch):
    """The decode kernels under programmatic dependent launch (`kernels/pdl.py`), graphed and replayed many
    times, give the tokens of the same kernels launched in plain stream order: a kernel reading its input
    before the kernel that writes it has finished would show as a changed token, now and then."""
    from batchinfer.kernels import pdl

    cfg, ref, km = _models("tiny-qwen3.5-moe", "mixed", "cuda")
    assert pdl.launch(torch.device("cuda"))["launch_pdl"] == (torch.cuda.get_device_capability()[0] >= 9)
    prompts = _random_prompts(cfg.vocab_size, [5, 90, 17, 33, 64, 9, 41, 70], seed=7)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (60, 40, 80, 50, 70, 64, 30, 45)]
    with_pdl = [o.token_ids for o in FastGenerator(km, max_slots=4).generate(prompts, params)]
    monkeypatch.setattr(pdl, "launch", lambda device: {"PDL": False, "launch_pdl": False})
    plain = [o.token_ids for o in FastGenerator(km, max_slots=4).generate(prompts, params)]
    assert with_pdl == plain


@pytest.mark.gpu
@GPU
def test_graphed_prefill_matches_eager_prefill():
    """A lone prompt prefilled by the graph of its length bucket (recurrent DeltaNet at 64, chunked above;
    a filler of 0 to 63 tokens) gives the eager prefill's logits and leaves the same state in its slot;
    `prepare` captures each bucket once, and generation runs through the graphs."""
    cfg, ref, km = _models("tiny-qwen3.5-moe", "mixed", "cuda")
    gen = FastGenerator(km, max_slots=1, prefill_graph_tokens=128)
    gen.prepare(1, 140)
    assert set(gen._prefill_graphs) == {64, 128}
    captures = gen.stats["graph_captures"]
    for prompt in _random_prompts(cfg.vocab_size, [5, 90, 64, 128, 33]):
        eager = km.new_state(2, 140)
        want = km.prefill_prompts(eager, [prompt], [0]).float()
        got = gen._prefill_graphed(prompt, 0, prefill_bucket(len(prompt))).float()
        assert rel_err(got, want) < 1e-2 and torch.equal(got.argmax(-1), want.argmax(-1)), len(prompt)
        _assert_slot_state_matches(eager, gen._state, 0, len(prompt))
    assert gen.stats["graph_captures"] == captures
    params = [SamplingParams(max_tokens=4, ignore_eos=True)] * 2
    outputs = gen.generate(_random_prompts(cfg.vocab_size, [20, 100], seed=1), params)
    assert [len(o.token_ids) for o in outputs] == [4, 4] and gen.stats["graph_captures"] == captures


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("preset,quant", [("qwen3.6-35b-a3b", "mixed"), ("qwen3-30b-a3b", "nvfp4")])
def test_real_widths_exactness_on_gpu(preset, quant):
    """Real widths (experts, heads, head dims), first 4 layers, both paths at the issue's limits, over
    8 sequences (2,296 prefill and 256 decode positions, as many as `bench run` checks)."""
    import dataclasses

    from batchinfer.checkpoint.loader import model_config_from_hf
    from batchinfer.checkpoint.presets import preset_config, random_weights

    cfg = model_config_from_hf(preset_config(preset))
    cfg = dataclasses.replace(cfg, num_hidden_layers=4, layer_types=cfg.layer_types[:4])
    w = random_weights(cfg, device="cuda", scheme=quant)
    ref = QwenMoeModel(cfg, w, dtype=torch.float32)
    seqs = _random_prompts(cfg.vocab_size, [288, 300, 260, 290, 256, 310, 280, 312])
    result = engine_exactness(KernelModel(cfg, w), ref, seqs)
    assert result.passed, result
    result = engine_exactness(KernelModel(cfg, w, kv_cache=torch.float8_e4m3fn), ref, seqs)
    assert result.passed, ("kv_cache=fp8", result)


@pytest.mark.gpu
@GPU
def test_real_widths_chunked_prefill_on_gpu():
    """Qwen3.6 widths (gated attention with head_dim 256, DeltaNet, first 4 layers): a 3,000-token prompt
    prefilled in pieces of 1,024 (chunked DeltaNet kernel, cached attention) gives the logits of one
    whole prefill, beside a fresh 700-token prompt in the last pass."""
    import dataclasses

    from batchinfer.checkpoint.loader import model_config_from_hf
    from batchinfer.checkpoint.presets import preset_config, random_weights

    cfg = model_config_from_hf(preset_config("qwen3.6-35b-a3b"))
    cfg = dataclasses.replace(cfg, num_hidden_layers=4, layer_types=cfg.layer_types[:4])
    km = KernelModel(cfg, random_weights(cfg, device="cuda", scheme="mixed"))
    long, short = _random_prompts(cfg.vocab_size, [3000, 700])
    state = km.new_state(2, 3100)
    whole = km.prefill_prompts(state, [long, short], [0, 1]).float()
    state = km.new_state(2, 3100)
    for start in (0, 1024):
        km.prefill_prompts(state, [long[start : start + 1024]], [0], starts=[start])
    pieces = km.prefill_prompts(state, [long[2048:], short], [0, 1], starts=[2048, 0]).float()
    assert rel_err(pieces, whole) < 1e-2


def test_generate_contract_matches_the_reference_generate():
    """Same finish reasons and lengths as `models.generate.generate` on the same requests."""
    cfg, ref, km = _models("tiny-qwen3-moe", "bf16")
    prompts = _random_prompts(cfg.vocab_size, [4, 6])
    params = [SamplingParams(max_tokens=3, ignore_eos=True), SamplingParams(max_tokens=5, ignore_eos=True)]
    ours = FastGenerator(km).generate(prompts, params)
    theirs = generate(ref, prompts, params)
    assert [(len(o.token_ids), o.finish_reason) for o in ours] == [
        (len(o.token_ids), o.finish_reason) for o in theirs
    ]
