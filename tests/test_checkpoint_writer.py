"""save_checkpoint / to_hf_checkpoint: official Qwen3.5 layout vs text layout, shards and index,
stale-shard removal, zero-copy fused experts, tied embeddings and generation_config."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from batchinfer.checkpoint.loader import load_checkpoint, model_config_from_hf
from batchinfer.checkpoint.presets import preset_config, random_weights
from batchinfer.checkpoint.writer import save_checkpoint, to_hf_checkpoint
from batchinfer.errors import CheckpointError


def _weights(preset, seed=0):
    raw = preset_config(preset)
    return raw, random_weights(model_config_from_hf(raw), seed=seed)


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_vl_config_writes_the_official_layout_without_copying_experts():
    raw, w = _weights("tiny-qwen3.5-moe")
    config, tensors = to_hf_checkpoint(raw, w)
    assert config["model_type"] == "qwen3_5_moe" and "quantization_config" not in config
    gate_up = tensors["model.language_model.layers.2.mlp.experts.gate_up_proj"]
    down = tensors["model.language_model.layers.2.mlp.experts.down_proj"]
    assert gate_up.shape == (8, 64, 64) and down.shape == (8, 64, 32)
    # the generator's own tensor, not a copy
    assert gate_up.data_ptr() == w["layers.2.mlp.experts.0.gate_proj"].data_ptr()
    assert "lm_head.weight" in tensors and "model.language_model.layers.0.linear_attn.A_log" in tensors
    assert not any(".experts.0." in n for n in tensors)
    assert all(n.startswith(("model.language_model.", "lm_head.")) for n in tensors)


def test_text_config_writes_per_expert_tensors_with_model_prefix(tmp_path):
    raw, w = _weights("tiny-qwen3.5-moe")
    text = dict(raw["text_config"])  # what transformers' Qwen3_5MoeForCausalLM saves
    save_checkpoint(tmp_path, text, w)
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names
    assert not any("language_model" in n or n.endswith("gate_up_proj") for n in names)
    _, back = load_checkpoint(tmp_path)
    _same(back, w)


def test_sharding_index_and_stale_shards(tmp_path):
    raw, w = _weights("tiny-qwen3-moe")
    save_checkpoint(tmp_path, raw, w, max_shard_bytes=100_000)
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    sizes = {n: t.numel() * t.element_size() for s in shards for n, t in load_file(str(tmp_path / s)).items()}
    assert index["metadata"]["total_size"] == sum(sizes.values())
    assert set(index["weight_map"]) == set(sizes) and set(index["weight_map"].values()) == set(shards)
    _, back = load_checkpoint(tmp_path)
    _same(back, w)
    # rewriting as one file leaves no stale shard or index behind
    raw2, w2 = _weights("tiny-qwen3-moe", seed=1)
    save_checkpoint(tmp_path, raw2, w2)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()
    _, back2 = load_checkpoint(tmp_path)
    _same(back2, w2)


def test_configs_and_generation_config(tmp_path):
    raw, w = _weights("tiny-qwen3-moe")
    save_checkpoint(tmp_path, raw, w)
    assert json.loads((tmp_path / "config.json").read_text()) == raw
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == raw["eos_token_id"] and gen["bos_token_id"] == raw["bos_token_id"]
    assert not (tmp_path / "hf_quant_config.json").exists()


def test_tied_embeddings_are_written_once(tmp_path):
    raw, w = _weights("tiny-qwen3-moe")
    raw["tie_word_embeddings"] = True
    w["lm_head"] = w["embed_tokens"]
    save_checkpoint(tmp_path, raw, w)
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    _, back = load_checkpoint(tmp_path)
    assert back["lm_head"] is back["embed_tokens"] and torch.equal(back["lm_head"], w["embed_tokens"])


def test_missing_or_misshaped_weights_are_refused(tmp_path):
    raw, w = _weights("tiny-qwen3-moe")
    del w["layers.1.self_attn.q_norm"]
    w["bogus"] = torch.zeros(1)
    with pytest.raises(
        CheckpointError, match=r"missing weights \['layers.1.self_attn.q_norm'\], unexpected .*'bogus'"
    ):
        save_checkpoint(tmp_path, raw, w)
    raw, w = _weights("tiny-qwen3-moe")
    w["norm"] = torch.zeros(65)
    with pytest.raises(CheckpointError, match=r"weight norm has shape \[65\], expected \[64\]"):
        save_checkpoint(tmp_path, raw, w)
