"""Batched generation and teacher forcing on the reference model: batching never changes a row's result."""

import pytest
import torch
from models_tiny import FAMILIES, VOCAB, tiny_model

from batchinfer.engine.api import SamplingParams
from batchinfer.models.cache import AttentionCache
from batchinfer.models.generate import GenerationOutput, generate, teacher_forcing_logits

PROMPT_LENGTHS = (3, 70, 11, 1, 25)  # 70 spans two DeltaNet chunks


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return tiny_model(request.param)


def _prompts(lengths=PROMPT_LENGTHS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _one_by_one(model, prompts, params, **kw):
    return [generate(model, [p], [sp], **kw)[0] for p, sp in zip(prompts, params, strict=True)]


def test_teacher_forcing_batch_equals_single_rows(model):
    prompts = _prompts()
    batched = teacher_forcing_logits(model, prompts)
    for p, logits in zip(prompts, batched, strict=True):
        (alone,) = teacher_forcing_logits(model, [p])
        assert logits.shape == (len(p), VOCAB) and logits.dtype == torch.float32
        assert float((logits - alone).abs().max() / alone.abs().max()) <= 1e-4
        assert torch.equal(logits.argmax(-1), alone.argmax(-1))


def test_padded_prefill_leaves_each_rows_cache_as_if_alone(model):
    """Right padding must not reach the DeltaNet conv/recurrent state or the valid part of the KV cache."""
    prompts = _prompts()
    ids = torch.zeros(len(prompts), max(map(len, prompts)), dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    cache = model.new_cache(len(prompts), ids.shape[1])
    model.forward(ids, cache, [len(p) for p in prompts], all_logits=False)
    assert cache.lengths.tolist() == [len(p) for p in prompts]
    for i, p in enumerate(prompts):
        alone = model.new_cache(1, len(p))
        model.forward(torch.tensor([p]), alone, all_logits=False)
        for batched, single in zip(cache.layers, alone.layers, strict=True):
            if isinstance(batched, AttentionCache):
                pairs = [(batched.k[i, :, : len(p)], single.k[0]), (batched.v[i, :, : len(p)], single.v[0])]
            else:
                pairs = [(batched.conv[i], single.conv[0]), (batched.state[i], single.state[0])]
            for got, want in pairs:
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_greedy_batch_equals_one_by_one(model):
    prompts = _prompts()
    params = [SamplingParams(max_tokens=m) for m in (12, 4, 20, 1, 9)]  # rows finish at different steps
    batched = generate(model, prompts, params)
    assert batched == _one_by_one(model, prompts, params)
    assert [len(o.token_ids) for o in batched] == [12, 4, 20, 1, 9]
    assert all(o.finish_reason == "length" for o in batched)


def test_seeded_sampling_batch_equals_one_by_one(model):
    prompts = _prompts(seed=1)
    params = [
        SamplingParams(max_tokens=15, temperature=1.0, seed=7),
        SamplingParams(max_tokens=15, temperature=0.8, top_p=0.9, seed=8),
        SamplingParams(max_tokens=10, temperature=1.2, top_k=20, seed=9),
        SamplingParams(max_tokens=15, temperature=0.0),
        SamplingParams(max_tokens=6, temperature=1.0, top_k=50, top_p=0.95, seed=7),
    ]
    batched = generate(model, prompts, params)
    assert batched == _one_by_one(model, prompts, params)
    # same prompt in a different batch order still gives the same tokens
    assert generate(model, prompts[::-1], params[::-1]) == batched[::-1]
    # the seed matters
    reseeded = [SamplingParams(max_tokens=15, temperature=1.0, seed=1234)]
    assert generate(model, prompts[:1], reseeded)[0].token_ids != batched[0].token_ids


def test_stop_tokens_and_ignore_eos(model):
    prompts = _prompts((8, 14), seed=2)
    free = generate(model, prompts, [SamplingParams(max_tokens=16)] * 2)
    stop = free[0].token_ids[5]
    first = free[0].token_ids.index(stop)
    outs = generate(model, prompts, [SamplingParams(max_tokens=16)] * 2, stop_token_ids={stop})
    assert outs[0] == GenerationOutput(free[0].token_ids[: first + 1], "stop")
    if stop not in free[1].token_ids:
        assert outs[1] == free[1]
    ignoring = generate(
        model, prompts[:1], [SamplingParams(max_tokens=16, ignore_eos=True)], stop_token_ids={stop}
    )
    assert ignoring[0] == free[0]


def test_on_step_sees_every_token_and_can_stop_rows(model):
    prompts = _prompts((6, 9, 4), seed=3)
    params = [SamplingParams(max_tokens=10)] * 3
    reference = generate(model, prompts, params)
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}

    def on_step(tokens):
        for r, t in tokens.items():
            seen[r].append(t)
        return [1, 99] if len(seen[1]) == 3 else None  # 99 is no running row: ignored

    outs = generate(model, prompts, params, on_step=on_step)
    assert outs[1] == GenerationOutput(reference[1].token_ids[:3], "stop")
    assert outs[0] == reference[0] and outs[2] == reference[2]
    assert [seen[r] for r in range(3)] == [o.token_ids for o in outs]


def test_bad_requests_are_rejected(model):
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        generate(model, [[1, 2], []], [SamplingParams()] * 2)
    with pytest.raises(ValueError, match=r"sequence 0 has token ids outside 0\.\.319: \[320\]"):
        generate(model, [[1, 320]], [SamplingParams()])
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        generate(model, [[1], [2]], [SamplingParams()])
    assert generate(model, [], []) == []
