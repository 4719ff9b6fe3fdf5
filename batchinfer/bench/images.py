"""`bench images`: the SAM 3 image workloads of workloads.json end to end, with the accuracy lock and
Meta's reference implementation as the peer (docs/PERF_IMAGES.md).

The images are drawn exactly as the file's "sam" rule says and encoded once as PNG (lossless, so the
model sees the drawn pixels bit for bit); encoding is not timed. The timed run is the image job's own
pipeline (`batchinfer.images.task`): PNG bytes decoded on CPU threads, the model in batches, masks to
COCO RLE, rows to one Parquet file. A short untimed warm-up on the first images comes first (CUDA
context, kernel selection), so figures are steady-state throughput.

Accuracy lock: on a sample of the same images, the fast path (the model in its run dtype) and the
fp32 reference (same weights, TF32 off) are compared over *every* query of every (image, prompt)
pair, not only those above the score threshold (random weights put no query above 0.5): masks at the
original size (upsampled logit > 0, i.e. sigmoid > 0.5), scores sigmoid(logit) * sigmoid(presence),
boxes xyxy clamped to the image. Bounds below; a failing lock raises `ImageLockError`, so no figure
of a wrong run is returned.
"""

from __future__ import annotations

import io
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from batchinfer.bench.breakdown import format_profile, profile_kernels
from batchinfer.bench.e2e import peak_memory
from batchinfer.bench.workload_run import environment
from batchinfer.bench.workloads import load_workloads
from batchinfer.errors import BatchinferError, ConfigError
from batchinfer.images import decode, task
from batchinfer.images.segmenter import SegmenterEngine
from batchinfer.sam3.decoder import box_cxcywh_to_xyxy
from batchinfer.sam3.model import Sam3Model
from batchinfer.sam3.postprocess import preprocess_image

log = logging.getLogger(__name__)

DEFAULT_SCORE_THRESHOLD = task.DEFAULT_SCORE_THRESHOLD
# Lock bounds, fast path vs fp32 reference, over all queries of the sampled pairs. Set before the first
# H200 run from the bf16 budget (relative error ~1e-2 per op): scores are sigmoid products in [0, 1],
# boxes are in units of the image side (0.01 = 10 px on a 1008 px side).
LOCK_MIN_MASK_IOU = 0.95  # mean over queries whose masks are non-empty in either run
LOCK_SCORE_MEAN = 0.01
LOCK_SCORE_MAX = 0.05
LOCK_BOX_MEAN = 0.005
LOCK_BOX_MAX = 0.05
MIN_LOCK_IMAGES = 2

ROW_SCHEMA = pa.schema(
    [
        ("image", pa.int64()),
        ("height", pa.int32()),
        ("width", pa.int32()),
        ("prompt", pa.string()),
        ("prompt_index", pa.int32()),
        ("instance", pa.int32()),
        ("score", pa.float32()),
        ("presence_score", pa.float32()),
        ("box", pa.list_(pa.float32(), 4)),
        ("mask_rle", pa.string()),
        ("area", pa.int64()),
        ("error", pa.string()),
    ]
)


class ImageLockError(BatchinferError):
    """The fast path's output differs from the fp32 reference beyond the documented bounds."""


@dataclass(slots=True)
class ImageWorkload:
    name: str
    spec: dict[str, Any]
    seed: int
    images: list[np.ndarray]  # uint8 [H, W, 3], drawn per the "sam" rule
    prompts: list[list[str]]
    deviations: dict[str, int] = field(default_factory=dict)

    @property
    def pairs(self) -> int:
        return sum(len(p) for p in self.prompts)


def image_workload(
    name: str, *, max_images: int | None = None, workloads: dict[str, Any] | None = None
) -> ImageWorkload:
    """The images and prompts of SAM workload `name`; `max_images` keeps the first N (a recorded
    deviation; the draws are sequential, so they are the first N images of the full workload)."""
    doc = workloads if workloads is not None else load_workloads()
    sam = doc.get("sam", {})
    if name not in sam:
        raise ConfigError(f"unknown image workload {name!r}; the workloads file has {', '.join(sam)}")
    spec = sam[name]
    n = int(spec["n"])
    deviations: dict[str, int] = {}
    if max_images is not None:
        if max_images < 1:
            raise ConfigError(f"--max-images must be >= 1, got {max_images}")
        if max_images < n:
            n = max_images
            deviations["max_images"] = max_images
    rng = np.random.default_rng(int(doc["seed"]))
    sizes = spec["sizes"]
    images = []
    for i in range(n):
        h, w = sizes[i % len(sizes)]
        images.append(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8))
    prompts = list(spec["prompts"][: int(spec["prompts_per_image"])])
    return ImageWorkload(name, spec, int(doc["seed"]), images, [list(prompts) for _ in images], deviations)


def _png(image: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, "PNG", compress_level=1)
    return buf.getvalue()


def encode_png(images: Sequence[np.ndarray], workers: int | None = None) -> list[bytes]:
    """Lossless PNG bytes of each image (what the timed run decodes), before any timing: on every core
    (default), not the pipeline's few decode threads."""
    with ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
        return list(pool.map(_png, images))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_end_to_end(
    engine: SegmenterEngine,
    encoded: Sequence[bytes],
    prompts: Sequence[Sequence[str]],
    threshold: float,
    out_path: Path,
    device: torch.device,
) -> dict[str, Any]:
    """Decode -> model -> RLE -> Parquet through the image job's pipeline; the figures of the run."""
    n = len(encoded)
    rows: list[list[dict[str, Any]] | None] = [None] * n
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(task.DECODE_WORKERS, thread_name_prefix="decode") as pool:
        times = task._pipeline(
            engine, pool, list(encoded), [""] * n, [list(p) for p in prompts], threshold, rows
        )
    write_rows(rows, out_path)
    _sync(device)
    wall = time.perf_counter() - t0
    return _figures(rows, prompts, wall, out_path) | peak_memory(device) | {"pipeline": asdict(times)}


def time_decode_only(encoded: Sequence[bytes]) -> dict[str, Any]:
    """The CPU decode workers alone on the workload's images (no GPU): the rate the pipeline can feed."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(task.DECODE_WORKERS, thread_name_prefix="decode") as pool:
        errors = [e for e in pool.map(lambda b: decode.load(b, "", None).error, encoded) if e is not None]
    wall = time.perf_counter() - t0
    if errors:
        raise BatchinferError(f"{len(errors)} image(s) failed to decode, first: {errors[0]}")
    return {"images": len(encoded), "workers": task.DECODE_WORKERS, "images_per_s": len(encoded) / wall}


def write_rows(rows: Sequence[list[dict[str, Any]] | None], out_path: Path) -> None:
    flat = [{"image": i, **r} for i, image_rows in enumerate(rows) for r in image_rows or []]
    pq.write_table(pa.Table.from_pylist(flat, schema=ROW_SCHEMA), out_path)


def _figures(
    rows: Sequence[list[dict[str, Any]] | None], prompts: Sequence[Sequence[str]], wall: float, out: Path
) -> dict[str, Any]:
    flat = [r for image_rows in rows for r in image_rows or []]
    errors = [r["error"] for r in flat if r.get("error") is not None]
    if errors:
        raise BatchinferError(f"{len(errors)} image(s) ended in error, first: {errors[0]}")
    n, pairs = len(rows), sum(len(p) for p in prompts)
    return {
        "images": n,
        "pairs": pairs,
        "instances": sum(1 for r in flat if r.get("instance") is not None),
        "rows": len(flat),
        "parquet_bytes": out.stat().st_size,
        "wall_s": wall,
        "images_per_s": n / wall,
        "pairs_per_s": pairs / wall,
    }


def time_model_only(
    model: Sam3Model, images: Sequence[np.ndarray], prompts: Sequence[Sequence[str]], threshold: float,
    batch: int, device: torch.device,
) -> dict[str, Any]:  # fmt: skip
    """Where the time goes: the model on already decoded images (segment_pairs, masks to host included,
    no RLE, no Parquet), and the vision backbone alone, on the same images and batch size."""
    tensors = [torch.from_numpy(img) for img in images]
    _sync(device)
    t0 = time.perf_counter()
    for lo in range(0, len(tensors), batch):
        model.segment_pairs(tensors[lo : lo + batch], prompts[lo : lo + batch], threshold)
    _sync(device)
    t_model = time.perf_counter() - t0
    size = model.config.image_size
    t_vit = 0.0
    with torch.inference_mode():
        for lo in range(0, len(tensors), batch):
            pixels = torch.stack([preprocess_image(t.to(device), size) for t in tensors[lo : lo + batch]])
            _sync(device)
            t1 = time.perf_counter()
            model.encode_images(pixels)
            _sync(device)
            t_vit += time.perf_counter() - t1
    n = len(images)
    return {"images": n, "model_images_per_s": n / t_model, "backbone_images_per_s": n / t_vit}


# Kernel-name patterns of an image-path profile -> group, first match wins (SDPA's flash and
# memory-efficient kernels, and cuDNN's implicit-GEMM convolutions, before the GEMMs their names resemble).
IMAGE_GROUPS = (
    ("attention (SDPA)", r"flash|fmha|attention"),
    ("rope", r"rope"),
    ("conv", r"conv|cudnn|fprop|implicit|winograd"),
    ("gemm (cuBLAS)", r"gemm|sm90_xmma|cutlass|nvjet|cublas|matmul"),
    ("layer norm", r"layer_norm|layernorm|_ln_kernel"),
    ("gelu", r"gelu"),
    ("softmax", r"softmax"),
    ("resize", r"upsample|interpolate|bilinear|bicubic"),
    ("copy / layout", r"copy|cat|transpose|permute|index|gather|pad"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce"),
)


def image_breakdown(
    model: Sam3Model, images: Sequence[np.ndarray], prompts: Sequence[Sequence[str]], threshold: float,
    batch: int, device: torch.device, repeats: int = 3,
) -> dict[str, Any]:  # fmt: skip
    """Where one batch's device time goes, per kernel group and top kernel: the vision backbone alone
    (`encode_images`) and the whole model (`segment_pairs` on the decoded images)."""
    if device.type != "cuda":
        raise ConfigError("the per-kernel breakdown needs a CUDA device (it reads CUDA profiler events)")
    tensors = [torch.from_numpy(img) for img in images[:batch]]
    size = model.config.image_size
    with torch.inference_mode():
        pixels = torch.stack([preprocess_image(t.to(device), size) for t in tensors])
        backbone = profile_kernels(lambda: model.encode_images(pixels), repeats, IMAGE_GROUPS)
    whole = profile_kernels(
        lambda: model.segment_pairs(tensors, prompts[:batch], threshold), repeats, IMAGE_GROUPS
    )
    return {"images": len(tensors), "backbone": backbone, "model": whole}


def format_image_breakdown(doc: dict[str, Any]) -> list[str]:
    n = doc["images"]
    lines = []
    for what, d in (("vision backbone", doc["backbone"]), ("whole model", doc["model"])):
        title = f"{what}, a batch of {n} images: {d['total_us'] / 1e3:.1f} ms of device time, "
        lines += format_profile(title + f"{d['total_us'] / 1e3 / n:.2f} ms an image", d)
    return lines


@dataclass(slots=True)
class PairOutputs:
    """Every query of one (image, prompt) pair at the original size."""

    scores: Tensor  # float32 [Q]
    boxes: Tensor  # float32 [Q, 4] xyxy pixels, clamped to the image
    masks: Tensor  # bool [Q, H, W]


@torch.inference_mode()
def pair_outputs(model: Sam3Model, image: np.ndarray, prompts: Sequence[str]) -> list[PairOutputs]:
    """All queries of each prompt on one image, through the same calls as `segment_pairs`."""
    device = model._param().device
    h, w = image.shape[:2]
    pixels = preprocess_image(torch.from_numpy(image).to(device), model.config.image_size)[None]
    fpn = model.encode_images(pixels)
    text, mask = model.encode_prompts(list(prompts))
    out = model.ground(fpn, torch.zeros(len(prompts), dtype=torch.long, device=device), text, mask)
    scale = torch.tensor([w, h, w, h], dtype=torch.float32, device=device)
    result = []
    for k in range(len(prompts)):
        scores = torch.sigmoid(out.logits[k].float()) * torch.sigmoid(out.presence_logit[k].float())
        boxes = torch.minimum((box_cxcywh_to_xyxy(out.boxes[k].float()) * scale).clamp(min=0), scale)
        masks = F.interpolate(out.mask_logits[k][:, None].float(), size=(h, w), mode="bilinear") > 0
        result.append(PairOutputs(scores, boxes, masks[:, 0]))
    return result


def mask_iou(a: Tensor, b: Tensor) -> Tensor:
    """IoU of bool masks [N, H, W] pairwise by index -> [N]; NaN where both are empty."""
    inter = (a & b).flatten(1).sum(1).double()
    union = (a | b).flatten(1).sum(1).double()
    return torch.where(union > 0, inter / union.clamp(min=1), torch.full_like(union, float("nan")))


def box_iou(a: Tensor, b: Tensor) -> Tensor:
    """IoU matrix of xyxy boxes a [N, 4], b [M, 4] -> [N, M]."""
    area_a = (a[:, 2] - a[:, 0]).clamp(min=0) * (a[:, 3] - a[:, 1]).clamp(min=0)
    area_b = (b[:, 2] - b[:, 0]).clamp(min=0) * (b[:, 3] - b[:, 1]).clamp(min=0)
    lt = torch.maximum(a[:, None, :2], b[None, :, :2])
    rb = torch.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    union = area_a[:, None] + area_b[None, :] - inter
    return torch.where(union > 0, inter / union.clamp(min=1e-12), torch.zeros_like(union))


@contextmanager
def strict_fp32() -> Iterator[None]:
    """Full fp32 matmuls and convolutions for the reference (Meta's import turns TF32 on globally)."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def sample_indices(n: int, k: int) -> list[int]:
    """k image indices spread evenly over n (all sizes of a mixed-size workload get sampled)."""
    return sorted(set(np.linspace(0, n - 1, num=min(k, n)).round().astype(int).tolist()))


def accuracy_lock(
    fast: Sam3Model, reference: Sam3Model, images: Sequence[np.ndarray], prompts: Sequence[Sequence[str]],
    sample: int,
) -> dict[str, Any]:  # fmt: skip
    """Compare every query of the sampled pairs; raise ImageLockError past any bound."""
    if sample < MIN_LOCK_IMAGES:
        raise ConfigError(f"the accuracy lock needs at least {MIN_LOCK_IMAGES} images, got {sample}")
    ious, score_diff, box_diff = [], [], []
    picked = sample_indices(len(images), sample)
    for i in picked:
        got = pair_outputs(fast, images[i], prompts[i])
        with strict_fp32():
            want = pair_outputs(reference, images[i], prompts[i])
        h, w = images[i].shape[:2]
        side = torch.tensor([w, h, w, h], dtype=torch.float32, device=got[0].boxes.device)
        for g, r in zip(got, want, strict=True):
            ious.append(mask_iou(g.masks, r.masks.to(g.masks.device)).cpu())
            score_diff.append((g.scores - r.scores.to(g.scores.device)).abs().cpu())
            box_diff.append(((g.boxes - r.boxes.to(g.boxes.device)).abs() / side).cpu())
    iou, sd, bd = torch.cat(ious), torch.cat(score_diff), torch.cat(box_diff)
    valid = iou[~iou.isnan()]
    report = {
        "images": picked,
        "pairs": len(score_diff),
        "queries": int(sd.numel()),
        "masks_compared": int(valid.numel()),
        "mean_mask_iou": float(valid.mean()) if valid.numel() else 1.0,
        "min_mask_iou": float(valid.min()) if valid.numel() else 1.0,
        "score_abs_diff_mean": float(sd.mean()),
        "score_abs_diff_max": float(sd.max()),
        "box_abs_diff_mean": float(bd.mean()),
        "box_abs_diff_max": float(bd.max()),
        "bounds": {
            "mean_mask_iou_min": LOCK_MIN_MASK_IOU,
            "score_abs_diff_mean": LOCK_SCORE_MEAN,
            "score_abs_diff_max": LOCK_SCORE_MAX,
            "box_abs_diff_mean": LOCK_BOX_MEAN,
            "box_abs_diff_max": LOCK_BOX_MAX,
        },
    }
    checks = (
        ("mean mask IoU", report["mean_mask_iou"], ">=", LOCK_MIN_MASK_IOU),
        ("mean |score diff|", report["score_abs_diff_mean"], "<=", LOCK_SCORE_MEAN),
        ("max |score diff|", report["score_abs_diff_max"], "<=", LOCK_SCORE_MAX),
        ("mean |box diff|", report["box_abs_diff_mean"], "<=", LOCK_BOX_MEAN),
        ("max |box diff|", report["box_abs_diff_max"], "<=", LOCK_BOX_MAX),
    )
    failures = [
        f"{name} {value:.4g} (needs {op} {bound})"
        for name, value, op, bound in checks
        if not (value >= bound if op == ">=" else value <= bound)
    ]
    report["passed"] = not failures
    report["failures"] = failures
    return report


def build_models(
    state: dict[str, Tensor], config: Any, device: torch.device, dtype: torch.dtype
) -> tuple[Sam3Model, Sam3Model]:
    """(fast model in `dtype`, fp32 reference) on `device` from one state dict (Meta's keys, no prefix)."""
    models = []
    for dt in (dtype, torch.float32):
        with torch.device("meta"):
            m = Sam3Model(config)
        m.load_state_dict(state, assign=True)
        models.append(m.to(device=device, dtype=dt).eval())
    return models[0], models[1]


def run_images_benchmark(
    model: Sam3Model, reference: Sam3Model, workload: ImageWorkload, device: torch.device, *,
    threshold: float = DEFAULT_SCORE_THRESHOLD, batch_size: int = 16, lock_images: int = 4,
    peer: Callable[[], Any] | None = None, peer_images: int | None = None,
    info: dict[str, str] | None = None, breakdown: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """The result document: our end-to-end figures, the lock, the time split (with `breakdown`, also the
    per-kernel profile of one batch), then the peer (built by `peer()` only now, after our figures; its
    failure is recorded as `peer_error`). The warm-up runs one batch of images untimed first."""
    from batchinfer.sam3.fp8 import FP8Linear

    encoded = encode_png(workload.images)
    blocks = model.backbone.vision_backbone.trunk.blocks
    fp8 = {name for b in blocks for name, m in b.named_modules() if isinstance(m, FP8Linear)}
    vit_linears = "as dtype" if not fp8 else "fp8 (MLP)" if fp8 <= {"mlp.fc1", "mlp.fc2"} else "fp8"
    facts = {
        "engine": "batchinfer sam3",
        "dtype": str(model._param().dtype),
        "device": str(device),
        "vit_linears": vit_linears,
    }
    engine = SegmenterEngine(model, facts, batch_size=batch_size)
    with tempfile.TemporaryDirectory() as tmp:
        warm = min(batch_size, len(encoded))
        if warm:
            run_end_to_end(engine, encoded[:warm], workload.prompts[:warm], threshold, Path(tmp, "w"), device)
        figures = run_end_to_end(
            engine, encoded, workload.prompts, threshold, Path(tmp, "ours.parquet"), device
        )
    figures["decode_only"] = time_decode_only(encoded)
    lock = accuracy_lock(model, reference, workload.images, workload.prompts, lock_images)
    if not lock["passed"]:
        raise ImageLockError(
            f"accuracy lock failed for our {model._param().dtype} path on images {lock['images']} of "
            f"{workload.name}: {'; '.join(lock['failures'])}; no figure recorded"
        )
    split_n = min(len(workload.images), 4 * batch_size)
    split = time_model_only(
        model, workload.images[:split_n], workload.prompts[:split_n], threshold, batch_size, device
    )
    doc: dict[str, Any] = {
        "workload": workload.name,
        "workload_spec": workload.spec,
        "seed": workload.seed,
        "deviations": workload.deviations,
        "score_threshold": threshold,
        "model": info or {},
        "engine": engine.describe(),
        "environment": environment(device),
        "results": figures,
        "time_split": split,
        "accuracy_lock": lock,
        "peer": None,
    }
    if breakdown:
        doc["breakdown"] = image_breakdown(
            model, workload.images, workload.prompts, threshold, batch_size, device
        )
    if peer is not None:
        try:
            found = _run_peer(peer(), model, workload, encoded, threshold, lock_images, peer_images, device)
            found["speedup"] = figures["images_per_s"] / found["results"]["images_per_s"]
            doc["peer"] = found
        except Exception as e:  # the peer is foreign code: its failure must not lose our checked figures
            log.exception("the peer failed")
            doc["peer_error"] = f"{type(e).__name__}: {e}"
    return doc


def _run_peer(
    peer: Any, model: Sam3Model, workload: ImageWorkload, encoded: Sequence[bytes], threshold: float,
    lock_images: int, peer_images: int | None, device: torch.device,
) -> dict[str, Any]:  # fmt: skip
    n = min(len(encoded), peer_images or len(encoded))
    warm = min(2, n)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with tempfile.TemporaryDirectory() as tmp:
        peer.run(encoded[:warm], workload.prompts[:warm], threshold, Path(tmp, "w"))
        figures = peer.run(encoded[:n], workload.prompts[:n], threshold, Path(tmp, "meta.parquet"))
    figures |= peak_memory(device)
    parity = peer.parity(model, workload.images, workload.prompts, sample_indices(n, lock_images))
    return {"engine": peer.describe(), "results": figures, "parity": parity}


def _pipeline_lines(r: dict[str, Any]) -> list[str]:
    """The end-to-end run's split on the engine's thread, and the CPU decode rate alone (older result
    files lack both)."""
    if "pipeline" not in r:
        return []
    p, dec = r["pipeline"], r["decode_only"]
    return [
        f"  pipeline: engine {p['engine_s']:.2f} s, waiting on decoding {p['decode_wait_s']:.2f} s, on the "
        f"last masks {p['encode_wait_s']:.2f} s, of {r['wall_s']:.2f} s; CPU decode alone "
        f"{dec['images_per_s']:.1f} images/s ({dec['workers']} threads, {dec['images']} images)"
    ]


def format_result(doc: dict[str, Any]) -> list[str]:
    r, lock, split = doc["results"], doc["accuracy_lock"], doc["time_split"]
    dev = ", ".join(f"{k}={v}" for k, v in doc["deviations"].items())
    lines = [
        f"workload {doc['workload']}{f' (deviations: {dev})' if dev else ''}, score threshold "
        f"{doc['score_threshold']}, {doc['environment']['device']}, commit {doc['environment']['commit']}",
        f"ours ({doc['engine']['dtype']}, ViT linears {doc['engine'].get('vit_linears', 'as dtype')}, "
        f"batch {doc['engine']['batch_size']}): {r['images']} images, "
        f"{r['pairs']} pairs, {r['instances']} instances in {r['wall_s']:.2f} s: {r['images_per_s']:.1f} "
        f"images/s, {r['pairs_per_s']:.1f} pairs/s, peak {r['peak_memory_bytes'] / 2**30:.2f} GiB",
        f"  model only {split['model_images_per_s']:.1f} images/s, backbone only "
        f"{split['backbone_images_per_s']:.1f} images/s ({split['images']} decoded images)",
        *_pipeline_lines(r),
        f"  accuracy lock passed: {lock['pairs']} pairs, {lock['queries']} queries, mean mask IoU "
        f"{lock['mean_mask_iou']:.4f} (min {lock['min_mask_iou']:.4f}), |score diff| mean "
        f"{lock['score_abs_diff_mean']:.2e} max {lock['score_abs_diff_max']:.2e}, |box diff| mean "
        f"{lock['box_abs_diff_mean']:.2e} max {lock['box_abs_diff_max']:.2e} (image sides)",
    ]
    if doc["peer"]:
        p, par = doc["peer"], doc["peer"]["parity"]
        pr = p["results"]
        lines.append(
            f"meta ({p['engine']['precision']}): {pr['images']} images in {pr['wall_s']:.2f} s: "
            f"{pr['images_per_s']:.1f} images/s, {pr['pairs_per_s']:.1f} pairs/s (model only "
            f"{pr['model_images_per_s']:.1f} images/s); ours/meta {p['speedup']:.2f}x"
        )
        lines.append(
            f"  parity {'passed' if par['passed'] else 'FAILED'}: {par['pairs']} pairs, "
            f"{par['matched']}/{par['meta_instances']} Meta instances matched by box IoU "
            f"(unmatched ours {par['unmatched_ours']}, meta {par['unmatched_meta']}), mean mask IoU "
            f"{par['mean_mask_iou']:.4f} (min {par['min_mask_iou']:.4f}), |score diff| max "
            f"{par['score_abs_diff_max']:.2e}"
        )
    if doc.get("breakdown"):
        lines += format_image_breakdown(doc["breakdown"])
    return lines
