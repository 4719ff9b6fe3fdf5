"""`batchinfer make-checkpoint --preset tiny-sam3 --random` writes Meta's layout that our loader reads."""

import torch
from click.testing import CliRunner

from batchinfer.cli import cli
from batchinfer.sam3.checkpoint import load_sam3_state_dict, random_sam3_state_dict
from batchinfer.sam3.config import Sam3Config


def test_tiny_sam3_preset_in_both_formats(tmp_path):
    # The loader returns keys as Sam3Model.state_dict() names them: without the `detector.` prefix.
    expected = {
        k.removeprefix("detector."): v for k, v in random_sam3_state_dict(Sam3Config.tiny(), 3).items()
    }
    for fmt in ("pt", "safetensors"):
        out = tmp_path / fmt
        args = ["make-checkpoint", "--preset", "tiny-sam3", "--random", "--seed", "3", "--format", fmt]
        result = CliRunner().invoke(cli, [*args, "--out", str(out)], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        path = out / f"sam3.{fmt}"
        if fmt == "pt":  # Meta's layout: a flat dict of detector.* tensors
            raw = torch.load(path, weights_only=True)
            assert raw and all(k.startswith("detector.") for k in raw)
        state, config = load_sam3_state_dict(path, Sam3Config.tiny())
        assert config == Sam3Config.tiny()
        assert set(state) == set(expected)
        assert all(torch.equal(state[k], expected[k]) for k in expected)


def test_sam3_presets_refuse_quantization(tmp_path):
    args = ["make-checkpoint", "--preset", "tiny-sam3", "--quant", "nvfp4", "--out", str(tmp_path / "x")]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code != 0
    assert "unquantized" in str(result.exception) + result.output
