"""`bench run`'s body: build the models, run a workload through the engine (and the peer), lock, report.

The result dict holds figures only when the accuracy lock passed: a failing lock raises
`AccuracyLockError` before anything is returned, so no figure of a wrong run can be written.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from batchinfer.bench import commit_id
from batchinfer.bench.accuracy_lock import MIN_SAMPLE, AccuracyLockError, LockResult, accuracy_lock
from batchinfer.bench.e2e import TokenEngine, measure
from batchinfer.bench.host_copy import HostCopy
from batchinfer.bench.workloads import WorkloadRequests
from batchinfer.checkpoint.loader import Weight, load_checkpoint, read_raw_config
from batchinfer.checkpoint.presets import build_checkpoint
from batchinfer.engine.loader import describe_quantization
from batchinfer.models.config import ModelConfig
from batchinfer.models.qwen_moe import QwenMoeModel

log = logging.getLogger(__name__)


@dataclass(slots=True)
class BenchModel:
    """The weights under test, the engine's model over them and the fp32 reference for the lock."""

    config: ModelConfig
    raw: dict[str, Any]  # the config.json dict
    weights: dict[str, Weight]
    model: QwenMoeModel  # in the engine's dtype
    reference: QwenMoeModel  # fp32; quantized linears shared with `model`, dequantized at each use
    info: dict[str, str]
    host: HostCopy | None = None  # the weights in host memory, made the first time they leave the GPU


def _models(config: ModelConfig, weights: dict[str, Weight], dtype: torch.dtype) -> tuple[QwenMoeModel, ...]:
    """(the model in `dtype`, the fp32 reference): the same model when `dtype` is fp32."""
    model = QwenMoeModel(config, weights, dtype=dtype)
    return model, model if dtype == torch.float32 else QwenMoeModel(config, weights, dtype=torch.float32)


@contextmanager
def weights_off_gpu(bm: BenchModel) -> Iterator[None]:
    """The block runs with the benchmark's weights and models in host memory, so the GPU has the memory a
    production run has (`host_copy` says why); they are back on the GPU after it (not after a block that
    raised: no lock reads that run's output)."""
    device, dtype = bm.model.device, bm.model.dtype
    if device.type != "cuda":
        yield
        return
    if bm.host is None:
        bm.host = HostCopy(bm.weights)
    bm.weights = bm.host.to(torch.device("cpu"))
    bm.model, bm.reference = _models(bm.config, bm.weights, dtype)
    torch.cuda.empty_cache()  # the engine plans its slots on what the driver reports free
    log.info(
        "the benchmark's weights are in host memory while the engine runs (%.1f GiB)", bm.host.nbytes / 2**30
    )
    yield
    bm.weights = bm.host.to(device)
    bm.model, bm.reference = _models(bm.config, bm.weights, dtype)


def build_model(
    *, model_path: str | None, preset: str | None, quant: str, device: torch.device, dtype: torch.dtype
) -> BenchModel:
    """Load a checkpoint folder, or draw a preset's random weights in memory on `device` (no disk)."""
    if model_path is not None:
        raw = read_raw_config(Path(model_path))
        config, weights = load_checkpoint(model_path, device=device, dtype=dtype)
        source = model_path
    else:
        assert preset is not None
        raw, tensors = build_checkpoint(preset, quant=quant, device=str(device))
        config, weights = load_checkpoint(tensors, config=raw, device=device, dtype=dtype)
        del tensors
        source = f"preset {preset} (random weights, seed 0)"
    model, reference = _models(config, weights, dtype)
    info = {
        "model": source,
        "model_type": config.model_type,
        "quantization": describe_quantization(weights, raw),
        "vocab_size": str(config.vocab_size),
    }
    return BenchModel(config, raw, weights, model, reference, info)


def environment(device: torch.device) -> dict[str, str]:
    """Commit, date, device and versions: what a recorded figure needs beside it."""
    return {
        "commit": commit_id(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }


def _run_one(
    engine: TokenEngine,
    requests: WorkloadRequests,
    bench_model: BenchModel,
    device: torch.device,
    lock_sample: int,
) -> tuple[dict[str, Any], LockResult]:
    with weights_off_gpu(bench_model) if engine.owns_weights else nullcontext():
        warmup = getattr(engine, "warmup", None)
        if warmup is not None:  # untimed: one-time compilation is not the engine's steady-state speed
            warmup(requests.prompts, requests.out_lens)
        log.info("running %d requests through %s", len(requests.prompts), engine.describe().get("engine"))
        outputs, figures = measure(engine, requests.prompts, requests.out_lens, device)
    lock = accuracy_lock(bench_model.reference, requests.prompts, outputs, lock_sample)
    return figures, lock


def _lock_error(who: str, lock: LockResult) -> AccuracyLockError:
    details = "; ".join(lock.failures + [r for r in lock.repeats if r.endswith("(degenerate)")])
    return AccuracyLockError(
        f"accuracy lock failed for {who}: {details} (top-1 agreement {lock.top1_agreement:.4f} over "
        f"{lock.positions} tokens of requests {lock.sequences}); no figure recorded"
    )


def run_benchmark(
    engine: TokenEngine,
    bench_model: BenchModel,
    requests: WorkloadRequests,
    device: torch.device,
    *,
    lock_sample: int = MIN_SAMPLE,
    peer: Callable[[], TokenEngine] | None = None,
    peer_requests: WorkloadRequests | None = None,
) -> dict[str, Any]:
    """The result document of one benchmark run (engine, then the peer on `peer_requests`).

    `peer` builds the peer engine; it is called only after the engine's run, so the two never hold GPU
    memory at the same time.

    Raises `AccuracyLockError` when the engine's (or the peer's) output fails the lock.
    """
    figures, lock = _run_one(engine, requests, bench_model, device, lock_sample)
    if not lock.passed:
        raise _lock_error(f"engine {engine.describe().get('engine')}", lock)
    doc: dict[str, Any] = {
        "workload": requests.name,
        "workload_spec": requests.spec,
        "seed": requests.seed,
        "deviations": requests.deviations,
        "capped": requests.capped,
        "model": bench_model.info,
        "engine": engine.describe(),
        "environment": environment(device),
        "results": figures,
        "accuracy_lock": lock.as_dict(),
        "peer": None,
    }
    if peer is not None and peer_requests is not None:
        del engine
        peer = peer()
        peer_figures, peer_lock = _run_one(peer, peer_requests, bench_model, device, lock_sample)
        if not peer_lock.passed:
            raise _lock_error(f"peer {peer.describe().get('engine')}", peer_lock)
        doc["peer"] = {
            "engine": peer.describe(),
            "deviations": peer_requests.deviations,
            "capped": peer_requests.capped,
            "results": peer_figures,
            "accuracy_lock": peer_lock.as_dict(),
        }
    return doc
