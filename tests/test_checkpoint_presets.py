"""make-checkpoint presets: seeded determinism, realistic scales, quantized presets equal `quantize`
of the BF16 preset, transformers loads the tiny checkpoints, and real shapes on a GPU."""

from __future__ import annotations

import math
import time

import pytest
import torch
from batchinfer.kernels.nvfp4 import NVFP4Weight
from tokenizers import Tokenizer

from batchinfer.checkpoint.loader import load_checkpoint, model_config_from_hf
from batchinfer.checkpoint.presets import build_checkpoint, preset_config, random_weights
from batchinfer.checkpoint.quantize import quantize_checkpoint


@pytest.mark.parametrize("preset", ["tiny-qwen3.5-moe", "tiny-qwen3-moe"])
def test_same_seed_same_weights_other_seed_other_weights(preset):
    cfg = model_config_from_hf(preset_config(preset))
    a, b, c = (random_weights(cfg, seed=s) for s in (7, 7, 8))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.mlp.experts.0.gate_proj"], c["layers.0.mlp.experts.0.gate_proj"])


def test_weight_scales_are_realistic():
    w35 = random_weights(model_config_from_hf(preset_config("tiny-qwen3.5-moe")))
    w3 = random_weights(model_config_from_hf(preset_config("tiny-qwen3-moe")))
    for name in ("lm_head", "layers.0.linear_attn.in_proj_qkv", "layers.1.mlp.experts.3.up_proj"):
        assert 0.017 < float(w35[name].float().std()) < 0.023, name
    # GPT-2 init: unit embeddings, residual-branch outputs at 0.02 / sqrt(2 * layers) (4 layers: 0.0071)
    assert 0.95 < float(w35["embed_tokens"].float().std()) < 1.05
    for name in (
        "layers.0.linear_attn.out_proj",
        "layers.3.self_attn.o_proj",
        "layers.1.mlp.experts.3.down_proj",
    ):
        assert 0.006 < float(w35[name].float().std()) < 0.0082, name
    # Qwen3.5 norms scale by (1 + w): w near 0; Qwen3-MoE norms by w: near 1; DeltaNet's gated norm near 1
    assert abs(float(w35["layers.0.input_layernorm"].float().mean())) < 0.01
    assert abs(float(w35["layers.3.self_attn.q_norm"].float().mean())) < 0.02
    assert abs(float(w3["layers.0.input_layernorm"].float().mean()) - 1) < 0.01
    assert abs(float(w35["layers.0.linear_attn.norm"].float().mean()) - 1) < 0.02
    a_log = w35["layers.0.linear_attn.A_log"].float()
    assert float(a_log.min()) >= 0 and float(a_log.max()) <= math.log(16) + 1e-2
    assert torch.equal(w35["layers.0.linear_attn.dt_bias"], torch.ones(4, dtype=torch.bfloat16))


@pytest.mark.parametrize("quant", ["nvfp4", "mixed"])
def test_quantized_preset_equals_quantize_of_bf16_preset(tiny_checkpoint, tmp_path, quant):
    q = quantize_checkpoint(tiny_checkpoint("tiny-qwen3.5-moe"), tmp_path / "q", scheme=quant)
    _, via_quantize = load_checkpoint(q)
    config, tensors = build_checkpoint("tiny-qwen3.5-moe", quant=quant)
    _, direct = load_checkpoint(tensors, config=config)
    assert via_quantize.keys() == direct.keys()
    for k, w in direct.items():
        other = via_quantize[k]
        assert type(w) is type(other), k
        assert torch.equal(_dense(w), _dense(other)), k


def _dense(w):
    return w if isinstance(w, torch.Tensor) else w.dequantize()


def test_tokenizer_and_eos_ids_fit_the_model(tiny_checkpoint):
    folder = tiny_checkpoint("tiny-qwen3-moe")
    cfg, _ = load_checkpoint(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert cfg.eos_token_ids == [tok.token_to_id("<|im_end|>")]
    assert tok.get_vocab_size() <= cfg.vocab_size


@pytest.mark.parametrize("preset", ["tiny-qwen3.5-moe", "tiny-qwen3-moe"])
def test_transformers_loads_the_tiny_checkpoints(tiny_checkpoint, preset):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3MoeForCausalLM

    folder = tiny_checkpoint(preset)
    cls = Qwen3_5MoeForCausalLM if preset == "tiny-qwen3.5-moe" else Qwen3MoeForCausalLM
    model, info = cls.from_pretrained(folder, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    _, ours = load_checkpoint(folder, dtype=torch.float32)
    sd = model.state_dict()
    gate_up = sd["model.layers.1.mlp.experts.gate_up_proj"]  # transformers fuses experts at runtime
    assert torch.equal(gate_up[6, :32], ours["layers.1.mlp.experts.6.gate_proj"])
    assert torch.equal(
        sd["model.layers.1.mlp.experts.down_proj"][6], ours["layers.1.mlp.experts.6.down_proj"]
    )
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 200, 7]])).logits
    assert logits.shape == (1, 5, 512) and bool(torch.isfinite(logits).all())


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["qwen3.6-35b-a3b", "qwen3-30b-a3b"])
def test_real_shape_nvfp4_preset_in_memory_on_gpu(preset):
    t0 = time.perf_counter()
    config, tensors = build_checkpoint(preset, quant="nvfp4", device="cuda")
    t1 = time.perf_counter()
    cfg, w = load_checkpoint(tensors, config=config, device="cuda")
    t2 = time.perf_counter()
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"\n{preset} nvfp4 in memory: build {t1 - t0:.1f} s, load {t2 - t1:.1f} s, {nbytes / 1e9:.1f} GB")
    e = cfg.num_experts - 1
    assert isinstance(w[f"layers.{cfg.num_hidden_layers - 1}.mlp.experts.{e}.down_proj"], NVFP4Weight)
    assert w["lm_head"].shape == (cfg.vocab_size, cfg.hidden_size)
