"""config.json parsing as checkpoints spell it: both families, text_config nesting, rope and layer-type
variants, transformers' attribute aliases, and the preset configs against the research note."""

from __future__ import annotations

import copy
import json
import math

import pytest

from batchinfer.checkpoint.layout import weight_specs
from batchinfer.checkpoint.loader import model_config_from_hf, read_raw_config
from batchinfer.checkpoint.presets import PRESETS, preset_config
from batchinfer.errors import ConfigError
from batchinfer.models.config import ModelConfig


def test_qwen35_vl_wrapper_with_rope_parameters_and_layer_types():
    cfg = model_config_from_hf(preset_config("qwen3.6-35b-a3b"))
    assert cfg.model_type == "qwen3_5_moe"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        2048,
        40,
        16,
        2,
    )
    assert (cfg.head_dim, cfg.rotary_dim, cfg.rope_theta, cfg.vocab_size) == (256, 64, 1e7, 248320)
    assert cfg.layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"]
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == list(range(3, 40, 4))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (256, 8, 512)
    assert cfg.shared_expert_intermediate_size == 512 and cfg.attn_output_gate and cfg.norm_topk_prob
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim) == (16, 32, 128)
    assert cfg.one_plus_norm and not cfg.tie_word_embeddings


def test_qwen35_flat_rope_and_interval_spelling_gives_the_same_config():
    raw = preset_config("qwen3.6-35b-a3b")
    old = copy.deepcopy(raw)
    text = old["text_config"]
    rope = text.pop("rope_parameters")
    text["rope_theta"], text["partial_rotary_factor"] = rope["rope_theta"], rope["partial_rotary_factor"]
    del text["layer_types"]
    assert model_config_from_hf(old) == model_config_from_hf(raw)
    text["full_attention_interval"] = 2
    assert model_config_from_hf(old).layer_types[:4] == ["linear_attention", "full_attention"] * 2


def test_qwen35_text_only_config_as_transformers_saves_it():
    text = dict(preset_config("tiny-qwen3.5-moe")["text_config"])  # model_type qwen3_5_moe_text, flat
    cfg = model_config_from_hf(text)
    assert cfg.model_type == "qwen3_5_moe" and cfg.hidden_size == 64
    assert cfg == model_config_from_hf(preset_config("tiny-qwen3.5-moe"))


def test_qwen3_moe_real_config_and_transformers_alias():
    raw = preset_config("qwen3-30b-a3b")
    cfg = model_config_from_hf(raw)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        "qwen3_moe",
        48,
        32,
        4,
    )
    assert (cfg.head_dim, cfg.rotary_dim, cfg.rope_theta, cfg.num_experts, cfg.moe_intermediate_size) == (
        128,
        128,
        1e6,
        128,
        768,
    )
    assert cfg.norm_topk_prob and cfg.shared_expert_intermediate_size == 0 and not cfg.one_plus_norm
    assert cfg.layer_types == ["full_attention"] * 48
    # transformers 5.x save_pretrained writes num_local_experts instead of num_experts
    aliased = {k: v for k, v in raw.items() if k != "num_experts"} | {"num_local_experts": 128}
    assert model_config_from_hf(aliased) == cfg


def test_unknown_model_type_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_pretrained(tmp_path)
    msg = str(e.value)
    assert "model_type 'llama' is not supported" in msg and "qwen3_moe, qwen3_5_moe" in msg
    assert str(tmp_path / "config.json") in msg


def test_missing_field_is_named():
    raw = preset_config("tiny-qwen3-moe")
    del raw["num_experts_per_tok"]
    with pytest.raises(ConfigError, match="missing required field 'num_experts_per_tok'"):
        model_config_from_hf(raw)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda raw: raw.update(num_hidden_layers="four"),
            "num_hidden_layers is 'four', expected an integer >= 1",
        ),
        (lambda raw: raw.update(vocab_size="big"), "vocab_size is 'big', expected an integer >= 1"),
        (
            lambda raw: raw.update(num_attention_heads=0, head_dim=None),
            "num_attention_heads is 0, expected an",
        ),
        (lambda raw: raw.update(num_key_value_heads=0), "num_key_value_heads is 0, expected an integer >= 1"),
        (lambda raw: raw.update(hidden_size=-192), "hidden_size is -192, expected an integer >= 1"),
        (lambda raw: raw.update(num_experts=True), "num_experts is True, expected an integer >= 1"),
        (lambda raw: raw.update(rms_norm_eps="1e-6"), "rms_norm_eps is '1e-6', expected a positive number"),
        (
            lambda raw: raw.update(partial_rotary_factor=2.0),
            "partial_rotary_factor is 2.0, expected at most 1",
        ),
        (
            lambda raw: raw.update(tie_word_embeddings="false"),
            "tie_word_embeddings is 'false', expected true",
        ),
        (lambda raw: raw.update(eos_token_id=[1, None]), "eos_token_id is None, expected an integer >= 0"),
        (
            lambda raw: raw.update(rope_scaling=["default"]),
            r"rope_scaling is \['default'\], expected an object",
        ),
        # cross-field checks in ModelConfig.__post_init__ get the file too
        (lambda raw: raw.update(num_experts_per_tok=99), "num_experts_per_tok=99 must be in 1..num_experts"),
        (lambda raw: raw.update(num_key_value_heads=3), "num_attention_heads=.* is not a multiple of"),
    ],
)
def test_wrongly_typed_field_is_a_config_error_naming_the_file_and_field(edit, match):
    raw = preset_config("tiny-qwen3-moe")
    edit(raw)
    with pytest.raises(ConfigError, match=f"^my/config.json: {match}"):
        model_config_from_hf(raw, source="my/config.json")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda t: t.update(layer_types="full_attention"),
            "layer_types is 'full_attention', expected a list",
        ),
        (
            lambda t: t.update(layer_types=["full_attention"]),
            "layer_types has 1 entries, expected num_hidden",
        ),
        (lambda t: t.update(layer_types=["dense"] * 4), r"unsupported layer_types \['dense'\]"),
        (
            lambda t: t.update(full_attention_interval=0, layer_types=None),
            "full_attention_interval is 0, expected an integer >= 1",
        ),
        (lambda t: t.update(linear_key_head_dim=None), "linear_key_head_dim is None, expected an integer"),
    ],
)
def test_qwen35_layer_fields_are_named_with_the_file(edit, match):
    raw = preset_config("tiny-qwen3.5-moe")
    edit(raw.get("text_config", raw))
    with pytest.raises(ConfigError, match=f"^my/config.json: {match}"):
        model_config_from_hf(raw, source="my/config.json")


def test_config_json_that_is_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"config.json: expected a JSON object, found list"):
        ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"config.json: expected a JSON object, found list"):
        read_raw_config(tmp_path)


def test_real_shape_preset_specs_match_the_note():
    """Derived shapes of note section 1.1 (35B-A3B) and 1.2 (30B-A3B), without allocating weights."""
    s = weight_specs(model_config_from_hf(PRESETS["qwen3.6-35b-a3b"]))
    assert s["layers.3.self_attn.q_proj"].shape == (8192, 2048)
    assert s["layers.3.self_attn.k_proj"].shape == (512, 2048)
    assert s["layers.3.self_attn.o_proj"].shape == (2048, 4096)
    assert s["layers.0.linear_attn.in_proj_qkv"].shape == (8192, 2048)
    assert s["layers.0.linear_attn.in_proj_z"].shape == (4096, 2048)
    assert s["layers.0.linear_attn.in_proj_b"].shape == (32, 2048)
    assert s["layers.0.linear_attn.conv1d"].shape == (8192, 1, 4)
    assert s["layers.0.linear_attn.norm"].shape == (128,)
    assert s["layers.0.mlp.experts.255.down_proj"].shape == (2048, 512)
    assert s["layers.0.mlp.shared_expert_gate"].shape == (1, 2048)
    assert s["lm_head"].shape == (248320, 2048)
    params = sum(math.prod(v.shape) for v in s.values())
    assert 34.5e9 < params < 36e9, params  # "35B"
    s3 = weight_specs(model_config_from_hf(PRESETS["qwen3-30b-a3b"]))
    assert s3["layers.0.self_attn.q_proj"].shape == (4096, 2048)
    assert s3["layers.0.mlp.experts.127.gate_proj"].shape == (768, 2048)
    params3 = sum(math.prod(v.shape) for v in s3.values())
    assert 30e9 < params3 < 31e9, params3  # "30B"
