import math

import pytest
import torch

from batchinfer.sam3.checkpoint import expected_shapes
from batchinfer.sam3.config import Sam3Config


def _count(shapes: dict[str, tuple[int, ...]], prefix: str) -> int:
    return sum(math.prod(s) for k, s in shapes.items() if k.startswith(prefix))


def test_real_config_parameter_counts_match_meta_builder():
    # Totals from the research note's arithmetic over Meta's model_builder (840,509,750 in all).
    shapes = expected_shapes(Sam3Config.real())
    assert _count(shapes, "") == 840_509_750
    assert _count(shapes, "backbone.vision_backbone.trunk.") == 446_237_696
    assert _count(shapes, "backbone.vision_backbone.convs.") == 7_802_112
    assert _count(shapes, "backbone.language_backbone.") == 353_724_672
    assert _count(shapes, "geometry_encoder.") == 8_215_808
    assert _count(shapes, "transformer.encoder.") == 9_472_512
    assert _count(shapes, "transformer.decoder.") == 11_575_093
    assert _count(shapes, "dot_prod_scoring.") == 1_182_976
    assert _count(shapes, "segmentation_head.") == 2_298_881


def test_real_config_key_shapes():
    shapes = expected_shapes(Sam3Config.real())
    assert shapes["backbone.vision_backbone.trunk.pos_embed"] == (1, 577, 1024)
    assert shapes["backbone.vision_backbone.trunk.patch_embed.proj.weight"] == (1024, 3, 14, 14)
    assert "backbone.vision_backbone.trunk.patch_embed.proj.bias" not in shapes
    assert shapes["backbone.vision_backbone.trunk.blocks.31.mlp.fc1.weight"] == (4736, 1024)
    assert shapes["backbone.vision_backbone.convs.0.dconv_2x2_0.weight"] == (1024, 512, 2, 2)
    assert shapes["backbone.language_backbone.encoder.transformer.resblocks.23.attn.in_proj_weight"] == (
        3072,
        1024,
    )
    assert shapes["backbone.language_backbone.encoder.text_projection"] == (1024, 512)
    assert shapes["backbone.language_backbone.resizer.weight"] == (256, 1024)
    assert shapes["transformer.decoder.query_embed.weight"] == (200, 256)
    assert shapes["transformer.decoder.reference_points.weight"] == (200, 4)
    assert shapes["transformer.decoder.boxRPB_embed_x.layers.1.weight"] == (8, 256)
    assert shapes["geometry_encoder.boxes_pos_enc_project.weight"] == (256, 258)
    assert shapes["segmentation_head.mask_predictor.mask_embed.layers.2.weight"] == (256, 256)


def test_grid_and_tiny_round_trip():
    assert Sam3Config.real().grid == 72
    tiny = Sam3Config.tiny()
    assert Sam3Config.from_dict(__import__("json").loads(tiny.to_json())) == tiny


@pytest.mark.parametrize(
    "change, message",
    [
        ({"image_size": 1000}, "patch_size"),
        ({"vit_window": 25}, "vit_window"),
        ({"vit_heads": 48}, "head dim"),
        ({"vit_global_blocks": (7, 15, 23)}, "last block"),
        ({"vit_global_blocks": (31, 7)}, "increasing"),
        ({"num_heads": 7}, "num_heads"),
    ],
)
def test_invalid_configs_name_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        Sam3Config(**change)


def test_unknown_field_rejected():
    with pytest.raises(ValueError, match="bogus"):
        Sam3Config.from_dict({"bogus": 1})


def test_meta_device_build_allocates_nothing():
    from batchinfer.sam3.model import Sam3Model

    with torch.device("meta"):
        model = Sam3Model(Sam3Config.real())
    assert all(p.is_meta for p in model.parameters())
