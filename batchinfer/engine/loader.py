"""`load_engine`: a checkpoint folder -> a ready `TextEngine` (model weights, tokenizer, device, dtype)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from batchinfer.checkpoint.loader import load_checkpoint, model_config_from_hf, read_raw_config
from batchinfer.checkpoint.safetensors_io import TensorSource
from batchinfer.engine.fast import (
    MAX_SLOTS,
    PREFILL_GRAPH_TOKENS,
    PREFILL_TOKENS,
    REFILL_FRACTION,
    FastGenerator,
)
from batchinfer.engine.gpu import FastEngine
from batchinfer.engine.kernel_model import STATE_DTYPES, KernelModel
from batchinfer.engine.reference import DEFAULT_MAX_BATCH_SIZE, ReferenceEngine, context_limit
from batchinfer.errors import ConfigError
from batchinfer.kernels.kv_cache import KV_DTYPES
from batchinfer.kernels.nvfp4 import FP8Weight, NVFP4Weight
from batchinfer.models.qwen_moe import QwenMoeModel
from batchinfer.tokenizer import Tokenizer

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_STORED = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def resolve_device(device: str) -> torch.device:
    """`auto` -> the first CUDA GPU if there is one, else the CPU; anything else as torch spells it."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"device {device!r} is not a device; expected auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} asked for, but torch sees no CUDA GPU on this machine")
    return dev


def describe_quantization(weights: dict[str, object], raw_config: dict[str, object]) -> str:
    """nvfp4 / fp8 / mixed (both) as loaded; an unquantized checkpoint reports its stored dtype."""
    kinds = {type(w) for w in weights.values()} & {NVFP4Weight, FP8Weight}
    if kinds == {NVFP4Weight, FP8Weight}:
        return "mixed"
    if kinds:
        return "nvfp4" if NVFP4Weight in kinds else "fp8"
    text = raw_config.get("text_config") if isinstance(raw_config.get("text_config"), dict) else {}
    stored = (
        raw_config.get("dtype")
        or raw_config.get("torch_dtype")
        or text.get("dtype")
        or text.get("torch_dtype")
    )
    return _STORED.get(str(stored), "bf16")


def _as_int(name: str, value: int | str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"engine argument {name}={value!r} is not an integer") from None


def _as_float(name: str, value: float | str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"engine argument {name}={value!r} is not a number") from None


def _as_bool(name: str, value: bool | str) -> bool:
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in ("true", "1", "yes"):
        return True
    if word in ("false", "0", "no"):
        return False
    raise ConfigError(f"engine argument {name}={value!r}: expected true or false")


@dataclass(frozen=True, slots=True)
class _Options:
    """`load_engine`'s arguments parsed (the job layer passes strings)."""

    engine: str
    dtype: str | torch.dtype | None
    max_model_len: int | None
    max_batch_size: int
    max_slots: int
    deltanet_state: str
    kv_cache: str
    bf16_experts: bool
    prefill_tokens: int
    refill_fraction: float
    prefill_graph_tokens: int


def _parse_args(
    engine: str,
    dtype: str | torch.dtype | None,
    max_model_len: int | str | None,
    max_batch_size: int | str,
    max_slots: int | str,
    deltanet_state: str,
    kv_cache: str,
    bf16_experts: bool | str,
    prefill_tokens: int | str,
    refill_fraction: float | str,
    prefill_graph_tokens: int | str,
) -> _Options:
    """Each argument parsed and in its range, whatever the engine and device."""
    if engine not in ("auto", "fast", "reference"):
        raise ConfigError(f"engine argument engine={engine!r}: expected auto, fast or reference")
    if dtype is not None and not isinstance(dtype, torch.dtype) and dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported; expected one of {sorted(DTYPES)}")
    if deltanet_state not in STATE_DTYPES:
        raise ConfigError(
            f"engine argument deltanet_state={deltanet_state!r}: expected one of {', '.join(STATE_DTYPES)}"
        )
    if kv_cache not in KV_DTYPES:
        raise ConfigError(f"engine argument kv_cache={kv_cache!r}: expected one of {', '.join(KV_DTYPES)}")
    opts = _Options(
        engine=engine,
        dtype=dtype,
        max_model_len=None if max_model_len in (None, "") else _as_int("max_model_len", max_model_len),
        max_batch_size=_as_int("max_batch_size", max_batch_size),
        max_slots=_as_int("max_slots", max_slots),
        deltanet_state=deltanet_state,
        kv_cache=kv_cache,
        bf16_experts=_as_bool("bf16_experts", bf16_experts),
        prefill_tokens=_as_int("prefill_tokens", prefill_tokens),
        refill_fraction=_as_float("refill_fraction", refill_fraction),
        prefill_graph_tokens=_as_int("prefill_graph_tokens", prefill_graph_tokens),
    )
    if opts.prefill_graph_tokens < 0:
        raise ConfigError(f"engine argument prefill_graph_tokens={opts.prefill_graph_tokens} must be >= 0")
    for name in ("max_batch_size", "max_slots", "prefill_tokens"):
        if getattr(opts, name) < 1:
            raise ConfigError(f"engine argument {name}={getattr(opts, name)} must be >= 1")
    if not 0 < opts.refill_fraction <= 1:
        raise ConfigError(f"engine argument refill_fraction={opts.refill_fraction} must be in (0, 1]")
    return opts


def _check_fit(opts: _Options, fast: bool) -> None:
    """The options of one engine refused for the other."""
    for name, value, default in (
        ("deltanet_state", opts.deltanet_state, "float32"),
        ("kv_cache", opts.kv_cache, "bfloat16"),
    ):
        if value != default and not fast:
            raise ConfigError(f"engine argument {name}={value} applies to the fast engine (engine=fast)")
    if opts.bf16_experts and not fast:
        raise ConfigError("engine argument bf16_experts=true applies to the fast engine (engine=fast)")
    if not fast and (opts.prefill_tokens, opts.refill_fraction, opts.prefill_graph_tokens) != (
        PREFILL_TOKENS,
        REFILL_FRACTION,
        PREFILL_GRAPH_TOKENS,
    ):
        raise ConfigError(
            "engine arguments prefill_tokens, refill_fraction and prefill_graph_tokens apply to the fast "
            "engine (engine=fast)"
        )
    if fast and opts.dtype not in (None, "bfloat16", "bf16", torch.bfloat16):
        raise ConfigError(
            f"the fast engine computes in bfloat16; dtype={opts.dtype!r} needs engine=reference"
        )


def check_engine_args(
    device: str = "auto",
    dtype: str | None = None,
    max_model_len: str | None = None,
    max_batch_size: str = str(DEFAULT_MAX_BATCH_SIZE),
    engine: str = "auto",
    max_slots: str = str(MAX_SLOTS),
    deltanet_state: str = "float32",
    kv_cache: str = "bfloat16",
    bf16_experts: str = "false",
    prefill_tokens: str = str(PREFILL_TOKENS),
    refill_fraction: str = str(REFILL_FRACTION),
    prefill_graph_tokens: str = str(PREFILL_GRAPH_TOKENS),
) -> None:
    """`load_engine`'s `--engine-arg` values checked without the model or a GPU, before a plan records
    them (a value the run would refuse otherwise needs `--force-new-plan` to correct). A plan may be made
    on a machine without the GPU its run gets: the device is checked for its spelling only, and the
    options of one engine are refused for the other only where `engine` or `device` names it (`auto` on
    `auto` picks at load)."""
    opts = _parse_args(
        engine, dtype, max_model_len, max_batch_size, max_slots, deltanet_state, kv_cache, bf16_experts,
        prefill_tokens, refill_fraction, prefill_graph_tokens,
    )  # fmt: skip
    kind = None
    if device != "auto":
        try:
            kind = torch.device(device).type
        except RuntimeError:
            raise ConfigError(
                f"device {device!r} is not a device; expected auto, cpu, cuda or cuda:N"
            ) from None
    if engine == "fast" and kind is not None:
        _check_fast_device(device, kind)
    if engine != "auto" or kind is not None:  # auto on a named device: fast exactly on cuda
        _check_fit(opts, engine == "fast" or (engine == "auto" and kind == "cuda"))


def _check_fast_device(device: str, kind: str) -> None:
    if kind != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(
            f"engine=fast runs Triton kernels and needs a CUDA device, got device {device!r} "
            "(engine=reference runs anywhere; TRITON_INTERPRET=1 interprets the kernels on a CPU, for tests)"
        )


def load_engine(
    model_path: str | Path,
    device: str = "auto",
    dtype: str | torch.dtype | None = None,
    max_model_len: int | str | None = None,
    max_batch_size: int | str = DEFAULT_MAX_BATCH_SIZE,
    engine: str = "auto",
    max_slots: int | str = MAX_SLOTS,
    deltanet_state: str = "float32",
    kv_cache: str = "bfloat16",
    bf16_experts: bool | str = False,
    prefill_tokens: int | str = PREFILL_TOKENS,
    refill_fraction: float | str = REFILL_FRACTION,
    prefill_graph_tokens: int | str = PREFILL_GRAPH_TOKENS,
) -> ReferenceEngine:
    """Load a checkpoint folder onto `device` and wrap it in an engine.

    `engine`: `fast` (our kernels, slots and CUDA graphs; bf16; the default on a CUDA device),
    `reference` (plain PyTorch; the default on the CPU) or `auto`.
    `dtype` (reference engine): activation and dense-weight dtype; default float32 on CPU (bit-stable
    yardstick) and bfloat16 on GPU. `max_model_len` lowers the context limit below
    `max_position_embeddings`. `max_batch_size` is the reference engine's batch, `max_slots` the fast
    engine's cap on concurrent sequences (it also fits them to free memory). `deltanet_state` (fast
    engine, Qwen3.5/3.6): `float32` (the checkpoints' own), `bfloat16` or `float16` recurrent state.
    `kv_cache` (fast engine): `bfloat16` or `fp8` (E4M3 with a scale per token and head: half the KV bytes).
    `bf16_experts` (fast engine): keep the NVFP4 experts decoded to bf16 from load time, so prefill passes
    skip their decode (the same outputs, 3.6x the experts' bytes: fewer slots; for prefill-bound jobs).
    `prefill_tokens` and `refill_fraction` (fast engine): prompt tokens a prefill pass, and the fraction
    of the slots that must be free before waiting prompts are prefilled; `prefill_graph_tokens` (fast
    engine): a lone fresh prompt of up to that many tokens is prefilled by a CUDA graph, 0 never
    (`engine.fast`).
    The job layer passes its `--engine-arg KEY=VALUE` strings straight in, so numbers may be strings.
    """
    path = Path(model_path)
    opts = _parse_args(
        engine, dtype, max_model_len, max_batch_size, max_slots, deltanet_state, kv_cache, bf16_experts,
        prefill_tokens, refill_fraction, prefill_graph_tokens,
    )  # fmt: skip
    dev = resolve_device(device)
    fast = engine == "fast" or (engine == "auto" and dev.type == "cuda")
    if fast:
        _check_fast_device(device, dev.type)
    try:
        _check_fit(opts, fast)
    except ConfigError as e:
        if engine != "auto":
            raise
        raise ConfigError(f"{e}; engine=auto picks the reference engine on {dev}: not a GPU") from None
    if fast:
        torch_dtype = torch.bfloat16
    elif dtype is None:
        torch_dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    else:
        torch_dtype = dtype if isinstance(dtype, torch.dtype) else DTYPES[dtype]
    started = time.perf_counter()
    raw = read_raw_config(path)
    config = model_config_from_hf(raw, source=str(path / "config.json"))
    context_limit(config, opts.max_model_len, str(path))  # these fail fast, before the weights load
    tokenizer = Tokenizer.from_pretrained(path)
    _, weights = load_checkpoint(path, config=config, device=dev, dtype=torch_dtype)
    quantization = describe_quantization(weights, raw)
    if fast:
        QwenMoeModel(config, weights, dtype=torch_dtype)  # the same checks of names and shapes
        kernel_model = KernelModel(
            config,
            weights,
            deltanet_state=STATE_DTYPES[deltanet_state],
            kv_cache=KV_DTYPES[kv_cache],
            bf16_experts=opts.bf16_experts,
        )
        generator = FastGenerator(
            kernel_model,
            max_slots=opts.max_slots,
            prefill_tokens=opts.prefill_tokens,
            refill_fraction=opts.refill_fraction,
            prefill_graph_tokens=opts.prefill_graph_tokens,
        )
        del weights
        # the state options change outputs too: recorded with the weights' format
        extras = [f"KV cache {kv_cache}"] * (kv_cache != "bfloat16")
        extras += [f"DeltaNet state {deltanet_state}"] * (deltanet_state != "float32")
        quantization = ", ".join([quantization, *extras])
        log.info(
            "loaded %s (%s, %s) on %s for the fast engine in %.1f s",
            path,
            config.model_type,
            quantization,
            dev,
            time.perf_counter() - started,
        )
        return FastEngine(generator, tokenizer, str(path), quantization, opts.max_model_len)
    model = QwenMoeModel(config, weights, dtype=torch_dtype)
    log.info(
        "loaded %s (%s, %s) on %s as %s in %.1f s",
        path,
        config.model_type,
        quantization,
        dev,
        str(torch_dtype).removeprefix("torch."),
        time.perf_counter() - started,
    )
    return ReferenceEngine(
        model,
        tokenizer,
        model_path=str(path),
        quantization=quantization,
        max_model_len=opts.max_model_len,
        max_batch_size=opts.max_batch_size,
    )


def check_model(model_path: str | Path) -> None:
    """What `load_engine` reads before the weights (config.json, the tokenizer, the safetensors headers),
    without loading a tensor."""
    path = Path(model_path)
    model_config_from_hf(read_raw_config(path), source=str(path / "config.json"))
    Tokenizer.from_pretrained(path)
    TensorSource.from_path(path).close()


load_engine.check_args = check_engine_args  # type: ignore[attr-defined]  # run by jobs.engines.check_args
load_engine.check_model = check_model  # type: ignore[attr-defined]  # run by jobs.engines.check_model
