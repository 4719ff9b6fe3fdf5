"""`bench run`'s body: build the models, run a workload through the engine (and the peer), lock, report.

The result dict holds figures only when the accuracy lock passed: a failing lock raises
`AccuracyLockError` before anything is returned, so no figure of a wrong run can be written.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from batchinfer.bench import commit_id, host_copy
from batchinfer.bench.accuracy_lock import MIN_SAMPLE, AccuracyLockError, LockResult, accuracy_lock
from batchinfer.bench.e2e import TokenEngine, measure
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
    dtype: torch.dtype  # the engine model's
    info: dict[str, str]
    # (the model in `dtype`, the fp32 reference; quantized linears shared, dequantized at each use); None
    # while the weights are in host memory (`weights_off_gpu`)
    models: tuple[QwenMoeModel, QwenMoeModel] | None = field(default=None, init=False)
    host: host_copy.HostCopy | None = field(default=None, init=False)  # made when they first leave the GPU

    def __post_init__(self) -> None:
        self.build_models()

    def build_models(self) -> None:
        model = QwenMoeModel(self.config, self.weights, dtype=self.dtype)
        fp32 = self.dtype == torch.float32
        self.models = model, model if fp32 else QwenMoeModel(self.config, self.weights, dtype=torch.float32)

    def _models(self) -> tuple[QwenMoeModel, QwenMoeModel]:
        if self.models is None:
            raise RuntimeError("the benchmark's weights are in host memory (inside weights_off_gpu)")
        return self.models

    @property
    def model(self) -> QwenMoeModel:
        return self._models()[0]

    @property
    def reference(self) -> QwenMoeModel:
        return self._models()[1]


def _host_can_hold(bm: BenchModel) -> bool:
    """Whether the weights' host copy exists or fits (under 90% of the host's available memory)."""
    if bm.host is not None:
        return True
    need, room = host_copy.nbytes(bm.weights), host_copy.host_available()
    if room is None or need <= 0.9 * room:
        return True
    log.warning(
        "the benchmark's weights stay on the GPU: their host copy needs %.1f GiB, %.1f GiB available",
        need / 2**30,
        room / 2**30,
    )
    return False


@contextmanager
def weights_off_gpu(bm: BenchModel, move: bool = True) -> Iterator[str]:
    """With `move`, the block runs with the benchmark's weights in host memory and its models dropped, so
    the GPU has the memory a production run has (`host_copy` says why); they are back on the GPU after it
    (not after a block that raised: no lock reads that run's output). Nothing moves off a CPU, nor where
    the host cannot hold them (fewer slots, but no host out-of-memory). Yields where the weights are
    during the block: "host memory", or their device."""
    device = bm.model.device
    if not move or device.type != "cuda" or not _host_can_hold(bm):
        yield device.type
        return
    if bm.host is None:
        bm.host = host_copy.HostCopy(bm.weights)
    before = torch.cuda.mem_get_info(device)[0]
    bm.weights, bm.models = bm.host.to(torch.device("cpu")), None
    torch.cuda.empty_cache()  # the engine plans its slots on what the driver reports free
    freed = torch.cuda.mem_get_info(device)[0] - before
    log.info("the benchmark's weights wait in host memory: %.1f GiB of the GPU freed", freed / 2**30)
    yield "host memory"
    bm.weights = bm.host.to(device)
    bm.build_models()


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
    info = {
        "model": source,
        "model_type": config.model_type,
        "quantization": describe_quantization(weights, raw),
        "vocab_size": str(config.vocab_size),
    }
    return BenchModel(config, raw, weights, dtype, info)


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
    off_gpu: bool,
) -> tuple[dict[str, Any], LockResult]:
    with weights_off_gpu(bench_model, off_gpu) as weights_at:
        warmup = getattr(engine, "warmup", None)
        if warmup is not None:  # untimed: one-time compilation is not the engine's steady-state speed
            warmup(requests.prompts, requests.out_lens)
        log.info("running %d requests through %s", len(requests.prompts), engine.describe().get("engine"))
        outputs, figures = measure(engine, requests.prompts, requests.out_lens, device)
    figures["benchmark_weights_during_run"] = weights_at  # the reference's: they bound the engine's memory
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
    # the weights leave the GPU only while no engine of this run reads them (the reference engine reads
    # them, and it outlives its run in the caller)
    off_gpu = engine.owns_weights
    figures, lock = _run_one(engine, requests, bench_model, device, lock_sample, off_gpu)
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
        peer_figures, peer_lock = _run_one(
            peer, peer_requests, bench_model, device, lock_sample, off_gpu and peer.owns_weights
        )
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
