"""Quantization schemes and round trips: BF16 -> ModelOpt NVFP4 / MIXED / FP8 -> load, and ModelOpt ->
compressed-tensors -> load, compared on dequantized weights; plus quantized-tensor error messages."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from batchinfer.kernels.nvfp4 import FP8Weight, NVFP4Weight, quantize_fp8, quantize_nvfp4
from safetensors.torch import load_file, save_file

from batchinfer.checkpoint.loader import load_checkpoint
from batchinfer.checkpoint.quantize import convert_to_compressed_tensors, quantize_checkpoint, scheme_format
from batchinfer.checkpoint.writer import save_checkpoint
from batchinfer.errors import CheckpointError


def _dense(w):
    return w.dequantize() if isinstance(w, (NVFP4Weight, FP8Weight)) else w.float()


@pytest.mark.parametrize(
    "canon, nvfp4, mixed",
    [
        ("layers.0.mlp.experts.7.gate_proj", "nvfp4", "nvfp4"),
        ("layers.0.mlp.shared_expert.down_proj", "nvfp4", "nvfp4"),
        ("lm_head", None, "nvfp4"),
        ("layers.3.self_attn.q_proj", "nvfp4", "fp8"),
        ("layers.0.linear_attn.in_proj_qkv", "nvfp4", "fp8"),
        ("layers.0.linear_attn.in_proj_z", "nvfp4", "fp8"),
        ("layers.0.linear_attn.out_proj", "nvfp4", "fp8"),
        ("layers.0.linear_attn.in_proj_a", None, None),
        ("layers.0.linear_attn.in_proj_b", None, None),
        ("layers.0.mlp.gate", None, None),
        ("layers.0.mlp.shared_expert_gate", None, None),
    ],
)
def test_scheme_assignment(canon, nvfp4, mixed):
    assert scheme_format(canon, "nvfp4") == nvfp4
    assert scheme_format(canon, "mixed") == mixed


@pytest.mark.parametrize("preset", ["tiny-qwen3.5-moe", "tiny-qwen3-moe"])
@pytest.mark.parametrize("scheme", ["nvfp4", "mixed"])
def test_quantize_round_trip_through_modelopt_loader(tiny_checkpoint, tmp_path, preset, scheme):
    src = tiny_checkpoint(preset)
    dst = quantize_checkpoint(src, tmp_path / "q", scheme=scheme)
    cfg, bf16 = load_checkpoint(src)
    cfg_q, q = load_checkpoint(dst)
    assert cfg_q == cfg and q.keys() == bf16.keys()
    for name, w in q.items():
        fmt = scheme_format(name, scheme) if name in _linears(cfg) else None
        expected_type = {"nvfp4": NVFP4Weight, "fp8": FP8Weight, None: torch.Tensor}[fmt]
        assert isinstance(w, expected_type), (name, type(w))
        if fmt == "nvfp4":  # bit-identical to quantizing the BF16 weight directly
            ref = quantize_nvfp4(bf16[name])
            assert torch.equal(w.packed, ref.packed) and torch.equal(w.tensor_scale, ref.tensor_scale), name
        elif fmt == "fp8":
            assert torch.equal(w.dequantize(), quantize_fp8(bf16[name]).dequantize()), name
        else:
            assert torch.equal(w, bf16[name]), name
        rel = (_dense(w) - bf16[name].float()).norm() / bf16[name].float().norm()
        assert rel < (0.15 if fmt == "nvfp4" else 0.05), (name, float(rel))
    qc = json.loads((dst / "hf_quant_config.json").read_text())["quantization"]
    assert qc["quant_algo"] == ("W4A16_NVFP4" if scheme == "nvfp4" else "MIXED_PRECISION")
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["quant_method"] == "modelopt"
    assert (dst / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    names = set(load_file(str(dst / "model.safetensors")))
    if preset == "tiny-qwen3.5-moe":  # NVIDIA's layout: VL prefix, per-expert quantized experts
        assert "model.language_model.layers.0.mlp.experts.3.down_proj.weight_scale_2" in names
        assert not any(n.endswith("experts.gate_up_proj") for n in names)


def _linears(cfg):
    from batchinfer.checkpoint.layout import weight_specs

    return {n for n, s in weight_specs(cfg).items() if s.linear}


def test_mixed_layout_matches_nvidia(tiny_checkpoint, tmp_path):
    dst = quantize_checkpoint(tiny_checkpoint("tiny-qwen3.5-moe"), tmp_path / "q", scheme="mixed")
    layers = json.loads((dst / "hf_quant_config.json").read_text())["quantization"]["quantized_layers"]
    p = "model.language_model.layers."
    assert layers[p + "0.mlp.experts"] == {"quant_algo": "W4A16_NVFP4", "group_size": 16}
    assert layers[p + "0.mlp.shared_expert.up_proj"]["quant_algo"] == "W4A16_NVFP4"
    assert layers["lm_head"]["quant_algo"] == "W4A16_NVFP4"
    assert layers[p + "3.self_attn.o_proj"] == {"quant_algo": "FP8"}
    assert layers[p + "0.linear_attn.in_proj_z"] == {"quant_algo": "FP8"}
    assert p + "0.linear_attn.in_proj_a" not in layers and p + "0.mlp.gate" not in layers
    t = load_file(str(dst / "model.safetensors"))
    assert t[p + "3.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert t[p + "3.self_attn.q_proj.weight_scale"].shape == ()
    assert t["lm_head.weight"].dtype == torch.uint8 and t["lm_head.weight"].shape == (512, 32)
    assert t["lm_head.weight_scale"].shape == (512, 4) and t["lm_head.weight_scale_2"].dtype == torch.float32


def test_fp8_only_checkpoint_round_trip(tiny_checkpoint, tmp_path):
    raw = json.loads((tiny_checkpoint("tiny-qwen3-moe") / "config.json").read_text())
    cfg, w = load_checkpoint(tiny_checkpoint("tiny-qwen3-moe"))
    fp8 = {n: quantize_fp8(t) if n in _linears(cfg) and n != "lm_head" else t for n, t in w.items()}
    save_checkpoint(tmp_path, raw, fp8)
    assert json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "FP8"
    _, back = load_checkpoint(tmp_path)
    for n, t in fp8.items():
        assert torch.equal(_dense(back[n]), _dense(t)), n


def test_compressed_tensors_conversion_gives_the_same_dequantized_weights(tiny_checkpoint, tmp_path):
    mo = quantize_checkpoint(tiny_checkpoint("tiny-qwen3.5-moe"), tmp_path / "mo", scheme="nvfp4")
    ct = convert_to_compressed_tensors(mo, tmp_path / "ct")
    qc = json.loads((ct / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "nvfp4-pack-quantized"
    assert not (ct / "hf_quant_config.json").exists()
    t = load_file(str(ct / "model.safetensors"))
    g = "model.language_model.layers.0.mlp.experts.2.up_proj."
    assert {g + f for f in ("weight_packed", "weight_scale", "weight_global_scale")} <= set(t)
    assert t[g + "weight_global_scale"].shape == (1,)
    _, a = load_checkpoint(mo)
    _, b = load_checkpoint(ct)
    mo_raw = load_file(str(mo / "model.safetensors"))
    assert torch.equal(
        t[g + "weight_global_scale"], 1 / mo_raw[g + "weight_scale_2"].reshape(1)
    )  # stored inverted
    for n in a:
        if isinstance(a[n], NVFP4Weight):
            assert torch.equal(a[n].packed, b[n].packed) and torch.equal(a[n].block_scale, b[n].block_scale)
            # 1 / (1 / s) in fp32 is s up to one ulp
            torch.testing.assert_close(b[n].dequantize(), a[n].dequantize(), rtol=2.4e-7, atol=0)
        else:
            assert torch.equal(a[n], b[n]), n


def test_mixed_scheme_cannot_become_compressed_tensors(tiny_checkpoint, tmp_path):
    mo = quantize_checkpoint(tiny_checkpoint("tiny-qwen3-moe"), tmp_path / "mo", scheme="mixed")
    with pytest.raises(
        CheckpointError, match="layers.0.self_attn.q_proj is FP8; the compressed-tensors writer"
    ):
        convert_to_compressed_tensors(mo, tmp_path / "ct")


def test_quantize_refuses_mixed_compressed_tensors_before_loading(tmp_path):
    # The source does not even exist: the scheme/format clash must be reported before any loading.
    with pytest.raises(CheckpointError, match="scheme 'mixed' cannot be written as compressed-tensors"):
        quantize_checkpoint(tmp_path / "absent", tmp_path / "ct", scheme="mixed", method="compressed-tensors")
    assert not (tmp_path / "ct").exists()


def test_quantize_refuses_quantized_source_and_same_folder(tiny_checkpoint, tmp_path):
    q = tiny_checkpoint("tiny-qwen3-moe", "nvfp4")
    with pytest.raises(CheckpointError, match="already quantized"):
        quantize_checkpoint(q, tmp_path / "x", scheme="nvfp4")
    src = tiny_checkpoint("tiny-qwen3-moe")
    with pytest.raises(CheckpointError, match="destination must differ"):
        quantize_checkpoint(src, src, scheme="nvfp4")


def _copy_edit(src, tmp_path, fn_tensors=None, fn_quant=None):
    dst = tmp_path / "edit"
    shutil.copytree(src, dst)
    if fn_tensors:
        t = load_file(str(dst / "model.safetensors"))
        fn_tensors(t)
        save_file(t, str(dst / "model.safetensors"))
    if fn_quant:
        doc = json.loads((dst / "hf_quant_config.json").read_text())
        fn_quant(doc["quantization"])
        (dst / "hf_quant_config.json").write_text(json.dumps(doc))
    return dst


def test_quantized_tensor_errors_name_tensor_and_config(tiny_checkpoint, tmp_path):
    q = tiny_checkpoint("tiny-qwen3-moe", "nvfp4")
    name = "model.layers.1.mlp.experts.4.down_proj"

    def edit(t):
        del t[name + ".weight_scale_2"]
        t["model.layers.0.self_attn.v_proj.weight_scale"] = t[
            "model.layers.0.self_attn.v_proj.weight_scale"
        ].float()

    with pytest.raises(CheckpointError) as e:
        load_checkpoint(_copy_edit(q, tmp_path, edit))
    msg = str(e.value)
    assert (
        f"missing tensor {name}.weight_scale_2 (nvfp4 linear {name} per " in msg
        and "hf_quant_config.json" in msg
    )
    assert (
        "tensor model.layers.0.self_attn.v_proj.weight_scale has dtype float32, expected float8_e4m3fn" in msg
    )


def test_exclude_wildcards_decide_what_the_loader_expects(tiny_checkpoint, tmp_path):
    q = tiny_checkpoint("tiny-qwen3-moe", "nvfp4")
    # Excluding the experts of layer 2 by wildcard: the loader now wants dense weights there.
    dst = _copy_edit(
        q, tmp_path, fn_quant=lambda qc: qc["exclude_modules"].append("model.layers.2.mlp.experts.*")
    )
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(dst)
    msg = str(e.value)
    assert (
        "linear model.layers.2.mlp.experts.0.down_proj is stored quantized (has weight_scale, "
        "weight_scale_2) but " + str(dst / "hf_quant_config.json") + " does not quantize it"
    ) in msg
    assert "layers.1.mlp.experts" not in msg and "(and 12 more problems)" in msg  # 8 experts x 3 projections
    # and the other way round: a quantized module stored in BF16
    src = tiny_checkpoint("tiny-qwen3-moe")
    dense = _copy_edit(src, tmp_path / "d")
    (dense / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    with pytest.raises(
        CheckpointError, match="linear model.layers.0.self_attn.q_proj is stored unquantized but .* nvfp4"
    ):
        load_checkpoint(dense)


def _poison(name, value, dtype=None):
    """An edit of the tensor dict writing `value` into the first element of tensor `name` (raw bytes with
    `dtype=torch.uint8`, for float8)."""

    def edit(tensors):
        t = tensors[name]
        (t.view(dtype) if dtype is not None else t).view(-1)[0] = value

    return edit


NAN, INF = float("nan"), float("inf")
Q3, Q35 = "model.layers", "model.language_model.layers"


@pytest.mark.parametrize(
    ("preset", "quant", "name", "value", "dtype"),
    [
        ("tiny-qwen3-moe", "bf16", "model.norm.weight", NAN, None),
        ("tiny-qwen3-moe", "bf16", f"{Q3}.1.mlp.experts.3.up_proj.weight", -INF, None),
        ("tiny-qwen3.5-moe", "bf16", f"{Q35}.0.mlp.experts.gate_up_proj", INF, None),  # fused experts
        ("tiny-qwen3-moe", "nvfp4", f"{Q3}.0.mlp.experts.2.gate_proj.weight_scale_2", NAN, None),
        ("tiny-qwen3-moe", "nvfp4", f"{Q3}.0.mlp.experts.2.gate_proj.weight_scale", 0x7F, torch.uint8),
        ("tiny-qwen3-moe", "nvfp4", f"{Q3}.2.mlp.experts.5.down_proj.weight_scale", 0xFF, torch.uint8),
        ("tiny-qwen3.5-moe", "mixed", f"{Q35}.3.self_attn.q_proj.weight", 0xFF, torch.uint8),
        ("tiny-qwen3.5-moe", "mixed", f"{Q35}.3.self_attn.q_proj.weight_scale", INF, None),
    ],
)
def test_nan_or_inf_weights_and_scales_are_refused(
    tiny_checkpoint, tmp_path, preset, quant, name, value, dtype
):
    dst = _copy_edit(tiny_checkpoint(preset, quant), tmp_path, _poison(name, value, dtype))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor {name} contains NaN or Inf$"):
        load_checkpoint(dst)


def test_fp8_extremes_are_not_mistaken_for_nan(tiny_checkpoint, tmp_path):
    name = f"{Q3}.0.mlp.experts.2.gate_proj.weight_scale"

    def edit(tensors):  # +448 and -448, e4m3fn's largest finite values
        tensors[name].view(torch.uint8).view(-1)[:2] = torch.tensor([0x7E, 0xFE], dtype=torch.uint8)

    _, w = load_checkpoint(_copy_edit(tiny_checkpoint("tiny-qwen3-moe", "nvfp4"), tmp_path, edit))
    assert w["layers.0.mlp.experts.2.gate_proj"].block_scale.view(-1)[:2].float().tolist() == [448.0, -448.0]


def test_quantize_refuses_a_checkpoint_with_nan(tiny_checkpoint, tmp_path):
    src = _copy_edit(tiny_checkpoint("tiny-qwen3-moe"), tmp_path, _poison("model.norm.weight", NAN))
    with pytest.raises(CheckpointError, match=r"tensor model\.norm\.weight contains NaN or Inf"):
        quantize_checkpoint(src, tmp_path / "q", scheme="nvfp4")
    assert not (tmp_path / "q").exists()
