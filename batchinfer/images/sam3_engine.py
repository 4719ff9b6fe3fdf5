"""The SAM 3 engine of image jobs: `batchinfer.sam3`'s model behind the job layer's ImageEngine.

`batchinfer segment --model sam3.pt|model.safetensors` uses it by default; `--engine-arg` picks
`batch_size` (images per model call; the model batches their (image, prompt) pairs itself), `device`
(default cuda when there is one, else cpu), `dtype` (default bfloat16 on cuda, float32 on cpu) and
`vit` (`bf16`, the default: the ViT's linears in `dtype`; `fp8`: on E4M3 weights and activations,
`batchinfer/sam3/fp8.py`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from batchinfer.errors import CheckpointError, ConfigError
from batchinfer.images.segmenter import SegmenterEngine

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_engine(
    model_path: str, batch_size: str = "8", device: str = "", dtype: str = "", vit: str = "bf16"
) -> SegmenterEngine:
    """`FACTORY(model_path, **engine_args)` for `--engine batchinfer.images.sam3_engine:load_engine`."""
    from batchinfer.sam3.fp8 import use_fp8_vit
    from batchinfer.sam3.model import Sam3Model

    batch = check_engine_args(batch_size, device, dtype, vit)
    device = _device(device)
    check_model(model_path)  # after the arguments, which need no file
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    model = Sam3Model.from_checkpoint(model_path, device=device, dtype=DTYPES[dtype])
    if vit != "bf16":
        use_fp8_vit(model, mlp_only=vit == "fp8-mlp")
    facts = {
        "engine": "sam3",
        "model": str(model_path),
        "quantization": {
            "bf16": dtype,
            "fp8": f"{dtype}, ViT linears fp8",
            "fp8-mlp": f"{dtype}, ViT MLP linears fp8",
        }[vit],
        "device": device,
        "image_size": str(model.config.image_size),
        "mask_threshold": "0.5",  # sigmoid of the upsampled mask logits (Meta's Sam3Processor)
    }
    return SegmenterEngine(model, facts, batch_size=batch)


def check_engine_args(batch_size: str = "8", device: str = "", dtype: str = "", vit: str = "bf16") -> int:
    """The `--engine-arg` values, checked before a plan records them and again at load (no model, no GPU:
    a plan may be made on a machine without the run's GPU); the batch size."""
    from batchinfer.sam3.fp8 import VIT_MODES

    try:
        batch = int(batch_size)
    except ValueError:
        batch = 0
    if batch < 1:
        raise ConfigError(f"--engine-arg batch_size={batch_size!r}: expected a whole number >= 1")
    if device:
        try:
            torch.device(device)
        except RuntimeError:
            raise ConfigError(
                f"--engine-arg device={device!r}: not a device; expected cpu or cuda[:N]"
            ) from None
    if dtype and dtype not in DTYPES:
        raise ConfigError(f"--engine-arg dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
    if vit not in VIT_MODES:
        raise ConfigError(f"--engine-arg vit={vit!r}: expected one of {', '.join(VIT_MODES)}")
    return batch


load_engine.check_args = check_engine_args  # type: ignore[attr-defined]  # run by jobs.engines.check_args


def check_model(model_path: str) -> None:
    """What the engine needs of --model, also checked before a plan records it: a plan can never run
    without a usable model, and rerunning with another --model is a different job."""
    if not model_path:
        raise ConfigError("the SAM 3 engine needs --model (a sam3.pt or safetensors checkpoint)")
    from batchinfer.sam3.checkpoint import check_checkpoint_file

    try:
        check_checkpoint_file(Path(model_path).expanduser())
    except CheckpointError as e:
        raise ConfigError(f"--model {e}") from None


load_engine.check_model = check_model  # type: ignore[attr-defined]  # run by jobs.engines.check_model


def _device(device: str) -> str:
    """The device to load on (default cuda when there is one), checked before the model is read."""
    if not device:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--engine-arg device={device!r}: torch sees no CUDA GPU on this machine")
    return device
