"""Quantization config detection: ModelOpt (hf_quant_config.json or quantization_config) and
compressed-tensors, module matching with wildcards and prefixes, and unsupported algorithms."""

from __future__ import annotations

import json

import pytest

from batchinfer.checkpoint.quant_config import FP8, MODELOPT, NVFP4, QuantConfig, read_quant_config
from batchinfer.errors import CheckpointError

VL = "model.language_model.layers.0."


def _hf_quant(tmp_path, quantization):
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"producer": {}, "quantization": quantization}))
    return read_quant_config(None, tmp_path)


def test_none_for_unquantized(tmp_path):
    assert read_quant_config({"model_type": "qwen3_moe"}, tmp_path) is None


def test_modelopt_nvfp4_with_wildcard_excludes_and_prefix_tolerance(tmp_path):
    qc = _hf_quant(
        tmp_path,
        {
            "quant_algo": "NVFP4",
            "group_size": 16,
            "kv_cache_quant_algo": None,
            "exclude_modules": ["lm_head", "*mlp.gate", "model.layers.*.shared_expert_gate", "mtp*"],
        },
    )
    assert qc.method == MODELOPT and qc.source.endswith("hf_quant_config.json")
    assert qc.scheme_for(VL + "mlp.experts.3.gate_proj") == NVFP4
    assert qc.scheme_for(VL + "self_attn.q_proj") == NVFP4
    assert qc.scheme_for("lm_head") is None
    assert qc.scheme_for(VL + "mlp.gate") is None  # fnmatch wildcard
    assert qc.scheme_for(VL + "mlp.gate_proj") == NVFP4  # ... which must not swallow gate_proj
    # pattern written without `language_model.` still matches the VL checkpoint's module
    assert qc.scheme_for(VL + "mlp.shared_expert_gate") is None
    assert qc.scheme_for("model.layers.0.mlp.shared_expert_gate") is None


def test_modelopt_in_config_json_with_ignore_and_w4a16(tmp_path):
    raw = {
        "quantization_config": {
            "quant_method": "modelopt",
            "quant_algo": "W4A16_NVFP4",
            "ignore": ["model.language_model.layers.1.mlp.gate"],
        }
    }
    qc = read_quant_config(raw, tmp_path)
    assert qc.source.endswith("config.json:quantization_config")
    assert qc.scheme_for("model.layers.1.mlp.gate") is None  # VL-prefixed pattern, text-prefixed module
    assert qc.scheme_for("model.layers.10.mlp.gate") == NVFP4  # layers.1 is not a prefix of layers.10
    assert qc.scheme_for("model.layers.1.mlp.experts.0.up_proj") == NVFP4


def test_hf_quant_config_wins_over_config_json(tmp_path):
    raw = {"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}}
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    assert read_quant_config(raw, tmp_path).default == NVFP4
    assert read_quant_config(raw, None).default == FP8


def test_mixed_precision_layers_parent_modules_and_fp8(tmp_path):
    qc = _hf_quant(
        tmp_path,
        {
            "quant_algo": "MIXED_PRECISION",
            "kv_cache_quant_algo": "FP8",
            "exclude_modules": ["mtp.layers.0*", "mtp*"],
            "quantized_layers": {
                "model.language_model.layers.0.mlp.experts": {"quant_algo": "W4A16_NVFP4", "group_size": 16},
                "model.language_model.layers.0.mlp.shared_expert.gate_proj": {
                    "quant_algo": "W4A16_NVFP4",
                    "group_size": 16,
                },
                "model.language_model.layers.0.linear_attn.in_proj_qkv": {"quant_algo": "FP8"},
                "lm_head": {"quant_algo": "W4A16_NVFP4", "group_size": 16},
            },
        },
    )
    assert qc.scheme_for(VL + "mlp.experts.17.down_proj") == NVFP4  # parent module key
    assert qc.scheme_for(VL + "mlp.shared_expert.gate_proj") == NVFP4
    assert qc.scheme_for(VL + "mlp.shared_expert.up_proj") is None  # not listed -> BF16
    assert qc.scheme_for(VL + "linear_attn.in_proj_qkv") == FP8
    assert qc.scheme_for(VL + "linear_attn.in_proj_a") is None
    assert qc.scheme_for("lm_head") == NVFP4


@pytest.mark.parametrize(
    "quantization, expected",
    [
        (
            {"quant_algo": "W4A8_AWQ"},
            "quant_algo 'W4A8_AWQ' is not supported; supported: NVFP4, W4A16_NVFP4, FP8, MIXED_PRECISION",
        ),
        ({"quant_algo": "NVFP4", "group_size": 32}, "NVFP4 group_size 32 is not supported; expected 16"),
        ({"quant_algo": "MIXED_PRECISION"}, "needs a 'quantized_layers' object"),
        (
            {"quant_algo": "MIXED_PRECISION", "quantized_layers": {"x": {"quant_algo": "INT8_SQ"}}},
            "quantized_layers['x'] quant_algo 'INT8_SQ' is not supported",
        ),
    ],
)
def test_unsupported_modelopt_algorithms_are_named(tmp_path, quantization, expected):
    with pytest.raises(CheckpointError) as e:
        _hf_quant(tmp_path, quantization)
    assert expected in str(e.value) and "hf_quant_config.json" in str(e.value)


def test_unsupported_quant_method_lists_supported():
    with pytest.raises(CheckpointError) as e:
        read_quant_config({"quantization_config": {"quant_method": "gptq", "bits": 4}}, None)
    assert "quant_method 'gptq' is not supported; supported: modelopt" in str(e.value)
    assert "compressed-tensors (nvfp4-pack-quantized)" in str(e.value)


CT_WEIGHTS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True}


def test_compressed_tensors_targets_and_ignore():
    raw = {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "nvfp4-pack-quantized",
            "config_groups": {
                "group_0": {"targets": ["Linear"], "weights": CT_WEIGHTS, "input_activations": None}
            },
            "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*linear_attn.*"],
        }
    }
    qc = read_quant_config(raw, None)
    assert qc.method == "compressed-tensors"
    assert qc.scheme_for("model.layers.0.mlp.experts.0.gate_proj") == NVFP4
    assert qc.scheme_for("model.layers.0.mlp.gate") is None
    assert qc.scheme_for("model.language_model.layers.0.linear_attn.out_proj") is None
    assert qc.scheme_for("lm_head") is None


def test_compressed_tensors_unsupported_scheme():
    raw = {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "int-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int"}}},
        }
    }
    with pytest.raises(CheckpointError) as e:
        read_quant_config(raw, None)
    msg = str(e.value)
    assert "config_groups['group_0'] (format 'int-quantized', weights num_bits=8 type=int" in msg
    assert (
        "supported: format nvfp4-pack-quantized with 4-bit float tensor_group weights, group_size 16" in msg
    )


def test_first_matching_pattern_wins_across_plain_names_and_wildcards():
    # plain names are looked up in a dict, wildcards tried in order: the order of the config decides
    q = QuantConfig(
        MODELOPT,
        "test",
        layers={"model.layers.0.mlp": FP8, "*.experts.*": NVFP4, "model.layers.1.mlp.experts.3.up_proj": FP8},
        exclude=["re:.*\\.mlp\\.gate$", "model.layers.2"],
    )
    assert q.scheme_for("model.layers.0.mlp.experts.3.up_proj") == FP8  # parent module, listed first
    assert q.scheme_for("model.layers.1.mlp.experts.3.up_proj") == NVFP4  # the wildcard comes first
    assert q.scheme_for("model.layers.1.mlp.shared_expert.up_proj") is None
    assert q.scheme_for("model.layers.1.mlp.gate") is None  # excluded by regex
    assert q.scheme_for("model.layers.2.mlp.experts.0.up_proj") is None  # excluded parent
    assert q.scheme_for("model.layers.20.mlp.experts.0.up_proj") == NVFP4  # not under layers.2
    assert q.scheme_for("model.language_model.layers.0.mlp.experts.0.down_proj") == FP8  # prefix tolerance


def _ct(**changes):
    qc = {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": CT_WEIGHTS}},
    }
    qc.update(changes)
    return {"quantization_config": qc}


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (
            {"quantization_config": "nvfp4"},
            "config.json: quantization_config is a str ('nvfp4'), expected an object",
        ),
        (
            _ct(config_groups=[1]),
            "config.json:quantization_config: config_groups is a list ([1]), expected an object",
        ),
        (
            _ct(config_groups={"group_0": "nvfp4"}),
            "quantization_config: config_groups['group_0'] is a str ('nvfp4'), expected an object",
        ),
        (
            _ct(config_groups={"group_0": {"targets": ["Linear"], "weights": "fp4"}}),
            "config_groups['group_0'].weights is a str ('fp4'), expected an object",
        ),
        (
            _ct(config_groups={"group_0": {"targets": "Linear", "weights": CT_WEIGHTS}}),
            "config_groups['group_0'].targets is a str ('Linear'), expected a list of module names (strings)",
        ),
        (
            _ct(ignore="lm_head"),
            "quantization_config: ignore is a str ('lm_head'), expected a list of module",
        ),
        (_ct(ignore=["re:(unclosed"]), "ignore pattern 're:(unclosed' is not a valid regex"),
        (
            {"quantization_config": {"quant_method": "modelopt", "quant_algo": ["FP8"]}},
            "quant_algo ['FP8'] is not supported",
        ),
    ],
)
def test_wrongly_shaped_config_json_quant_config_names_the_key(tmp_path, raw, expected):
    with pytest.raises(CheckpointError) as e:
        read_quant_config(raw, tmp_path)
    assert f"{tmp_path}/" in str(e.value) and expected in str(e.value)


@pytest.mark.parametrize(
    ("quantization", "expected"),
    [
        (
            {"quant_algo": "NVFP4", "exclude_modules": "lm_head"},
            "exclude_modules is a str ('lm_head'), expected a list of module names (strings)",
        ),
        (
            {"quant_algo": "FP8", "exclude_modules": ["lm_head", 3]},
            "exclude_modules is a list (['lm_head', 3])",
        ),
        (
            {"quant_algo": "MIXED_PRECISION", "quantized_layers": {"model.layers.0.mlp.experts": "NVFP4"}},
            "quantized_layers['model.layers.0.mlp.experts'] is a str ('NVFP4'), expected an object",
        ),
    ],
)
def test_wrongly_shaped_hf_quant_config_names_the_key(tmp_path, quantization, expected):
    with pytest.raises(CheckpointError) as e:
        _hf_quant(tmp_path, quantization)
    assert f"{tmp_path / 'hf_quant_config.json'}: {expected}" in str(e.value)
