"""The accuracy gate of the shipped demo model, through `batchinfer eval` (the normal job path).

bf16: mean exact match >= 0.90 on the held-out set (200 prompts per task). NVFP4 (all-NVFP4 and
NVIDIA's mixed layout, both made by `batchinfer quantize`): within 1.5 points of bf16 on every task.
"""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchinfer.cli import cli

MODELS = Path(__file__).resolve().parent.parent / "models"
GATED_TASKS = ["add", "convert", "count", "reverse", "sort"]


def _evaluate(name: str, tmp: Path) -> dict:
    out = tmp / f"{name}.json"
    args = [
        "eval",
        "--model",
        str(MODELS / name),
        "--output",
        str(tmp / name),
        "--tasks",
        ",".join(GATED_TASKS),
    ]
    result = CliRunner().invoke(
        cli, [*args, "--json", str(out), "--progress", "none"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert set(figures["tasks"]) == set(GATED_TASKS)
    assert all(t["rows"] == 200 for t in figures["tasks"].values())
    # The printed table carries the same figures as the JSON.
    for task, t in figures["tasks"].items():
        assert f"{task:<10} {t['rows']:>6} {t['correct']:>8}" in result.output
    return figures


@pytest.fixture(scope="module")
def bf16(tmp_path_factory) -> dict:
    return _evaluate("demo-qwen3.5-moe", tmp_path_factory.mktemp("eval"))


def test_bf16_gate(bf16):
    print("bf16:", {t: v["exact_match"] for t, v in bf16["tasks"].items()}, "mean", bf16["mean_exact_match"])
    assert bf16["mean_exact_match"] >= 0.90


@pytest.mark.parametrize("name", ["demo-qwen3.5-moe-nvfp4", "demo-qwen3.5-moe-mixed"])
def test_quantized_within_1p5_points_of_bf16(name, bf16, tmp_path):
    quant = _evaluate(name, tmp_path)
    print(f"{name}:", {t: v["exact_match"] for t, v in quant["tasks"].items()})
    for task in GATED_TASKS:
        gap = abs(quant["tasks"][task]["exact_match"] - bf16["tasks"][task]["exact_match"])
        assert gap <= 0.015, (task, gap)
