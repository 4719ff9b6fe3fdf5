import io
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from batchinfer.bench import images as bi
from batchinfer.bench.meta_sam3_peer import match_instances, parity_report
from batchinfer.bench.workloads import load_workloads
from batchinfer.cli import cli
from batchinfer.errors import ConfigError
from batchinfer.images.segmenter import SegmenterEngine
from batchinfer.sam3.checkpoint import random_sam3_state_dict
from batchinfer.sam3.config import Sam3Config

TINY = Sam3Config.tiny()
SMALL = {
    "version": 1,
    "seed": 7,
    "token_lo": 10,
    "token_hi": 100,
    "llm": {},
    "sam": {
        "images-1p": {"n": 3, "sizes": [[56, 56]], "prompts": ["object"], "prompts_per_image": 1},
        "images-4p": {
            "n": 4,
            "sizes": [[40, 70], [30, 20], [56, 56]],
            "prompts": ["person", "car", "dog", "chair"],
            "prompts_per_image": 4,
        },
    },
}


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    return {k.removeprefix("detector."): v for k, v in random_sam3_state_dict(TINY, 5).items()}


@pytest.fixture(scope="module")
def models(state):
    return bi.build_models(state, TINY, torch.device("cpu"), torch.bfloat16)


def test_workload_images_follow_the_sam_rule():
    doc = load_workloads()
    w = bi.image_workload("images-4p", max_images=4, workloads=doc)
    rng = np.random.default_rng(doc["seed"])
    sizes = doc["sam"]["images-4p"]["sizes"]
    for i in range(4):
        h, w_ = sizes[i % len(sizes)]
        assert np.array_equal(w.images[i], rng.integers(0, 256, size=(h, w_, 3), dtype=np.uint8))
    assert w.prompts[0] == ["person", "car", "dog", "chair"] and w.pairs == 16
    assert w.deviations == {"max_images": 4}
    one = bi.image_workload("images-1p", max_images=2, workloads=doc)
    assert [im.shape for im in one.images] == [(1008, 1008, 3)] * 2 and one.prompts == [["object"]] * 2


def test_workload_errors():
    with pytest.raises(ConfigError, match="unknown image workload 'conc32'"):
        bi.image_workload("conc32", workloads=SMALL)
    with pytest.raises(ConfigError, match="--max-images must be >= 1"):
        bi.image_workload("images-1p", max_images=0, workloads=SMALL)
    assert bi.image_workload("images-1p", max_images=10, workloads=SMALL).deviations == {}


def test_png_is_lossless():
    w = bi.image_workload("images-4p", workloads=SMALL)
    for img, data in zip(w.images, bi.encode_png(w.images, workers=2), strict=True):
        assert np.array_equal(np.array(Image.open(io.BytesIO(data))), img)


def test_end_to_end_rows_and_figures(models, tmp_path):
    model, _ = models
    w = bi.image_workload("images-4p", workloads=SMALL)
    engine = SegmenterEngine(model, {}, batch_size=3)
    out = tmp_path / "rows.parquet"
    fig = bi.run_end_to_end(engine, bi.encode_png(w.images, 2), w.prompts, 0.0, out, torch.device("cpu"))
    table = pq.read_table(out)
    assert fig["images"] == 4 and fig["pairs"] == 16 and fig["rows"] == table.num_rows
    assert fig["instances"] == 16 * TINY.num_queries  # threshold 0 keeps every query
    assert fig["images_per_s"] > 0 and fig["pairs_per_s"] == pytest.approx(4 * fig["images_per_s"])
    first = table.slice(0, 1).to_pylist()[0]
    assert (first["height"], first["width"], first["prompt"]) == (40, 70, "person")
    assert first["mask_rle"] and first["error"] is None
    p = fig["pipeline"]  # the engine thread's split: every part measured, none past the wall time
    assert 0 < p["engine_s"] < fig["wall_s"] and 0 <= p["decode_wait_s"] < fig["wall_s"]
    assert 0 <= p["encode_wait_s"] < fig["wall_s"]


def test_lock_passes_for_bf16_and_names_its_measures(models):
    model, reference = models
    w = bi.image_workload("images-4p", workloads=SMALL)
    lock = bi.accuracy_lock(model, reference, w.images, w.prompts, sample=2)
    assert lock["passed"] and lock["images"] == [0, 3] and lock["pairs"] == 8
    assert lock["queries"] == 8 * TINY.num_queries
    assert lock["mean_mask_iou"] >= bi.LOCK_MIN_MASK_IOU
    assert 0 < lock["score_abs_diff_max"] <= bi.LOCK_SCORE_MAX


def test_lock_failure_records_no_figure(state):
    fast, _ = bi.build_models(state, TINY, torch.device("cpu"), torch.float32)
    wrong = dict(state)
    wrong["transformer.decoder.presence_token.weight"] = (
        state["transformer.decoder.presence_token.weight"] + 3
    )
    _, reference = bi.build_models(wrong, TINY, torch.device("cpu"), torch.float32)
    w = bi.image_workload("images-1p", workloads=SMALL)
    with pytest.raises(bi.ImageLockError, match="accuracy lock failed .* no figure recorded"):
        bi.run_images_benchmark(fast, reference, w, torch.device("cpu"), batch_size=2, lock_images=2)
    with pytest.raises(ConfigError, match="at least 2 images"):
        bi.accuracy_lock(fast, fast, w.images, w.prompts, sample=1)


def test_benchmark_document_and_failing_peer(models):
    model, reference = models
    w = bi.image_workload("images-1p", workloads=SMALL)

    def broken_peer():
        raise ImportError("no sam3 here")

    doc = bi.run_images_benchmark(
        model, reference, w, torch.device("cpu"), batch_size=2, lock_images=2, peer=broken_peer
    )
    assert doc["results"]["images"] == 3 and doc["accuracy_lock"]["passed"]
    assert doc["peer"] is None and doc["peer_error"] == "ImportError: no sam3 here"
    assert doc["time_split"]["model_images_per_s"] > 0
    assert doc["results"]["decode_only"]["images"] == 3 and doc["results"]["decode_only"]["images_per_s"] > 0
    lines = bi.format_result(doc)
    assert any("accuracy lock passed" in line for line in lines)
    assert any(line.startswith("  pipeline: engine ") and "CPU decode alone" in line for line in lines)


def test_box_matching_and_parity_report():
    a = torch.tensor([[0, 0, 10, 10], [20, 20, 30, 30], [50, 50, 60, 60]], dtype=torch.float32)
    b = torch.tensor([[21, 20, 30, 30], [0, 0, 10, 11], [90, 90, 95, 95]], dtype=torch.float32)
    assert sorted(match_instances(a, b)) == [(0, 1), (1, 0)]
    assert match_instances(a, b[:0]) == []
    masks = torch.zeros(3, 8, 8, dtype=torch.bool)
    masks[0, :4, :4] = masks[1, 4:, 4:] = masks[2, 0, :] = True
    ours = bi.PairOutputs(torch.tensor([0.9, 0.8, 0.1]), a, masks)
    theirs = bi.PairOutputs(torch.tensor([0.8, 0.9, 0.2]), b, masks[[1, 0, 2]])
    rep = parity_report([ours], [theirs])
    assert (rep["matched"], rep["unmatched_ours"], rep["unmatched_meta"]) == (2, 1, 1)
    assert rep["mean_mask_iou"] == 1.0 and not rep["passed"]  # a third of Meta's instances found no partner
    same = parity_report([ours], [ours])
    assert same["passed"] and same["matched"] == 3 and same["score_abs_diff_max"] == 0


def test_mask_iou_nan_when_both_empty():
    a = torch.zeros(2, 4, 4, dtype=torch.bool)
    b = a.clone()
    a[0, 0, 0] = b[0, 0, :2] = True
    iou = bi.mask_iou(a, b)
    assert iou[0] == 0.5 and iou[1].isnan()


def test_cli_tiny_preset(tmp_path):
    wl = tmp_path / "w.json"
    wl.write_text(json.dumps(SMALL))
    out = tmp_path / "r.json"
    args = ["bench", "images", "--workload", "images-4p", "--preset", "tiny-sam3", "--random"]
    res = CliRunner().invoke(
        cli, [*args, "--workloads", str(wl), "--batch-size", "2", "--lock-images", "2", "--json", str(out)]
    )
    assert res.exit_code == 0, res.output
    assert "accuracy lock passed" in res.output
    doc = json.loads(out.read_text())
    assert doc["results"]["pairs"] == 16 and doc["model"]["model"].startswith("preset tiny-sam3")


def test_cli_fp8_vit_is_recorded(tmp_path):
    """`--vit fp8` runs the fast path with FP8 ViT linears through the lock (tiny random weights on the CPU:
    mean mask IoU 0.98) and records it; real shapes are the H200 run's to check (docs/PERF_IMAGES.md)."""
    wl = tmp_path / "w.json"
    wl.write_text(json.dumps(SMALL))
    out = tmp_path / "r.json"
    args = ["bench", "images", "--workload", "images-4p", "--preset", "tiny-sam3", "--random", "--vit", "fp8"]
    res = CliRunner().invoke(
        cli, [*args, "--workloads", str(wl), "--batch-size", "2", "--lock-images", "2", "--json", str(out)]
    )
    assert res.exit_code == 0, res.output
    assert "ViT linears fp8" in res.output and "accuracy lock passed" in res.output
    assert json.loads(out.read_text())["engine"]["vit_linears"] == "fp8"


def test_cli_usage_errors(tmp_path):
    res = CliRunner().invoke(cli, ["bench", "images", "--workload", "images-1p", "--preset", "sam3"])
    assert res.exit_code == 2 and "--random" in res.output
    res = CliRunner().invoke(cli, ["bench", "images", "--workload", "images-1p"])
    assert res.exit_code == 2 and "exactly one of --model" in res.output
    res = CliRunner().invoke(
        cli,
        ["bench", "images", "--workload", "images-1p", "--preset", "sam3", "--random", "--batch-size", "0"],
    )
    assert res.exit_code == 2 and "--batch-size must be >= 1" in res.output
    res = CliRunner().invoke(
        cli,
        ["bench", "images", "--workload", "images-1p", "--preset", "sam3", "--random", "--lock-images", "1"],
    )
    assert res.exit_code == 2 and "--lock-images must be >= 2" in res.output
    res = CliRunner().invoke(
        cli,
        ["bench", "images", "--workload", "images-1p", "--preset", "tiny-sam3", "--random", "--device", "cpu",
         "--breakdown"],
    )  # fmt: skip
    assert res.exit_code == 2 and "--breakdown profiles CUDA kernels" in res.output


def test_breakdown_groups_the_image_paths_kernels():
    """SDPA's kernels count as attention and cuDNN's implicit-GEMM convolutions as convolutions, though
    their names hold "cutlass" and "gemm"; unknown names are "other"."""
    from batchinfer.bench.breakdown import _group

    names = {
        "pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>": "attention (SDPA)",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80": "attention (SDPA)",
        "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT": "gemm (cuBLAS)",
        "_rope_kernel": "rope",
        "_ln_kernel": "layer norm",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16>": "layer norm",
        "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>": "gelu",
        "void at::native::upsample_bilinear2d_out_frame<c10::BFloat16>": "resize",
        "sm90_xmma_fprop_implicit_gemm_bf16": "conv",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "gemm (cuBLAS)",
        "cudnn::engines_precompiled::nchwToNhwcKernel": "conv",
        "mystery_kernel": "other",
    }
    assert {n: _group(n, bi.IMAGE_GROUPS) for n in names} == names


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_breakdown_profiles_a_batch_on_cuda(state):
    dev = torch.device("cuda")
    model, _ = bi.build_models(state, TINY, dev, torch.bfloat16)
    work = bi.image_workload("images-4p", workloads=SMALL)
    doc = bi.image_breakdown(model, work.images, work.prompts, 0.5, 2, dev)
    assert doc["images"] == 2
    for part in ("backbone", "model"):
        assert doc[part]["total_us"] > 0 and doc[part]["top_kernels"]
        assert sum(doc[part]["groups"].values()) == pytest.approx(doc[part]["total_us"])
    assert doc["model"]["total_us"] > doc["backbone"]["total_us"]
    assert any("vision backbone" in line for line in bi.format_image_breakdown(doc))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_lock_on_cuda(state):
    model, reference = bi.build_models(state, TINY, torch.device("cuda"), torch.bfloat16)
    w = bi.image_workload("images-4p", workloads=SMALL)
    doc = bi.run_images_benchmark(model, reference, w, torch.device("cuda"), batch_size=2, lock_images=2)
    assert doc["accuracy_lock"]["passed"] and doc["results"]["peak_memory_kind"] == "cuda allocated"


PEER = Path(__file__).resolve().parents[1] / ".peer"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(
    not (PEER / "sam3" / "model_builder.py").is_file(), reason="no copy of Meta's sam3 in .peer/"
)
def test_meta_peer_parity_on_cuda():
    """Meta's model at real shapes (their builder has no tiny config) with our random weights."""
    from batchinfer.bench.meta_sam3_peer import MetaSam3Peer

    real = Sam3Config.real()
    state = {k.removeprefix("detector."): v for k, v in random_sam3_state_dict(real, 1).items()}
    model, _ = bi.build_models(state, real, torch.device("cuda"), torch.bfloat16)
    peer = MetaSam3Peer(PEER, state, torch.device("cuda"))
    w = bi.image_workload("images-4p", max_images=2)
    parity = peer.parity(model, w.images, w.prompts, [0, 1])
    assert parity["passed"] and parity["meta_instances"] == 2 * 4 * real.num_queries
