"""Weight-only quantization schemes and checkpoint conversion (`batchinfer quantize`).

`nvfp4`: every linear NVFP4 except the router (`mlp.gate`), `shared_expert_gate`, the DeltaNet
`in_proj_a`/`in_proj_b` (one row per value head) and `lm_head` -- the workloads' definition for
Qwen3-30B-A3B. `mixed`: NVIDIA's layout for Qwen3.6-NVFP4: routed experts, shared expert and
`lm_head` NVFP4; attention and DeltaNet projections FP8 per tensor; everything else stays BF16.
No activation scales are calibrated: output is W4A16 / W8A16, which is how Hopper runs it.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from batchinfer.checkpoint.layout import weight_specs
from batchinfer.checkpoint.loader import Weight, load_checkpoint, read_raw_config
from batchinfer.checkpoint.quant_config import (
    COMPRESSED_TENSORS,
    FP8,
    HF_QUANT_CONFIG,
    MODELOPT,
    NVFP4,
    read_quant_config,
)
from batchinfer.checkpoint.safetensors_io import INDEX_FILE
from batchinfer.checkpoint.writer import save_checkpoint
from batchinfer.errors import CheckpointError
from batchinfer.kernels.nvfp4 import FP8Weight, NVFP4Weight, quantize_fp8, quantize_nvfp4
from batchinfer.models.config import ModelConfig

log = logging.getLogger(__name__)
SCHEMES = ("nvfp4", "mixed")
_NVFP4_SKIP = re.compile(r"(\.mlp\.gate|\.mlp\.shared_expert_gate|\.linear_attn\.in_proj_[ab]|^lm_head)$")
_MIXED_NVFP4 = re.compile(r"(\.mlp\.experts\.\d+\.\w+_proj|\.mlp\.shared_expert\.\w+_proj|^lm_head)$")
_MIXED_FP8 = re.compile(r"(\.self_attn\.[qkvo]_proj|\.linear_attn\.(in_proj_qkv|in_proj_z|out_proj))$")


def scheme_format(canon: str, scheme: str) -> str | None:
    """The format (`nvfp4`, `fp8`) the scheme gives the canonical linear `canon`, or None for BF16."""
    if scheme == "nvfp4":
        return None if _NVFP4_SKIP.search(canon) else NVFP4
    if scheme == "mixed":
        if _MIXED_NVFP4.search(canon):
            return NVFP4
        return FP8 if _MIXED_FP8.search(canon) else None
    return None


def quantize_weight(canon: str, w: torch.Tensor, scheme: str, cfg: ModelConfig) -> Weight:
    """Quantize the canonical linear `canon` per `scheme` ('bf16' returns it unchanged). A tied
    `lm_head` stays tied to the embeddings, unquantized."""
    if scheme == "bf16" or (canon == "lm_head" and cfg.tie_word_embeddings):
        return w
    fmt = scheme_format(canon, scheme)
    if fmt == NVFP4:
        return quantize_nvfp4(w)
    return quantize_fp8(w) if fmt == FP8 else w


def quantize_weights(weights: dict[str, Weight], cfg: ModelConfig, scheme: str) -> dict[str, Weight]:
    """Quantize a canonical dict of dense weights in place, one tensor at a time, and return it."""
    for canon, spec in weight_specs(cfg).items():
        if spec.linear and isinstance(weights[canon], torch.Tensor):
            weights[canon] = quantize_weight(canon, weights[canon], scheme, cfg)
    return weights


def _copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer, generation config, chat template...: every top-level file except weights and configs."""
    skip = {"config.json", INDEX_FILE, HF_QUANT_CONFIG}
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in skip:
            shutil.copy2(f, dst / f.name)


def check_quantize(src: Path, dst: Path, scheme: str, method: str) -> dict[str, Any]:
    """SRC's raw config after the checks that need no weights, run before `quantize` clears DST (a DST
    equal to SRC would otherwise lose SRC's files to --force)."""
    if scheme not in SCHEMES:
        raise CheckpointError(f"unknown scheme {scheme!r}; available: {', '.join(SCHEMES)}")
    if method == COMPRESSED_TENSORS and scheme != "nvfp4":
        # Refused before any work: the mixed scheme's FP8 linears have no compressed-tensors NVFP4 form.
        raise CheckpointError(
            f"scheme {scheme!r} cannot be written as {COMPRESSED_TENSORS}: its FP8 linears have no place in "
            "nvfp4-pack-quantized; use scheme 'nvfp4' or the ModelOpt layout"
        )
    raw = read_raw_config(src)
    if read_quant_config(raw, src) is not None:
        raise CheckpointError(f"{src}: already quantized; `quantize` needs a BF16/FP16/FP32 checkpoint")
    if dst.resolve() == src.resolve():
        raise CheckpointError(f"{dst}: the destination must differ from the source folder")
    return raw


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    scheme: str,
    device: str = "cpu",
    method: str = MODELOPT,
) -> Path:
    """Quantize the unquantized HF checkpoint `src` into `dst` (see the module doc for the schemes), in
    ModelOpt's layout or, with `method="compressed-tensors"`, as `nvfp4-pack-quantized` (NVFP4 only)."""
    src, dst = Path(src), Path(dst)
    raw = check_quantize(src, dst, scheme, method)
    cfg, weights = load_checkpoint(src, device=device)
    quantize_weights(weights, cfg, scheme)
    counts = {
        kind: sum(isinstance(w, cls) for w in weights.values())
        for kind, cls in (("NVFP4", NVFP4Weight), ("FP8", FP8Weight))
    }
    log.info(
        "quantized %s with scheme %s: %d NVFP4 and %d FP8 linears",
        src,
        scheme,
        counts["NVFP4"],
        counts["FP8"],
    )
    save_checkpoint(dst, raw, weights, method=method)
    _copy_side_files(src, dst)
    return dst


def convert_to_compressed_tensors(src: str | Path, dst: str | Path, *, device: str = "cpu") -> Path:
    """Rewrite a ModelOpt NVFP4 checkpoint as compressed-tensors `nvfp4-pack-quantized`: same codes and
    block scales, `weight_packed` names, and the tensor scale stored inverted as `weight_global_scale`.
    FP8 linears (the `mixed` scheme) have no place in that format and are an error."""
    src, dst = Path(src), Path(dst)
    raw = read_raw_config(src)
    qc = read_quant_config(raw, src)
    if qc is None or qc.method == COMPRESSED_TENSORS:
        raise CheckpointError(
            f"{src}: expected a ModelOpt-quantized checkpoint, found {qc.method if qc else 'none'}"
        )
    _, weights = load_checkpoint(src, device=device)
    save_checkpoint(dst, raw, weights, method=COMPRESSED_TENSORS)
    _copy_side_files(src, dst)
    return dst
