"""`load_checkpoint`: any supported checkpoint (folder or in-memory tensors) -> the canonical weight dict.

Everything is validated from headers first (names, shapes, dtypes, quantization layout) and every
problem is reported together, naming the tensor; only then are tensors read, one at a time,
straight onto the target device. Fused 3-D experts become per-expert views (no copy).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from batchinfer.checkpoint import layout
from batchinfer.checkpoint.quant_config import COMPRESSED_TENSORS, FP8, NVFP4, QuantConfig, read_quant_config
from batchinfer.checkpoint.safetensors_io import TensorInfo, TensorSource
from batchinfer.errors import CheckpointError
from batchinfer.kernels.nvfp4 import FP8Weight, NVFP4Weight, tensor_scale_from_ct_global
from batchinfer.models.config import ModelConfig, read_config_json

log = logging.getLogger(__name__)
Weight = torch.Tensor | NVFP4Weight | FP8Weight
_DENSE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_F8 = torch.float8_e4m3fn
_MAX_LISTED = 12
# format -> field -> (dtype, how the shape follows from the [N, K] weight); None = fp32-compatible scalar
_QUANT_FIELDS: dict[tuple[str, str], dict[str, tuple[torch.dtype, Any]]] = {
    ("modelopt", NVFP4): {
        "weight": (torch.uint8, lambda n, k: (n, k // 2)),
        "weight_scale": (_F8, lambda n, k: (n, k // 16)),
        "weight_scale_2": (torch.float32, None),
    },
    ("modelopt", FP8): {"weight": (_F8, lambda n, k: (n, k)), "weight_scale": (torch.float32, None)},
    (COMPRESSED_TENSORS, NVFP4): {
        "weight_packed": (torch.uint8, lambda n, k: (n, k // 2)),
        "weight_scale": (_F8, lambda n, k: (n, k // 16)),
        "weight_global_scale": (torch.float32, None),
    },
}
_OPTIONAL = ("input_scale", "input_global_scale")  # activation scales; we run weight-only (W4A16 / W8A16)


def model_config_from_hf(raw: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
    """`ModelConfig.from_hf` plus the attribute aliases transformers writes (`num_local_experts`)."""
    raw = dict(raw)
    for cfg in (raw, raw.get("text_config")):
        if isinstance(cfg, dict) and "num_experts" not in cfg and "num_local_experts" in cfg:
            cfg["num_experts"] = cfg["num_local_experts"]
    return ModelConfig.from_hf(raw, source=source)


def read_raw_config(folder: Path) -> dict[str, Any]:
    return read_config_json(folder / "config.json")


def load_checkpoint(
    source: str | Path | Mapping[str, torch.Tensor],
    *,
    config: ModelConfig | Mapping[str, Any] | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[ModelConfig, dict[str, Weight]]:
    """Load a checkpoint folder (or `.safetensors` file, or a dict of HF-named tensors) as canonical weights.

    `config`: a `ModelConfig`, or a raw HF config dict (which may carry `quantization_config`); for a
    folder it defaults to its `config.json`, for in-memory tensors it is required. Dense weights are
    cast to `dtype`; quantized linears keep their packed codes and scales. All on `device`.
    """
    folder: Path | None = None
    if isinstance(source, Mapping):
        tensors = TensorSource.from_tensors(source)
        where = "<memory>"
    else:
        path = Path(source)
        tensors = TensorSource.from_path(path)
        folder = path if path.is_dir() else path.parent
        where = str(path)
    raw: Mapping[str, Any] | None = None
    if isinstance(config, ModelConfig):
        cfg = config
        if folder is not None and (folder / "config.json").is_file():
            raw = read_raw_config(folder)
    else:
        if config is not None:
            raw = config
        elif folder is not None:
            raw = read_raw_config(folder)
        else:
            raise CheckpointError("in-memory tensors need config= (a ModelConfig or a config.json dict)")
        cfg = model_config_from_hf(
            raw, source=str(folder / "config.json") if folder and config is None else "config"
        )
    quant = read_quant_config(dict(raw) if raw else None, folder)
    plan = _plan(cfg, tensors.infos, quant, where)
    start = time.monotonic()
    weights = _materialize(plan, tensors, device, dtype)
    tensors.close()
    log.info("loaded %d weights from %s (%s) in %.1f s, checked finite", len(weights), where,
             quant.method if quant else "unquantized", time.monotonic() - start)  # fmt: skip
    return cfg, weights


def _plan(
    cfg: ModelConfig, infos: dict[str, TensorInfo], quant: QuantConfig | None, where: str
) -> dict[str, tuple]:
    """Validate names, shapes and dtypes; canonical name -> how to build it:
    ('dense', name) | ('fused', name, expert, rows) | (format, method, {field: name})."""
    specs = layout.weight_specs(cfg)
    fields: dict[str, dict[str, str]] = {}
    fused: dict[tuple[int, str], str] = {}
    prefixes: dict[str, str] = {}
    unknown: list[str] = []
    skipped = 0
    for name in infos:
        if layout.is_skipped(name):
            skipped += 1
            continue
        prefix = layout.hf_prefix(name)
        rest = name[len(prefix) :]
        if (fe := layout.fused_expert(rest)) is not None:
            fused[fe] = name
        elif (sf := layout.split_field(rest, specs)) is not None:
            fields.setdefault(sf[0], {})[sf[1]] = name
            prefixes[sf[0]] = prefix
        else:
            unknown.append(name)
    if skipped:
        log.info(
            "%s: skipped %d MTP / vision / KV-cache-scale tensors the text model does not use", where, skipped
        )

    problems: list[str] = []
    plan: dict[str, tuple] = {}

    def check(
        name: str, want_shape: tuple[int, ...] | None, want_dtypes: tuple[torch.dtype, ...], what: str
    ) -> None:
        info, why = infos[name], f" ({what})" if what else ""
        shape_ok = info.shape == want_shape if want_shape is not None else info.shape in ((), (1,))
        if not shape_ok:
            shown = list(want_shape) if want_shape is not None else "[] or [1]"
            problems.append(f"{info.file}: tensor {name} has shape {list(info.shape)}, expected {shown}{why}")
        if info.dtype not in want_dtypes:
            want = "/".join(str(d).removeprefix("torch.") for d in want_dtypes)
            problems.append(
                f"{info.file}: tensor {name} has dtype {str(info.dtype).removeprefix('torch.')}, "
                f"expected {want}{why}"
            )

    for (layer, part), name in sorted(fused.items()):
        e, i, d = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        want = (e, 2 * i, d) if part == "gate_up_proj" else (e, d, i)
        if layer >= cfg.num_hidden_layers:
            unknown.append(name)
            continue
        check(name, want, _DENSE_DTYPES, f"fused experts of layer {layer}")
        projs = ("gate_proj", "up_proj") if part == "gate_up_proj" else ("down_proj",)
        for ex in range(e):
            for j, proj in enumerate(projs):
                canon = f"layers.{layer}.mlp.experts.{ex}.{proj}"
                unknown.extend(fields.pop(canon, {}).values())
                rows = slice(j * i, (j + 1) * i) if part == "gate_up_proj" else slice(None)
                plan[canon] = ("fused", name, ex, rows)

    tied = cfg.tie_word_embeddings and "lm_head" not in fields
    guessed_prefix = _guess_prefix(prefixes)  # for naming missing tensors; once, not per tensor
    for canon, spec in specs.items():
        if canon in plan or (canon == "lm_head" and tied):
            continue
        have = fields.pop(canon, {})
        hf_base = layout.hf_name(prefixes.get(canon, ""), canon, "")
        fmt = quant.scheme_for(hf_base) if quant is not None and spec.linear else None
        if fmt is None:
            want_field = "" if layout.is_bare(canon) else "weight"
            expected = layout.hf_name(prefixes.get(canon, guessed_prefix), canon, want_field)
            if want_field not in have:
                problems.append(f"{where}: missing tensor {expected} (shape {list(spec.shape)})")
                continue
            scales = sorted(f for f in have if f not in (want_field, *_OPTIONAL))
            if spec.linear and scales:
                why = (
                    f"{quant.source} does not quantize it"
                    if quant
                    else "the checkpoint has no quantization config"
                )
                problems.append(
                    f"{where}: linear {hf_base} is stored quantized (has {', '.join(scales)}) but {why}"
                )
                continue
            unknown.extend(v for f, v in have.items() if f != want_field)
            check(have[want_field], spec.shape, _DENSE_DTYPES, "unquantized" if spec.linear else "")
            plan[canon] = ("dense", have[want_field])
            continue
        want_fields = _QUANT_FIELDS[(quant.method, fmt)]
        n, k = spec.shape
        if set(have) == {"weight"} and infos[have["weight"]].dtype in _DENSE_DTYPES:
            problems.append(
                f"{where}: linear {hf_base} is stored unquantized but {quant.source} makes it {fmt}"
            )
            continue
        for f, (dt, shape_fn) in want_fields.items():
            full = layout.hf_name(prefixes.get(canon, guessed_prefix), canon, f)
            if f not in have:
                problems.append(f"{where}: missing tensor {full} ({fmt} linear {hf_base} per {quant.source})")
                continue
            scalar_dtypes = (torch.float32, torch.bfloat16, torch.float16)
            check(
                have[f],
                shape_fn(n, k) if shape_fn else None,
                (dt,) if shape_fn else scalar_dtypes,
                f"{fmt} linear [{n}, {k}] per {quant.source}",
            )
        unknown.extend(v for f, v in have.items() if f not in want_fields and f not in _OPTIONAL)
        plan[canon] = (fmt, quant.method, {f: have[f] for f in want_fields if f in have})
    for have in fields.values():
        unknown.extend(have.values())
    if unknown:
        problems.append(
            f"{where}: {len(unknown)} unexpected tensors not used by a {cfg.model_type} model with "
            f"{cfg.num_hidden_layers} layers and {cfg.num_experts} experts: {', '.join(sorted(unknown)[:8])}"
            + (" ..." if len(unknown) > 8 else "")
        )
    if problems:
        more = f" (and {len(problems) - _MAX_LISTED} more problems)" if len(problems) > _MAX_LISTED else ""
        raise CheckpointError("; ".join(problems[:_MAX_LISTED]) + more)
    return {c: plan[c] for c in specs if c in plan}


def _guess_prefix(prefixes: dict[str, str]) -> str:
    """The prefix most tensors use, to name a missing tensor the way the checkpoint would."""
    seen = [p for c, p in prefixes.items() if c != "lm_head"]
    return max(set(seen), key=seen.count) if seen else layout.PREFIX_TEXT


class _Reader:
    """Reads tensors onto the device and refuses NaN or Inf in every float or FP8 one (weights, norms,
    scales), which would otherwise run and write garbage. Each check is one reduction on the tensor's
    device, no copy and no host sync; `check()` syncs once at the end. Packed NVFP4 codes (uint8) have
    no NaN encoding and are not checked."""

    def __init__(self, tensors: TensorSource, device: torch.device | str) -> None:
        self.tensors, self.device = tensors, device
        self._bad: list[tuple[str, torch.Tensor]] = []  # tensor name, 0-dim bool on the device

    def __call__(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = self.tensors.get(name, self.device, dtype)
        if t.numel() and t.dtype == _F8:
            # e4m3fn has no Inf; NaN is S.1111.111: 0xFF is the uint8 maximum, 0x7F the int8 maximum.
            nan = (t.view(torch.uint8).max() == 0xFF) | (t.view(torch.int8).max() == 0x7F)
            self._bad.append((name, nan))
        elif t.numel() and t.is_floating_point():
            lo, hi = torch.aminmax(t)  # NaN propagates into both; +-Inf is the min or the max
            self._bad.append((name, ~(lo.isfinite() & hi.isfinite())))
        return t

    def check(self) -> None:
        if self._bad and bool(torch.stack([b for _, b in self._bad]).any()):
            name = next(n for n, b in self._bad if bool(b))
            raise CheckpointError(f"{self.tensors.infos[name].file}: tensor {name} contains NaN or Inf")


def _materialize(
    plan: dict[str, tuple], tensors: TensorSource, device: torch.device | str, dtype: torch.dtype
) -> dict[str, Weight]:
    read = _Reader(tensors, device)
    out: dict[str, Weight] = {}
    fused_cache: dict[str, torch.Tensor] = {}
    for canon, step in plan.items():
        kind = step[0]
        if kind == "dense":
            out[canon] = read(step[1], dtype)
        elif kind == "fused":
            _, name, e, rows = step
            if name not in fused_cache:
                fused_cache = {name: read(name, dtype)}  # one layer's experts at a time
            out[canon] = fused_cache[name][e, rows]
        elif kind == NVFP4:
            out[canon] = _nvfp4(canon, step[1], step[2], read)
        else:
            _, _, f = step
            out[canon] = FP8Weight(read(f["weight"]), read(f["weight_scale"], torch.float32).reshape(()))
    read.check()
    if "lm_head" not in out:
        out["lm_head"] = out["embed_tokens"]  # tied embeddings
    return out


def _nvfp4(canon: str, method: str, f: dict[str, str], read: _Reader) -> NVFP4Weight:
    try:
        if method == COMPRESSED_TENSORS:
            packed = read(f["weight_packed"])
            scale = tensor_scale_from_ct_global(read(f["weight_global_scale"], torch.float32))
        else:
            packed = read(f["weight"])
            scale = read(f["weight_scale_2"], torch.float32).reshape(())
        return NVFP4Weight(packed, read(f["weight_scale"]), scale)
    except ValueError as e:
        raise CheckpointError(f"NVFP4 linear {canon}: {e}") from None
