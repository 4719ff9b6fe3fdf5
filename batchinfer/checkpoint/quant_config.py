"""Which linear of a checkpoint is stored in which format, from its quantization config.

Reads NVIDIA ModelOpt configs (`hf_quant_config.json`, or `config.json:quantization_config` with
`quant_method: modelopt`) and compressed-tensors `nvfp4-pack-quantized` configs, and answers one
question per module: dense, NVFP4 or FP8. Module names are matched the way vLLM does it: fnmatch
wildcards, parent-module prefixes, and tolerance of the `language_model.` part of the prefix.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from batchinfer.errors import CheckpointError

NVFP4, FP8 = "nvfp4", "fp8"
MODELOPT, COMPRESSED_TENSORS = "modelopt", "compressed-tensors"
MODELOPT_ALGOS = {"NVFP4": NVFP4, "W4A16_NVFP4": NVFP4, "FP8": FP8}
MIXED = "MIXED_PRECISION"
CT_FORMAT = "nvfp4-pack-quantized"
HF_QUANT_CONFIG = "hf_quant_config.json"


@dataclass(slots=True)
class QuantConfig:
    """`method` names the tensor layout (ModelOpt or compressed-tensors); `scheme_for` the format
    of each module."""

    method: str
    source: str  # the file the config came from, for error messages
    default: str | None = None  # format of every linear not excluded (None: only `layers` are quantized)
    layers: dict[str, str] = field(
        default_factory=dict
    )  # module pattern -> format (MIXED_PRECISION, CT targets)
    exclude: list[str] = field(default_factory=list)

    _layer_patterns: _Patterns = field(init=False, repr=False, compare=False)
    _exclude_patterns: _Patterns = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._layer_patterns, self._exclude_patterns = _Patterns(list(self.layers)), _Patterns(self.exclude)

    def scheme_for(self, module: str) -> str | None:
        """Format of the linear `module` (its full HF name without `.weight`): NVFP4, FP8 or None (dense)."""
        if self._exclude_patterns.first_match(module) is not None:
            return None
        first = self._layer_patterns.first_match(module)
        return self.default if first is None else self.layers[self._layer_patterns.patterns[first]]


class _Patterns:
    """Module patterns in order; `first_match` finds the first one matching a module. ModelOpt's mixed
    configs list every quantized module by name (30,000 for a 40-layer, 256-expert model), so plain names
    are looked up in a dict and only wildcard and `re:` patterns are tried one by one."""

    def __init__(self, patterns: list[str]) -> None:
        self.patterns = patterns
        self.literal: dict[str, int] = {}
        self.wild: list[int] = []
        for i, p in enumerate(patterns):
            if p.startswith("re:") or any(ch in p for ch in "*?["):
                self.wild.append(i)
            else:
                self.literal.setdefault(p, i)

    def first_match(self, module: str) -> int | None:
        """Index of the first pattern naming `module` or one of its parents, or None."""
        literal = [
            self.literal[q]
            for c in _candidates(module)
            for parts in [c.split(".")]
            for n in range(1, len(parts) + 1)
            if (q := ".".join(parts[:n])) in self.literal
        ]
        best = min(literal, default=None)
        for i in self.wild:
            if best is not None and i > best:
                break
            if _matches(module, self.patterns[i]):
                return i
        return best


def _candidates(module: str) -> set[str]:
    names = {module}
    if module.startswith("model.language_model."):
        names.add("model." + module[len("model.language_model.") :])
        names.add("language_model." + module[len("model.language_model.") :])
    elif module.startswith("model."):
        names.add("model.language_model." + module[len("model.") :])
    names.add(re.sub(r"^model\.(language_model\.)?", "", module))
    return names


def _matches(module: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        rx = re.compile(pattern[3:])
        return any(rx.match(c) for c in _candidates(module))
    return any(fnmatchcase(c, pattern) or c.startswith(pattern + ".") for c in _candidates(module))


def read_quant_config(raw_config: dict[str, Any] | None, folder: Path | None) -> QuantConfig | None:
    """The checkpoint's quantization config, or None for a plain BF16/FP16/FP32 checkpoint.

    `hf_quant_config.json` in `folder` wins over `config.json:quantization_config` (ModelOpt writes both).
    """
    if folder is not None and (folder / HF_QUANT_CONFIG).is_file():
        file = folder / HF_QUANT_CONFIG
        try:
            doc = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file}: not valid JSON ({e})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("quantization"), dict):
            raise CheckpointError(f"{file}: expected an object with a 'quantization' object")
        return _modelopt(doc["quantization"], str(file))
    qc = (raw_config or {}).get("quantization_config")
    if not qc:
        return None
    file = folder / "config.json" if folder else "config"
    if not isinstance(qc, dict):
        raise CheckpointError(f"{file}: quantization_config is {_shown(qc)}, expected an object")
    source = f"{file}:quantization_config"
    method = qc.get("quant_method")
    if method == MODELOPT:
        return _modelopt(qc, source)
    if method == COMPRESSED_TENSORS:
        return _compressed_tensors(qc, source)
    raise CheckpointError(
        f"{source}: quant_method {method!r} is not supported; supported: {MODELOPT} "
        f"({', '.join([*MODELOPT_ALGOS, MIXED])}) and {COMPRESSED_TENSORS} ({CT_FORMAT})"
    )


def _shown(value: Any) -> str:
    """`a str ('nvfp4')`: the JSON type and value of a wrongly typed field, for error messages."""
    text = repr(value)
    return f"a {type(value).__name__} ({text if len(text) <= 60 else text[:57] + '...'})"


def _object(value: Any, source: str, key: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CheckpointError(f"{source}: {key} is {_shown(value)}, expected an object")
    return value


def _names(value: Any, source: str, key: str) -> list[str]:
    """A list of module names or patterns; a bare string is refused rather than read as a list of letters."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CheckpointError(
            f"{source}: {key} is {_shown(value)}, expected a list of module names (strings)"
        )
    for v in value:
        if v.startswith("re:"):
            try:
                re.compile(v[3:])
            except re.error as e:
                raise CheckpointError(f"{source}: {key} pattern {v!r} is not a valid regex ({e})") from None
    return value


def _modelopt_algo(algo: Any, group_size: Any, source: str, where: str) -> str:
    if not isinstance(algo, str) or algo not in MODELOPT_ALGOS:
        raise CheckpointError(
            f"{source}: {where}quant_algo {algo!r} is not supported; "
            f"supported: {', '.join([*MODELOPT_ALGOS, MIXED])}"
        )
    if MODELOPT_ALGOS[algo] == NVFP4 and group_size not in (None, 16):
        raise CheckpointError(
            f"{source}: {where}{algo} group_size {group_size!r} is not supported; expected 16"
        )
    return MODELOPT_ALGOS[algo]


def _modelopt(q: dict[str, Any], source: str) -> QuantConfig:
    algo = q.get("quant_algo")
    key = "exclude_modules" if q.get("exclude_modules") else "ignore"
    exclude = _names(q.get(key), source, key)
    if algo == MIXED:
        layers_raw = q.get("quantized_layers")
        if not isinstance(layers_raw, dict):
            raise CheckpointError(f"{source}: quant_algo {MIXED} needs a 'quantized_layers' object")
        _names(list(layers_raw), source, "quantized_layers")  # checks its `re:` keys
        layers: dict[str, str] = {}
        for name, entry in layers_raw.items():
            where = f"quantized_layers[{name!r}]"
            entry = _object(entry, source, where)
            layers[name] = _modelopt_algo(
                entry.get("quant_algo"), entry.get("group_size"), source, where + " "
            )
        return QuantConfig(MODELOPT, source, None, layers, exclude)
    return QuantConfig(MODELOPT, source, _modelopt_algo(algo, q.get("group_size"), source, ""), {}, exclude)


def _compressed_tensors(q: dict[str, Any], source: str) -> QuantConfig:
    fmt = q.get("format")
    groups = q.get("config_groups") or {}
    if not groups:
        raise CheckpointError(f"{source}: compressed-tensors config has no 'config_groups'")
    _object(groups, source, "config_groups")
    layers: dict[str, str] = {}
    default = None
    for gname, group in groups.items():
        group = _object(group, source, f"config_groups[{gname!r}]")
        gfmt = group.get("format") or fmt
        w = _object(group.get("weights") or {}, source, f"config_groups[{gname!r}].weights")
        nvfp4 = (
            w.get("num_bits") == 4
            and w.get("type") == "float"
            and w.get("strategy") == "tensor_group"
            and w.get("group_size") == 16
        )
        if gfmt != CT_FORMAT or not nvfp4:
            raise CheckpointError(
                f"{source}: config_groups[{gname!r}] (format {gfmt!r}, weights num_bits={w.get('num_bits')} "
                f"type={w.get('type')} strategy={w.get('strategy')} group_size={w.get('group_size')}) is not "
                f"supported; supported: format {CT_FORMAT} with 4-bit float tensor_group weights, "
                "group_size 16"
            )
        for target in _names(group.get("targets"), source, f"config_groups[{gname!r}].targets"):
            if target == "Linear":
                default = NVFP4
            else:
                layers[target] = NVFP4
    return QuantConfig(COMPRESSED_TENSORS, source, default, layers, _names(q.get("ignore"), source, "ignore"))
