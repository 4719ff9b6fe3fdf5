"""`save_checkpoint`: canonical weights -> a Hugging Face checkpoint folder, laid out as real ones are.

Qwen3.5 with a vision-language wrapper config (`model_type: qwen3_5_moe`, `text_config`) is written
as the official checkpoints: prefix `model.language_model.` and fused 3-D BF16 experts. Text-only
configs (`qwen3_moe`, `qwen3_5_moe_text`) use prefix `model.` and per-expert tensors, as
transformers' `save_pretrained` does. Quantized linears are written per expert in NVIDIA ModelOpt's
layout (plus `hf_quant_config.json`) or, on request, compressed-tensors `nvfp4-pack-quantized`.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from batchinfer import __version__
from batchinfer.checkpoint import layout
from batchinfer.checkpoint.loader import Weight, model_config_from_hf
from batchinfer.checkpoint.quant_config import CT_FORMAT, HF_QUANT_CONFIG, MODELOPT
from batchinfer.checkpoint.safetensors_io import INDEX_FILE, SINGLE_FILE
from batchinfer.errors import CheckpointError
from batchinfer.kernels.nvfp4 import FP8Weight, NVFP4Weight, ct_global_from_tensor_scale
from batchinfer.models.config import ModelConfig

log = logging.getLogger(__name__)
DEFAULT_SHARD_BYTES = 5 * 10**9  # the size of the shards in Qwen's own checkpoints
_EXPERTS = re.compile(r"^(layers\.\d+\.mlp\.experts)\.\d+\.\w+$")


def _is_view_of(views: list[torch.Tensor], base: torch.Tensor | None, parts: list[Any]) -> bool:
    return base is not None and all(
        v.data_ptr() == base[p].data_ptr() for v, p in zip(views, parts, strict=True)
    )


def _fused_experts(
    weights: Mapping[str, Weight], cfg: ModelConfig, layer: int
) -> dict[str, torch.Tensor] | None:
    """`experts.gate_up_proj [E, 2I, D]` and `experts.down_proj [E, D, I]` of one layer, or None if any
    expert is quantized. Reuses the tensor the per-expert views came from instead of copying."""
    p, n, i = f"layers.{layer}.mlp.experts.", cfg.num_experts, cfg.moe_intermediate_size
    gate = [weights[f"{p}{e}.gate_proj"] for e in range(n)]
    up = [weights[f"{p}{e}.up_proj"] for e in range(n)]
    down = [weights[f"{p}{e}.down_proj"] for e in range(n)]
    if not all(isinstance(w, torch.Tensor) for w in gate + up + down):
        return None
    gu_base, d_base = gate[0]._base, down[0]._base
    rows = [(e, slice(0, i)) for e in range(n)] + [(e, slice(i, 2 * i)) for e in range(n)]
    if not (
        gu_base is not None
        and gu_base.shape == (n, 2 * i, cfg.hidden_size)
        and _is_view_of(gate + up, gu_base, rows)
    ):
        gu_base = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up, strict=True)])
    if not (
        d_base is not None
        and d_base.shape == (n, cfg.hidden_size, i)
        and _is_view_of(down, d_base, list(range(n)))
    ):
        d_base = torch.stack(down)
    return {p + "gate_up_proj": gu_base, p + "down_proj": d_base}


def to_hf_tensors(
    weights: Mapping[str, Weight],
    cfg: ModelConfig,
    *,
    prefix: str,
    fuse_experts: bool,
    method: str = MODELOPT,
) -> dict[str, torch.Tensor]:
    """Canonical weights -> HF-named tensors (quantized linears expanded into their ModelOpt/CT fields)."""
    specs = layout.weight_specs(cfg)
    missing = [n for n in specs if n not in weights]
    extra = [n for n in weights if n not in specs]
    if missing or extra:
        raise CheckpointError(
            f"cannot write a {cfg.model_type} checkpoint: missing weights {missing[:8]}, "
            f"unexpected weights {extra[:8]}"
        )
    out: dict[str, torch.Tensor] = {}
    fused_layers: set[str] = set()
    if fuse_experts:
        for layer in range(cfg.num_hidden_layers):
            fused = _fused_experts(weights, cfg, layer)
            if fused is not None:
                out.update({prefix + k: v for k, v in fused.items()})
                fused_layers.add(f"layers.{layer}.mlp.experts")
    tied = cfg.tie_word_embeddings and weights["lm_head"] is weights["embed_tokens"]
    for canon, spec in specs.items():
        m = _EXPERTS.match(canon)
        if (m and m.group(1) in fused_layers) or (canon == "lm_head" and tied):
            continue
        w = weights[canon]
        shape = tuple(w.shape)
        if shape != spec.shape:
            raise CheckpointError(f"weight {canon} has shape {list(shape)}, expected {list(spec.shape)}")
        name = lambda field: layout.hf_name(prefix, canon, field)  # noqa: B023
        if isinstance(w, NVFP4Weight):
            if method == MODELOPT:
                out |= {
                    name("weight"): w.packed,
                    name("weight_scale"): w.block_scale,
                    name("weight_scale_2"): w.tensor_scale,
                }
            else:
                out |= {
                    name("weight_packed"): w.packed,
                    name("weight_scale"): w.block_scale,
                    name("weight_global_scale"): ct_global_from_tensor_scale(w.tensor_scale),
                }
        elif isinstance(w, FP8Weight):
            if method != MODELOPT:
                raise CheckpointError(
                    f"{canon} is FP8; the compressed-tensors writer supports NVFP4 linears only"
                )
            out |= {name("weight"): w.data, name("weight_scale"): w.scale}
        else:
            out[name("" if layout.is_bare(canon) else "weight")] = w
    return out


def quantization_section(
    weights: Mapping[str, Weight], cfg: ModelConfig, prefix: str
) -> dict[str, Any] | None:
    """ModelOpt's `quantization` object describing `weights`, or None when nothing is quantized.

    One format -> `W4A16_NVFP4` or `FP8` with the dense linears in `exclude_modules`; several ->
    `MIXED_PRECISION` with `quantized_layers` (a layer's experts collapse into one `mlp.experts` key
    when they share a format, as NVIDIA's exports do). Weight-only: no activation scales are written.
    """
    algo_of = {NVFP4Weight: "W4A16_NVFP4", FP8Weight: "FP8"}
    layers: dict[str, str] = {}
    dense: list[str] = []
    for canon, spec in layout.weight_specs(cfg).items():
        if not spec.linear:
            continue
        algo = algo_of.get(type(weights[canon]))
        if algo is None:
            if not (canon == "lm_head" and weights["lm_head"] is weights["embed_tokens"]):
                dense.append(layout.hf_name(prefix, canon, ""))
            continue
        m = _EXPERTS.match(canon)
        key = layout.hf_name(prefix, m.group(1), "") if m else layout.hf_name(prefix, canon, "")
        layers[key] = algo if layers.get(key, algo) == algo else "split"
        if layers[key] == "split":
            raise CheckpointError(
                f"experts of {key} mix NVFP4 and FP8; one format per layer's experts is supported"
            )
    algos = set(layers.values())
    if not algos:
        return None
    section: dict[str, Any] = {"kv_cache_quant_algo": None, "exclude_modules": dense}
    if "W4A16_NVFP4" in algos:
        section["group_size"] = 16
    if len(algos) == 1:
        section["quant_algo"] = algos.pop()
    else:
        section["quant_algo"] = "MIXED_PRECISION"
        section["quantized_layers"] = {
            k: ({"quant_algo": a, "group_size": 16} if a == "W4A16_NVFP4" else {"quant_algo": a})
            for k, a in layers.items()
        }
    return section


def to_hf_checkpoint(
    config_dict: Mapping[str, Any], weights: Mapping[str, Weight], *, method: str = MODELOPT
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The `config.json` dict (with a `quantization_config` describing `weights`) and the HF-named
    tensors of a checkpoint; `load_checkpoint(tensors, config=config)` reads them back from memory.

    A `qwen3_5_moe` wrapper config selects the official Qwen3.5 layout (`model.language_model.`,
    fused BF16 experts); text-only configs get `model.` and per-expert tensors.
    """
    cfg = model_config_from_hf(config_dict, source="config_dict")
    vl = config_dict.get("model_type") == "qwen3_5_moe"
    prefix = layout.PREFIX_VL if vl else layout.PREFIX_TEXT
    tensors = to_hf_tensors(weights, cfg, prefix=prefix, fuse_experts=vl, method=method)
    config = {k: v for k, v in config_dict.items() if k != "quantization_config"}
    section = quantization_section(weights, cfg, prefix)
    if section is not None:
        config["quantization_config"] = (
            {"quant_method": MODELOPT, **section} if method == MODELOPT else (_ct_config(section))
        )
    return config, tensors


def save_checkpoint(
    out_dir: str | Path,
    config_dict: Mapping[str, Any],
    weights: Mapping[str, Weight],
    *,
    generation_config: Mapping[str, Any] | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    method: str = MODELOPT,
) -> Path:
    """Write `config.json`, `generation_config.json`, safetensors (sharded with an index above
    `max_shard_bytes`) and, for ModelOpt-quantized weights, `hf_quant_config.json`.

    `config_dict` is the HF `config.json` to write (see `to_hf_checkpoint` for the layouts); any
    `quantization_config` in it is replaced by one describing `weights`. Existing safetensors files
    in `out_dir` are removed first so no stale shard survives.
    """
    out = Path(out_dir)
    config, tensors = to_hf_checkpoint(config_dict, weights, method=method)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("model*.safetensors"), out / INDEX_FILE, out / HF_QUANT_CONFIG]:
        old.unlink(missing_ok=True)
    qc = config.get("quantization_config")
    if qc is not None and method == MODELOPT:
        producer = {"name": "batchinfer", "version": __version__}
        section = {k: v for k, v in qc.items() if k != "quant_method"}
        _write_json(out / HF_QUANT_CONFIG, {"producer": producer, "quantization": section})
    _write_json(out / "config.json", config)
    gen = generation_config or _generation_config(model_config_from_hf(config_dict, source="config_dict"))
    _write_json(out / "generation_config.json", gen)
    _write_shards(out, tensors, max_shard_bytes)
    return out


def _ct_config(section: dict[str, Any]) -> dict[str, Any]:
    weights = {
        "num_bits": 4,
        "type": "float",
        "strategy": "tensor_group",
        "group_size": 16,
        "symmetric": True,
        "dynamic": False,
        "scale_dtype": "float8_e4m3fn",
    }
    group = {
        "targets": ["Linear"],
        "weights": weights,
        "input_activations": None,
        "output_activations": None,
        "format": CT_FORMAT,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": CT_FORMAT,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": section["exclude_modules"],
    }


def _generation_config(cfg: ModelConfig) -> dict[str, Any]:
    eos = cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else cfg.eos_token_ids or None
    return {
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": cfg.pad_token_id,
        "do_sample": False,
    }


def _write_json(path: Path, doc: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(doc, indent=2) + "\n")


def _write_shards(out: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> None:
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    files = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for fname, names in zip(files, shards, strict=True):
        part = {}
        for n in names:
            t = tensors[n].detach().to("cpu")
            # safetensors refuses views that share storage (fused-expert slices): give them their own.
            if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
                t = t.contiguous().clone()
            part[n] = t
        save_file(part, str(out / fname), metadata={"format": "pt"})
        log.info("wrote %s (%d tensors)", out / fname, len(names))
    if len(files) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map = {n: f for f, names in zip(files, shards, strict=True) for n in names}
        _write_json(out / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
