"""SAM 3 checkpoints in Meta's key layout: loading (`sam3.pt`, SAM 3.1's detector, safetensors) and
writing seeded random ones.

Meta's `sam3.pt` is one flat state dict (optionally under "model") whose image-model keys start with
`detector.`; `tracker.*` (the video tracker) is ignored here. SAM 3.1's `sam3.1_multiplex.pt` keeps
the same detector keys (older exports spell the prefix `sam3_model.`, which Meta's multiplex builder
remaps) but its neck has three levels: `convs.3` (the 0.5 level the image path discards anyway) is
absent and the extra `interactive_convs` / `propagation_convs` sets are ignored. ViT `attn.freqs_cis`
buffers, if stored, are ignored: we recompute RoPE. Any other missing or misshaped tensor is a
`CheckpointError` naming it. Safetensors files use the same keys; ours carry the `Sam3Config` as JSON
in the metadata field "sam3_config" so a tiny model loads without being told its shapes.
"""

from __future__ import annotations

import json
import logging
import math
import zlib
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor

from batchinfer.errors import CheckpointError
from batchinfer.sam3.config import Sam3Config

logger = logging.getLogger(__name__)

PREFIXES = ("detector.", "sam3_model.")
CONFIG_METADATA_KEY = "sam3_config"
# Present in Meta's checkpoints, absent from (or unused by) our image model.
IGNORED_MARKERS = (".attn.freqs_cis", ".sam2_convs.", ".interactive_convs.", ".propagation_convs.")
# Allowed to be missing (SAM 3.1's three-level neck); zero-filled because nothing reads them.
OPTIONAL_PREFIX = "backbone.vision_backbone.convs.3."


def expected_shapes(config: Sam3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of the image model, Meta's name (without `detector.`) -> shape; built on meta."""
    from batchinfer.sam3.model import Sam3Model

    with torch.device("meta"):
        model = Sam3Model(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def folder_problem(path: Path) -> str | None:
    """What is wrong with a folder given as the checkpoint (naming the checkpoint files in it), or None."""
    if not path.is_dir():
        return None
    found = sorted(p.name for p in path.iterdir() if p.suffix in (".pt", ".safetensors"))[:3]
    return (
        f"{path}: is a folder; expected a SAM 3 checkpoint file (Meta's sam3.pt or sam3.1_multiplex.pt, "
        f"or a .safetensors file){'; it holds ' + ', '.join(found) if found else ''}"
    )


def _check_file(path: Path) -> None:
    problem = folder_problem(path)
    if problem:
        raise CheckpointError(problem)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")


def _read_raw(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    _check_file(path)
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # pickle/zip errors of a corrupt or non-checkpoint file
        raise CheckpointError(f"{path}: not a readable torch checkpoint ({e})") from e
    if isinstance(raw, dict) and isinstance(raw.get("model"), dict):
        raw = raw["model"]
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a state dict, found {type(raw).__name__}")
    return {k: v for k, v in raw.items() if isinstance(v, Tensor)}, {}


def _no_detector(path: Path, keys: Iterable[str]) -> CheckpointError:
    sample = ", ".join(sorted(keys)[:3]) or "none"
    return CheckpointError(
        f"{path}: no SAM 3 detector tensors (keys starting with 'detector.'); first keys found: {sample}"
        " (Hugging Face transformers' 'detector_model.*' layout is not supported)"
    )


def check_checkpoint_file(path: Path) -> None:
    """The checks of `load_sam3_state_dict` that need only the file's tensor names, for a plan to make
    before it records the model: a folder, a missing file, a file that is no checkpoint, one without the
    detector's tensors (a Qwen checkpoint)."""
    _check_file(path)
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        try:  # the header only
            with safe_open(str(path), framework="pt") as f:
                keys = list(f.keys())
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e
    else:
        keys = list(_read_raw(path)[0])  # mapped, not read: torch.load(mmap=True)
    if not any(k.startswith(PREFIXES) for k in keys):
        raise _no_detector(path, keys)


def _stored_config(path: Path, stored: str) -> Sam3Config:
    where = f"{path}: {CONFIG_METADATA_KEY} metadata"
    try:
        raw = json.loads(stored)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{where} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(
            f"{where} is a {type(raw).__name__}, expected a JSON object of Sam3Config fields"
        )
    try:
        return Sam3Config.from_dict(raw)
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None


def load_sam3_state_dict(
    path: str | Path, config: Sam3Config | None = None
) -> tuple[dict[str, Tensor], Sam3Config]:
    """Read and validate a checkpoint -> (state dict keyed like `Sam3Model.state_dict()`, config).

    `config` defaults to the one stored in our safetensors metadata, else the real SAM 3 shapes."""
    path = Path(path)
    raw, metadata = _read_raw(path)
    if config is None:
        stored = metadata.get(CONFIG_METADATA_KEY)
        config = Sam3Config.real() if stored is None else _stored_config(path, stored)
    state: dict[str, Tensor] = {}
    for key, tensor in raw.items():
        prefix = next((p for p in PREFIXES if key.startswith(p)), None)
        if prefix is not None:
            state[key[len(prefix) :]] = tensor
    if not state:
        raise _no_detector(path, raw)
    expected = expected_shapes(config)
    ignored = [k for k in state if k not in expected and any(m in f".{k}" for m in IGNORED_MARKERS)]
    unexpected = sorted(k for k in state if k not in expected and k not in ignored)
    for key in ignored:
        del state[key]
    if unexpected:
        logger.warning(
            "%s: %d tensors not used by the image model, e.g. %s", path, len(unexpected), unexpected[:3]
        )
        for key in unexpected:
            del state[key]
    missing = sorted(k for k in expected if k not in state and not k.startswith(OPTIONAL_PREFIX))
    if missing:
        raise CheckpointError(
            f"{path}: {len(missing)} tensors missing, e.g. "
            + ", ".join(f"detector.{k} (expected shape {expected[k]})" for k in missing[:2])
            + f"; expected the layout of {'the real SAM 3' if config == Sam3Config.real() else 'this'} config"
        )
    for key, shape in expected.items():
        if key not in state:
            logger.info("%s: detector.%s absent (SAM 3.1 neck); unused by the image path", path, key)
            state[key] = torch.zeros(shape)
        elif tuple(state[key].shape) != shape:
            raise CheckpointError(
                f"{path}: tensor detector.{key} has shape {tuple(state[key].shape)}, expected {shape}"
            )
        elif not state[key].is_floating_point():
            raise CheckpointError(
                f"{path}: tensor detector.{key} has dtype {state[key].dtype}, expected float"
            )
    return state, config


def _random_tensor(key: str, shape: tuple[int, ...], seed: int) -> Tensor:
    """A deterministic function of (key, shape, seed), so the file does not depend on key order.

    Norm weights are 1; biases and norm biases N(0, 0.02^2); position and token embeddings N(0, 0.02^2)
    (open_clip's init); other embeddings N(0, 1) (nn.Embedding's default, which Meta keeps for queries
    and reference boxes); weights N(0, 1/fan_in) so activations keep their scale through 32 blocks."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    noise = torch.randn(shape, generator=gen)
    module, name = key.rsplit(".", 1)
    if len(shape) == 1:
        is_norm = any(t in module.rsplit(".", 1)[-1] for t in ("norm", "ln_")) or ".norms." in f".{module}."
        return torch.ones(shape) if is_norm and name == "weight" else noise * 0.02
    if name in ("pos_embed", "positional_embedding") or module.endswith("token_embedding"):
        return noise * 0.02
    if (
        module.endswith(("_embed", "reference_points", "presence_token"))
        and name == "weight"
        and len(shape) == 2
    ):
        return noise
    if name == "text_projection" or ".dconv_2x2" in f".{module}":
        fan_in = shape[0]  # used as x @ P; ConvTranspose2d weights are [in, out, k, k]
    else:
        fan_in = math.prod(shape[1:])
    return noise / math.sqrt(fan_in)


def random_sam3_state_dict(config: Sam3Config, seed: int) -> dict[str, Tensor]:
    """float32 tensors for every detector key (with the `detector.` prefix), seeded."""
    return {f"detector.{k}": _random_tensor(k, s, seed) for k, s in expected_shapes(config).items()}


def write_random_sam3(out_path: str | Path, config: Sam3Config, seed: int) -> Path:
    """Write a seeded random SAM 3 checkpoint in Meta's layout; `.safetensors` or else a `torch.save`
    flat dict like `sam3.pt` (detector keys only). Returns the path written."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    state = random_sam3_state_dict(config, seed)
    tmp = out_path.with_name(out_path.name + ".tmp")
    if out_path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(state, str(tmp), metadata={CONFIG_METADATA_KEY: config.to_json(), "seed": str(seed)})
    else:
        torch.save(state, tmp)
    tmp.replace(out_path)
    logger.info("wrote %s: %d tensors, seed %d", out_path, len(state), seed)
    return out_path
