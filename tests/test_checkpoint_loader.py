"""load_checkpoint: transformers' own save_pretrained output, official fused layout, in-memory tensors,
and the errors for missing, misshaped, mistyped, unknown and skipped tensors."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

from batchinfer.checkpoint.loader import load_checkpoint
from batchinfer.checkpoint.presets import build_checkpoint
from batchinfer.errors import CheckpointError, ConfigError
from batchinfer.models.config import ModelConfig

SMALL = dict(
    vocab_size=128,
    hidden_size=32,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    tie_word_embeddings=False,
)


def _hf(family: str, out):
    torch.manual_seed(0)
    if family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(num_hidden_layers=2, **SMALL))
    else:
        cfg = Qwen3_5MoeTextConfig(
            num_hidden_layers=4,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            shared_expert_intermediate_size=16,
            **SMALL,
        )
        model = Qwen3_5MoeForCausalLM(cfg)
    model.save_pretrained(out)
    return load_file(str(out / "model.safetensors"))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_transformers_save_pretrained_loads_exactly(tmp_path, family):
    hf = _hf(family, tmp_path)
    cfg, w = load_checkpoint(tmp_path, dtype=torch.float32)
    assert cfg.model_type == family and cfg.num_experts == 4
    assert len(w) == len(hf)  # one canonical weight per HF tensor, nothing dropped or invented
    for name, t in hf.items():
        canon = name.removeprefix("model.").removesuffix(".weight")
        assert torch.equal(w[canon], t), name
    assert w["layers.1.mlp.experts.3.down_proj"].shape == (32, 16)
    assert all(t.dtype == torch.float32 for t in w.values())
    _, w16 = load_checkpoint(tmp_path)  # default dtype bf16
    assert w16["embed_tokens"].dtype == torch.bfloat16


def test_official_fused_layout_becomes_per_expert_views(tiny_checkpoint):
    folder = tiny_checkpoint("tiny-qwen3.5-moe")
    raw = load_file(str(folder / "model.safetensors")) if (folder / "model.safetensors").exists() else None
    assert raw is not None and "model.language_model.layers.0.mlp.experts.gate_up_proj" in raw
    cfg, w = load_checkpoint(folder)
    gate_up = raw["model.language_model.layers.0.mlp.experts.gate_up_proj"]  # [E, 2I, D]
    down = raw["model.language_model.layers.0.mlp.experts.down_proj"]  # [E, D, I]
    i = cfg.moe_intermediate_size
    assert torch.equal(w["layers.0.mlp.experts.5.gate_proj"], gate_up[5, :i])
    assert torch.equal(w["layers.0.mlp.experts.5.up_proj"], gate_up[5, i:])
    assert torch.equal(w["layers.0.mlp.experts.5.down_proj"], down[5])
    # views of one tensor per layer, not copies
    g0, g7 = w["layers.0.mlp.experts.0.gate_proj"], w["layers.0.mlp.experts.7.up_proj"]
    assert g0.untyped_storage().data_ptr() == g7.untyped_storage().data_ptr()


def test_in_memory_tensors_need_a_config_and_load_like_disk(tiny_checkpoint):
    config, tensors = build_checkpoint("tiny-qwen3-moe", seed=0)
    cfg, w = load_checkpoint(tensors, config=config)
    _, w_disk = load_checkpoint(tiny_checkpoint("tiny-qwen3-moe"))
    assert w.keys() == w_disk.keys() and all(torch.equal(w[k], w_disk[k]) for k in w)
    with pytest.raises(CheckpointError, match="in-memory tensors need config="):
        load_checkpoint(tensors)
    cfg2, _ = load_checkpoint(tensors, config=cfg)  # a ModelConfig works too
    assert cfg2 is cfg


def _edit(folder, tmp_path, fn):
    """Copy a single-file checkpoint and rewrite its tensors with `fn(dict)`."""
    dst = tmp_path / "ck"
    shutil.copytree(folder, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_missing_tensor_is_named_with_its_shape(tiny_checkpoint, tmp_path):
    dst = _edit(
        tiny_checkpoint("tiny-qwen3-moe"), tmp_path, lambda t: t.pop("model.layers.2.self_attn.k_norm.weight")
    )
    with pytest.raises(
        CheckpointError, match=r"missing tensor model.layers.2.self_attn.k_norm.weight \(shape \[16\]\)"
    ):
        load_checkpoint(dst)


def test_misshaped_and_mistyped_tensors_are_named(tiny_checkpoint, tmp_path):
    def edit(t):
        t["model.layers.1.mlp.experts.3.up_proj.weight"] = torch.zeros(32, 63, dtype=torch.bfloat16)
        t["model.norm.weight"] = torch.zeros(64, dtype=torch.int32)

    dst = _edit(tiny_checkpoint("tiny-qwen3-moe"), tmp_path, edit)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(dst)
    msg = str(e.value)
    assert "tensor model.layers.1.mlp.experts.3.up_proj.weight has shape [32, 63], expected [32, 64]" in msg
    assert msg.endswith("tensor model.norm.weight has dtype int32, expected float32/float16/bfloat16/float64")


def test_config_json_that_is_a_folder_is_a_config_error(tiny_checkpoint, tmp_path):
    """A folder where config.json should be (as the weights loader and the job plan read it)."""
    dst = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint("tiny-qwen3-moe"), dst)
    (dst / "config.json").unlink()
    (dst / "config.json").mkdir()
    message = rf"{dst / 'config.json'}: cannot be read \(Is a directory\); expected a JSON file"
    with pytest.raises(ConfigError, match=message):
        load_checkpoint(dst)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_pretrained(dst)


def test_unknown_tensors_are_an_error_and_mtp_visual_are_skipped(tiny_checkpoint, tmp_path, caplog):
    def edit(t):
        t["mtp.fc.weight"] = torch.zeros(64, 128)
        t["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(8, 8)
        t["model.layers.0.self_attn.k_scale"] = torch.ones(())

    dst = _edit(tiny_checkpoint("tiny-qwen3-moe"), tmp_path, edit)
    with caplog.at_level(logging.INFO, logger="batchinfer.checkpoint.loader"):
        load_checkpoint(dst)
    assert any("skipped 3 MTP / vision / KV-cache-scale tensors" in r.getMessage() for r in caplog.records)

    def extra(t):
        t["model.layers.0.mlp.experts.8.gate_proj.weight"] = torch.zeros(32, 64)  # only 8 experts
        t["model.layers.9.input_layernorm.weight"] = torch.zeros(64)  # only 4 layers

    dst2 = _edit(tiny_checkpoint("tiny-qwen3-moe"), tmp_path / "b", extra)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(dst2)
    msg = str(e.value)
    assert "2 unexpected tensors not used by a qwen3_moe model with 4 layers and 8 experts" in msg
    assert (
        "model.layers.0.mlp.experts.8.gate_proj.weight" in msg
        and "model.layers.9.input_layernorm.weight" in msg
    )


def test_fused_experts_with_wrong_shape(tiny_checkpoint, tmp_path):
    name = "model.language_model.layers.1.mlp.experts.down_proj"
    dst = _edit(
        tiny_checkpoint("tiny-qwen3.5-moe"),
        tmp_path,
        lambda t: t.update({name: t[name][:, :, :16].contiguous()}),
    )
    with pytest.raises(
        CheckpointError, match=rf"tensor {name} has shape \[8, 64, 16\], expected \[8, 64, 32\]"
    ):
        load_checkpoint(dst)


def test_tied_embeddings_share_the_tensor(tiny_checkpoint, tmp_path):
    import json

    dst = _edit(tiny_checkpoint("tiny-qwen3-moe"), tmp_path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="missing tensor lm_head.weight"):
        load_checkpoint(dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(cfg | {"tie_word_embeddings": True}))
    _, w = load_checkpoint(dst)
    assert w["lm_head"] is w["embed_tokens"]
