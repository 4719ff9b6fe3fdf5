import json

import pytest
import torch
from safetensors.torch import save_file

from batchinfer.errors import CheckpointError
from batchinfer.sam3.checkpoint import (
    expected_shapes,
    load_sam3_state_dict,
    random_sam3_state_dict,
    write_random_sam3,
)
from batchinfer.sam3.config import Sam3Config
from batchinfer.sam3.model import Sam3Model

TINY = Sam3Config.tiny()


@pytest.mark.parametrize("name", ["sam3.pt", "sam3.safetensors"])
def test_write_random_then_load_gives_identical_tensors(tmp_path, name):
    path = write_random_sam3(tmp_path / name, TINY, seed=7)
    assert path.is_file() and not list(tmp_path.glob("*.tmp"))
    written = random_sam3_state_dict(TINY, seed=7)
    state, config = load_sam3_state_dict(path, TINY if name.endswith(".pt") else None)
    assert config == TINY
    assert set(state) == set(expected_shapes(TINY))
    for key, tensor in state.items():
        assert torch.equal(tensor, written[f"detector.{key}"]), key


def test_pt_layout_is_metas_flat_detector_dict(tmp_path):
    path = write_random_sam3(tmp_path / "sam3.pt", TINY, seed=0)
    raw = torch.load(path, weights_only=True)
    assert all(k.startswith("detector.") for k in raw)
    assert raw["detector.backbone.vision_backbone.trunk.pos_embed"].shape == (1, 17, 32)
    assert "detector.transformer.decoder.presence_token.weight" in raw


def test_random_weights_are_seeded_and_order_independent():
    a, b = random_sam3_state_dict(TINY, 1), random_sam3_state_dict(TINY, 1)
    c = random_sam3_state_dict(TINY, 2)
    key = "detector.transformer.decoder.query_embed.weight"
    assert torch.equal(a[key], b[key]) and not torch.equal(a[key], c[key])
    assert torch.equal(a["detector.backbone.vision_backbone.trunk.ln_pre.weight"], torch.ones(32))
    assert a["detector.segmentation_head.pixel_decoder.norms.0.weight"].eq(1).all()
    assert a["detector.backbone.language_backbone.encoder.ln_final.weight"].eq(1).all()


def test_model_wrapper_and_sam31_layout_load(tmp_path):
    state = random_sam3_state_dict(TINY, 3)
    sam31 = {k.replace("detector.", "sam3_model.", 1): v for k, v in state.items() if ".convs.3." not in k}
    sam31["sam3_model.backbone.vision_backbone.interactive_convs.0.conv_1x1.weight"] = torch.zeros(1)
    sam31["tracker.maskmem_backbone.weight"] = torch.zeros(2)
    sam31["sam3_model.backbone.vision_backbone.trunk.blocks.0.attn.freqs_cis"] = torch.zeros(16, 8)
    path = tmp_path / "sam3.1_multiplex.pt"
    torch.save({"model": sam31}, path)
    loaded, _ = load_sam3_state_dict(path, TINY)
    assert set(loaded) == set(expected_shapes(TINY))
    assert loaded["backbone.vision_backbone.convs.3.conv_1x1.weight"].eq(0).all()
    key = "transformer.decoder.reference_points.weight"
    assert torch.equal(loaded[key], state[f"detector.{key}"])


def test_missing_tensor_is_named(tmp_path):
    state = random_sam3_state_dict(TINY, 0)
    del state["detector.transformer.decoder.presence_token.weight"]
    save_file(state, str(tmp_path / "bad.safetensors"))
    with pytest.raises(
        CheckpointError,
        match=r"1 tensors missing, e\.g\. detector\.transformer\.decoder\.presence_token\.weight "
        r"\(expected shape \(1, 32\)\)",
    ):
        load_sam3_state_dict(tmp_path / "bad.safetensors", TINY)


def test_misshaped_tensor_is_named(tmp_path):
    state = random_sam3_state_dict(TINY, 0)
    state["detector.dot_prod_scoring.hs_proj.weight"] = torch.zeros(32, 31)
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(
        CheckpointError,
        match=r"detector\.dot_prod_scoring\.hs_proj\.weight has shape \(32, 31\), expected \(32, 32\)",
    ):
        load_sam3_state_dict(tmp_path / "bad.pt", TINY)


def test_real_config_against_tiny_file_fails_clearly(tmp_path):
    path = write_random_sam3(tmp_path / "tiny.pt", TINY, seed=0)
    with pytest.raises(CheckpointError, match=r"tiny\.pt: 804 tensors missing, e\.g\. .*real SAM 3 config"):
        load_sam3_state_dict(path)


def test_not_a_sam3_checkpoint(tmp_path):
    save_file({"detector_model.vision_encoder.x": torch.zeros(1)}, str(tmp_path / "hf.safetensors"))
    with pytest.raises(CheckpointError, match="no SAM 3 detector tensors.*detector_model"):
        load_sam3_state_dict(tmp_path / "hf.safetensors")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="junk.pt: not a readable torch checkpoint"):
        load_sam3_state_dict(tmp_path / "junk.pt")
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        load_sam3_state_dict(tmp_path / "absent.pt")


def test_from_checkpoint_assigns_weights(tmp_path):
    path = write_random_sam3(tmp_path / "m.safetensors", TINY, seed=5)
    model = Sam3Model.from_checkpoint(path)
    assert not model.training
    written = random_sam3_state_dict(TINY, 5)
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, written[f"detector.{key}"]), key


def _tiny_fields(**changes) -> str:
    fields = json.loads(TINY.to_json())
    fields.update(changes)
    return json.dumps({k: v for k, v in fields.items() if v is not None})


@pytest.mark.parametrize(
    ("stored", "match"),
    [
        ("{not json", "sam3_config metadata is not valid JSON"),
        ("[1, 2]", "sam3_config metadata is a list, expected a JSON object of Sam3Config fields"),
        (_tiny_fields(bogus=1), r"sam3_config metadata: unknown Sam3Config fields \['bogus'\]"),
        (_tiny_fields(d_model=None), r"sam3_config metadata: missing Sam3Config fields \['d_model'\]"),
        (_tiny_fields(d_model="64"), "sam3_config metadata: field d_model is '64', expected an integer"),
        (_tiny_fields(vit_global_blocks=[1, "3"]), r"field vit_global_blocks is \[1, '3'\], expected a list"),
        (_tiny_fields(vit_global_blocks=3), "field vit_global_blocks is 3, expected a list of integers"),
        (
            _tiny_fields(image_size=60),
            "sam3_config metadata: image_size=60 is not a multiple of patch_size=7",
        ),
        (_tiny_fields(patch_size=0), "sam3_config metadata: patch_size must be at least 1"),
    ],
)
def test_broken_config_metadata_is_named(tmp_path, stored, match):
    path = tmp_path / "m.safetensors"
    save_file(random_sam3_state_dict(TINY, 0), str(path), metadata={"sam3_config": stored})
    with pytest.raises(CheckpointError, match=rf"m\.safetensors: {match}" if match[0] == "s" else match):
        load_sam3_state_dict(path)


def test_folder_instead_of_file_says_what_is_expected(tmp_path):
    write_random_sam3(tmp_path / "sam3.pt", TINY, seed=0)
    with pytest.raises(
        CheckpointError, match=r"is a folder; expected a SAM 3 checkpoint file .*; it holds sam3\.pt"
    ):
        load_sam3_state_dict(tmp_path)
