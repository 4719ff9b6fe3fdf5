"""The reference model against Hugging Face transformers, and against itself (cache, dtype, quantization).

Both sides load the same tiny random checkpoint: HF in memory, ours through `save_pretrained` and
`load_checkpoint`. Run with `-s` to see the measured figures.
"""

import copy

import pytest
import torch
from batchinfer.kernels.nvfp4 import quantize_fp8, quantize_nvfp4
from models_tiny import FAMILIES, VOCAB, hf_canonical, hf_model

from batchinfer.engine.api import SamplingParams
from batchinfer.errors import CheckpointError
from batchinfer.models.generate import generate, teacher_forcing_logits
from batchinfer.models.qwen_moe import QwenMoeModel

# 70 > 64 exercises more than one DeltaNet chunk; 1 is the smallest prompt.
LENGTHS = (9, 70, 33, 1)


def _sequences(lengths, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _left_padded(sequences):
    width = max(map(len, sequences))
    ids = torch.zeros(len(sequences), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, width - len(s) :] = torch.tensor(s)
        mask[i, width - len(s) :] = 1
    return ids, mask


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    hf = hf_model(request.param)
    config, weights = hf_canonical(hf)
    return request.param, hf, QwenMoeModel(config, weights)


def test_logits_match_hf(pair, record_property):
    family, hf, ours = pair
    sequences = _sequences(LENGTHS)
    ids, mask = _left_padded(sequences)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
    got = teacher_forcing_logits(ours, sequences)
    rel_err, agree, total = 0.0, 0, 0
    for i, s in enumerate(sequences):
        r = ref[i, ids.shape[1] - len(s) :]
        rel_err = max(rel_err, float((got[i] - r).abs().max() / r.abs().max()))
        agree += int((got[i].argmax(-1) == r.argmax(-1)).sum())
        total += len(s)
    print(f"\n{family}: logits max relative error {rel_err:.2e}, top-1 agreement {agree}/{total}")
    record_property(f"{family}_logits_rel_err", rel_err)
    record_property(f"{family}_top1_agreement", agree / total)
    assert rel_err <= 1e-4
    assert agree == total


def test_greedy_generation_matches_hf(pair, record_property):
    family, hf, ours = pair
    prompts = _sequences((5, 12, 9), seed=2)
    ids, mask = _left_padded(prompts)
    with torch.no_grad():
        ref = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=32,
            pad_token_id=0,
            eos_token_id=None,
        )[:, ids.shape[1] :].tolist()
    outs = generate(ours, prompts, [SamplingParams(max_tokens=32) for _ in prompts])
    same = sum(o.token_ids == r for o, r in zip(outs, ref, strict=True))
    print(f"\n{family}: greedy 32-token generations identical to HF: {same}/{len(prompts)}")
    record_property(f"{family}_greedy_identical", f"{same}/{len(prompts)}")
    assert [o.token_ids for o in outs] == ref
    assert all(o.finish_reason == "length" for o in outs)
    assert len({t for r in ref for t in r}) > 3  # the model says more than one thing


def test_prefill_then_decode_equals_one_forward(pair):
    _, _, ours = pair
    (seq,) = _sequences((80,), seed=3)
    full = teacher_forcing_logits(ours, [seq])[0]
    cache = ours.new_cache(1, len(seq))
    pieces = [ours.forward(torch.tensor([seq[:50]]), cache)[0]]  # prefill
    pieces.append(ours.forward(torch.tensor([seq[50:60]]), cache)[0])  # a second chunk continuing the cache
    for t in seq[60:]:  # decode
        pieces.append(ours.forward(torch.tensor([[t]]), cache)[0])
    stepped = torch.cat(pieces).float()
    assert int(cache.lengths[0]) == len(seq)
    rel = float((stepped - full).abs().max() / full.abs().max())
    assert rel <= 1e-5, f"cached prefill/decode differs from one forward by {rel:.2e}"
    assert torch.equal(stepped.argmax(-1), full.argmax(-1))


def test_bf16_as_accurate_as_hf_bf16(pair, record_property):
    """In bf16 our logits stray from the fp32 reference no more than HF's own bf16 run does."""
    family, hf, _ = pair
    config, weights = hf_canonical(hf, dtype=torch.bfloat16)
    low = QwenMoeModel(config, weights)
    assert low.dtype == torch.bfloat16
    hf_low = copy.deepcopy(hf).to(torch.bfloat16)
    sequences = _sequences((40,) * 4, seed=4)
    ids = torch.tensor(sequences)
    with torch.no_grad():
        exact = hf(input_ids=ids).logits
        hf_err = (hf_low(input_ids=ids).logits.float() - exact).abs().mean()
    ours = torch.stack(teacher_forcing_logits(low, sequences))
    our_err = (ours - exact).abs().mean()
    print(f"\n{family}: bf16 mean |logit error| vs fp32: ours {our_err:.4f}, HF {hf_err:.4f}")
    record_property(f"{family}_bf16_err_ours_vs_hf", f"{our_err:.4f}/{hf_err:.4f}")
    assert our_err <= 1.25 * hf_err
    assert float((ours.argmax(-1) == exact.argmax(-1)).float().mean()) >= 0.7


def test_nvfp4_model_equals_model_on_dequantized_weights(pair):
    """Quantized linears (NVFP4, FP8 for attention as in NVIDIA's mixed layout) give exactly the logits of
    dense bf16 weights holding the dequantized values."""
    family, hf, _ = pair
    config, weights = hf_canonical(hf, dtype=torch.bfloat16)
    quantized, dequantized = {}, {}
    for name, w in weights.items():
        if name.endswith(("_proj", "lm_head")) and w.ndim == 2:
            q = quantize_fp8(w) if "attn." in name else quantize_nvfp4(w)
            quantized[name], dequantized[name] = q, q.dequantize(torch.bfloat16)
        else:
            quantized[name] = dequantized[name] = w
    assert sum(not isinstance(w, torch.Tensor) for w in quantized.values()) > 20
    sequences = _sequences((17, 5), seed=5)
    a = teacher_forcing_logits(QwenMoeModel(config, quantized), sequences)
    b = teacher_forcing_logits(QwenMoeModel(config, dequantized), sequences)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    # and quantization actually changed something: the model is not running on the bf16 originals
    c = teacher_forcing_logits(QwenMoeModel(config, weights), sequences)
    assert not torch.equal(a[0], c[0])


def test_weights_are_validated(pair):
    _, hf, _ = pair
    config, weights = hf_canonical(hf)
    missing = dict(weights)
    del missing["layers.1.mlp.experts.3.up_proj"]
    with pytest.raises(CheckpointError, match=r"missing 1 tensors.*layers\.1\.mlp\.experts\.3\.up_proj"):
        QwenMoeModel(config, missing)
    wrong = dict(weights, norm=torch.ones(7))
    with pytest.raises(CheckpointError, match=r"'norm' has shape \[7\], expected \[64\]"):
        QwenMoeModel(config, wrong)
    extra = dict(weights, **{"layers.0.mlp.experts.99.up_proj": torch.ones(32, 64)})
    with pytest.raises(CheckpointError, match="unexpected"):
        QwenMoeModel(config, extra)


@pytest.mark.gpu
def test_gpu_matches_cpu(pair):
    """On CUDA in fp32 the model reproduces the CPU logits and greedy tokens; bf16 runs there too."""
    family, hf, ours = pair
    config, weights = hf_canonical(hf)
    gpu = QwenMoeModel(config, {n: w.to("cuda") for n, w in weights.items()})
    sequences = _sequences((50, 9), seed=6)
    for a, b in zip(
        teacher_forcing_logits(gpu, sequences), teacher_forcing_logits(ours, sequences), strict=True
    ):
        assert a.device.type == "cuda"
        assert float((a.cpu() - b).abs().max() / b.abs().max()) <= 1e-4
    params = [SamplingParams(max_tokens=16), SamplingParams(max_tokens=16, temperature=1.0, seed=3)]
    assert generate(gpu, sequences, params) == generate(ours, sequences, params)
    config, weights = hf_canonical(hf, dtype=torch.bfloat16)
    low = QwenMoeModel(config, {n: w.to("cuda") for n, w in weights.items()})
    assert [len(o.token_ids) for o in generate(low, sequences, params)] == [16, 16]


def test_teacher_forcing_from_a_start_is_the_tail_of_the_full_logits(pair):
    _, _, ours = pair
    sequences = _sequences(LENGTHS, seed=5)
    starts = [3, 64, 0, 0]
    full = teacher_forcing_logits(ours, sequences)
    tails = teacher_forcing_logits(ours, sequences, starts)
    for f, t, start, s in zip(full, tails, starts, sequences, strict=True):
        assert t.shape == (len(s) - start, VOCAB) and t.dtype == torch.float32
        torch.testing.assert_close(t, f[start:], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="sequence 3: start 1 outside its 1 positions"):
        teacher_forcing_logits(ours, sequences, [0, 0, 0, 1])
