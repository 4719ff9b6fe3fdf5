"""`batchinfer make-checkpoint` and `batchinfer quantize` through click's CliRunner."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from batchinfer.kernels.nvfp4 import FP8Weight, NVFP4Weight
from click.testing import CliRunner

from batchinfer.checkpoint.loader import load_checkpoint
from batchinfer.cli import cli
from batchinfer.errors import CheckpointError


def _run(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_make_checkpoint_writes_a_complete_folder(tmp_path):
    out = tmp_path / "ck"
    res = _run("make-checkpoint", "--preset", "tiny-qwen3.5-moe", "--out", str(out), "--seed", "3")
    assert res.exit_code == 0, res.output
    assert res.output.startswith(f"wrote {out}: preset tiny-qwen3.5-moe, bf16, seed 3; 5 files, ")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    cfg, w = load_checkpoint(out)
    assert cfg.model_type == "qwen3_5_moe" and cfg.layer_types[3] == "full_attention"
    assert json.loads((out / "config.json").read_text())["architectures"] == [
        "Qwen3_5MoeForConditionalGeneration"
    ]
    # --seed reaches the weights
    again = tmp_path / "ck2"
    _run("make-checkpoint", "--preset", "tiny-qwen3.5-moe", "--out", str(again), "--seed", "4")
    _, w4 = load_checkpoint(again)
    assert not torch.equal(w["embed_tokens"], w4["embed_tokens"])


def test_make_checkpoint_refuses_to_overwrite_without_force(tmp_path):
    out = tmp_path / "ck"
    assert _run("make-checkpoint", "--preset", "tiny-qwen3-moe", "--out", str(out)).exit_code == 0
    with pytest.raises(
        CheckpointError, match=rf"{out}: already holds a checkpoint; pass --force to replace it"
    ):
        _run("make-checkpoint", "--preset", "tiny-qwen3-moe", "--out", str(out))
    res = _run(
        "make-checkpoint", "--preset", "tiny-qwen3-moe", "--out", str(out), "--quant", "nvfp4", "--force"
    )
    assert res.exit_code == 0 and (out / "hf_quant_config.json").exists()
    _, w = load_checkpoint(out)
    assert isinstance(w["layers.0.mlp.experts.0.up_proj"], NVFP4Weight)


def test_force_replaces_the_old_checkpoints_files_and_nothing_else(tiny_checkpoint, tmp_path):
    out = tmp_path / "ck"
    _run("make-checkpoint", "--preset", "tiny-qwen3-moe", "--out", str(out), "--quant", "nvfp4")
    (out / "README.md").write_text("the user's model card")  # not a checkpoint file: kept
    (out / "keep").mkdir()
    res = _run("make-checkpoint", "--preset", "tiny-sam3", "--out", str(out), "--force")
    # the LLM's config.json beside sam3.safetensors made the folder a broken LLM checkpoint, counted 8 files
    assert res.exit_code == 0 and res.output.rstrip().endswith("2 files, 7.57 MB")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "keep", "sam3.safetensors"]
    user = tmp_path / "home"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    for args in (
        ["make-checkpoint", "--preset", "tiny-qwen3-moe", "--out", str(user), "--force"],
        ["quantize", str(tiny_checkpoint("tiny-qwen3-moe")), str(user), "--scheme", "nvfp4", "--force"],
    ):  # a non-empty folder without a checkpoint was written into, with or without --force
        with pytest.raises(CheckpointError, match=rf"{user}: is not empty and holds no checkpoint"):
            _run(*args)
    assert [p.name for p in user.iterdir()] == ["notes.txt"]
    src = tiny_checkpoint("tiny-qwen3-moe")
    before = sorted(p.name for p in src.iterdir())
    with pytest.raises(CheckpointError, match="the destination must differ from the source folder"):
        _run("quantize", str(src), str(src), "--scheme", "nvfp4", "--force")
    assert sorted(p.name for p in src.iterdir()) == before  # checked before --force clears the folder


def test_unwritable_out_folder_is_refused_before_any_work(tiny_checkpoint, tmp_path):
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "ck"
    with pytest.raises(CheckpointError, match=rf"{out}: cannot create the folder \(Not a directory\)"):
        _run("make-checkpoint", "--preset", "tiny-qwen3-moe", "--out", str(out))
    with pytest.raises(CheckpointError, match=rf"{out}: cannot create the folder \(Not a directory\)"):
        _run("quantize", str(tiny_checkpoint("tiny-qwen3-moe")), str(out), "--scheme", "nvfp4")


def test_make_checkpoint_cuda_without_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(CheckpointError, match="--device cuda: no CUDA GPU is available on this machine"):
        _run(
            "make-checkpoint", "--preset", "tiny-qwen3-moe", "--out", str(tmp_path / "x"), "--device", "cuda"
        )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--preset", "tiny-sam3", "--quant", "nvfp4"],
            "--quant nvfp4: the SAM 3 presets are written unquantized",
        ),
        (
            ["--preset", "tiny-qwen3-moe", "--format", "pt"],
            "--format pt is for the SAM 3 presets; tiny-qwen3-moe is written as safetensors",
        ),
    ],
)
def test_make_checkpoint_refuses_conflicting_flags_before_making_the_folder(tmp_path, args, message):
    """--format pt with a Qwen preset wrote safetensors without a word."""
    with pytest.raises(CheckpointError, match=re.escape(message)):
        _run("make-checkpoint", *args, "--out", str(tmp_path / "ck"))
    assert not (tmp_path / "ck").exists()


def test_empty_output_folder_is_refused_not_taken_as_the_current_one(tiny_checkpoint, tmp_path, monkeypatch):
    """`--out "$OUT"` with OUT unset wrote the checkpoint into the current folder."""
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(cli, ["make-checkpoint", "--preset", "tiny-qwen3-moe", "--out", ""])
    assert res.exit_code == 2 and "Invalid value for '--out': empty; expected a folder" in res.output
    res = CliRunner().invoke(
        cli, ["quantize", str(tiny_checkpoint("tiny-qwen3-moe")), " ", "--scheme", "nvfp4"]
    )
    assert res.exit_code == 2 and "Invalid value for 'DST': empty; expected a folder" in res.output
    assert list(tmp_path.iterdir()) == []


def test_a_sam3_pt_checkpoint_is_not_overwritten_without_force(tmp_path):
    args = ["make-checkpoint", "--preset", "tiny-sam3", "--format", "pt", "--out", str(tmp_path)]
    (tmp_path / "sam3.pt").write_bytes(b"a real checkpoint")
    with pytest.raises(CheckpointError, match="already holds a checkpoint; pass --force to replace it"):
        _run(*args)
    assert (tmp_path / "sam3.pt").read_bytes() == b"a real checkpoint"
    assert _run(*args, "--force").exit_code == 0


def test_bad_preset_is_a_usage_error(tmp_path):
    res = CliRunner().invoke(cli, ["make-checkpoint", "--preset", "llama", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "Invalid value for '--preset'" in res.output


def test_quantize_both_formats(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("tiny-qwen3.5-moe")
    res = _run("quantize", str(src), str(tmp_path / "mixed"), "--scheme", "mixed")
    assert res.exit_code == 0 and res.output.startswith(
        f"wrote {tmp_path / 'mixed'}: scheme mixed, modelopt layout"
    )
    _, w = load_checkpoint(tmp_path / "mixed")
    assert isinstance(w["layers.3.self_attn.k_proj"], FP8Weight) and isinstance(w["lm_head"], NVFP4Weight)
    res = _run(
        "quantize", str(src), str(tmp_path / "ct"), "--scheme", "nvfp4", "--format", "compressed-tensors"
    )
    assert res.exit_code == 0, res.output
    qc = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    _, w = load_checkpoint(tmp_path / "ct")
    assert isinstance(w["layers.0.linear_attn.out_proj"], NVFP4Weight) and isinstance(
        w["lm_head"], torch.Tensor
    )


def test_quantize_errors(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("tiny-qwen3-moe")
    with pytest.raises(CheckpointError, match="scheme 'mixed' cannot be written as compressed-tensors"):
        _run("quantize", str(src), str(tmp_path / "x"), "--scheme", "mixed", "--format", "compressed-tensors")
    res = CliRunner().invoke(cli, ["quantize", str(src), str(tmp_path / "y")])
    assert res.exit_code == 2 and "Missing option '--scheme'" in res.output
    res = CliRunner().invoke(
        cli, ["quantize", str(tmp_path / "nope"), str(tmp_path / "y"), "--scheme", "nvfp4"]
    )
    assert res.exit_code == 2 and "does not exist" in res.output


def test_help_texts_describe_presets_and_schemes():
    mk = _run("make-checkpoint", "--help").output
    for preset in ("qwen3.6-35b-a3b", "qwen3-30b-a3b", "tiny-qwen3.5-moe", "tiny-qwen3-moe"):
        assert preset in mk
    assert "--quant [bf16|nvfp4|mixed]" in mk and "--seed" in mk and "--device [cpu|cuda]" in mk
    q = _run("quantize", "--help").output
    assert "NVFP4 on all linear layers except the router (mlp.gate) and lm_head" in q
    assert "FP8 per tensor" in q and "MIXED_PRECISION" in q and "W4A16_NVFP4" in q
    top = _run("--help").output
    assert "make-checkpoint" in top and "quantize" in top


def test_user_errors_exit_2_with_one_line(tiny_checkpoint, tmp_path):
    """Through the real entry point: a BatchinferError is one `error:` line and exit status 2."""
    src = tiny_checkpoint("tiny-qwen3-moe", "nvfp4")
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from batchinfer.cli import main; main()",
            "quantize",
            str(src),
            str(tmp_path / "o"),
            "--scheme",
            "nvfp4",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {src}: already quantized; `quantize` needs a BF16/FP16/FP32 checkpoint"
    )
