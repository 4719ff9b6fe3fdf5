"""Shapes of the SAM 3 image (detector) model: the real configuration and a tiny one for CPU tests.

The real values are those of Meta's `sam3/model_builder.py` (`_create_vit_backbone`,
`_create_text_encoder`, `_create_transformer_encoder/decoder`, ...); see docs in
`/work/shared/notes/sam3.md` section 1. Fields that the builder fixes for every model (neck scales
[4, 2, 1, 0.5], RoPE theta 10000, LayerNorm eps 1e-5) are constants in the modules, not knobs here.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(slots=True, frozen=True)
class Sam3Config:
    image_size: int = 1008  # square model input; images are resized to it without keeping aspect
    patch_size: int = 14
    vit_dim: int = 1024
    vit_depth: int = 32
    vit_heads: int = 16
    vit_mlp_dim: int = 4736  # int(1024 * 4.625)
    vit_window: int = 24  # window side in tokens (336 px)
    vit_global_blocks: tuple[int, ...] = (7, 15, 23, 31)
    vit_pretrain_grid: int = 24  # pos_embed grid: pretrain_img_size 336 // patch 14 (+ a cls row)
    d_model: int = 256
    text_width: int = 1024
    text_layers: int = 24
    text_heads: int = 16
    text_mlp_dim: int = 4096
    text_context: int = 32
    vocab_size: int = 49408
    text_proj_dim: int = 512  # `text_projection` is stored in the checkpoint but its output is unused
    num_heads: int = 8  # geometry encoder, fusion encoder, decoder, mask head attention
    ffn_dim: int = 2048
    geometry_layers: int = 3
    encoder_layers: int = 6
    decoder_layers: int = 6
    num_queries: int = 200
    scorer_mlp_dim: int = 2048

    def __post_init__(self) -> None:
        small = [f for f, v in asdict(self).items() if isinstance(v, int) and v < 1]
        if small:
            raise ValueError(f"{', '.join(small)} must be at least 1")
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size={self.image_size} is not a multiple of patch_size={self.patch_size}"
            )
        if self.grid % self.vit_window:
            raise ValueError(f"token grid {self.grid} is not a multiple of vit_window={self.vit_window}")
        if self.vit_dim % self.vit_heads or (self.vit_dim // self.vit_heads) % 4:
            raise ValueError(
                f"vit_dim={self.vit_dim} / vit_heads={self.vit_heads} must give a head dim divisible by 4 "
                "(2-D RoPE rotates x and y pairs)"
            )
        if self.vit_dim % 4:
            raise ValueError(f"vit_dim={self.vit_dim} must be divisible by 4 (the x4 neck level)")
        if (
            sorted(set(self.vit_global_blocks)) != list(self.vit_global_blocks)
            or self.vit_global_blocks[-1:] != (self.vit_depth - 1,)
            or self.vit_global_blocks[0] < 0
        ):
            # Meta's ViT returns the output of its last global block; ours returns the last block's.
            raise ValueError(
                f"vit_global_blocks={self.vit_global_blocks} must be increasing and end with the last block "
                f"{self.vit_depth - 1}"
            )
        if self.d_model % self.num_heads or self.d_model % 8:
            raise ValueError(
                f"d_model={self.d_model} must be divisible by num_heads={self.num_heads} and by 8"
            )
        if self.text_width % self.text_heads:
            raise ValueError(
                f"text_width={self.text_width} is not a multiple of text_heads={self.text_heads}"
            )
        if self.text_context < 3:
            raise ValueError(f"text_context={self.text_context} must hold start, one token and end")

    @property
    def grid(self) -> int:
        """Tokens per side of the ViT output (72 at real shapes)."""
        return self.image_size // self.patch_size

    @classmethod
    def real(cls) -> Sam3Config:
        return cls()

    @classmethod
    def tiny(cls) -> Sam3Config:
        """Every code path of the real model at a size a 2-core CPU runs in milliseconds."""
        return cls(
            image_size=56, patch_size=7, vit_dim=32, vit_depth=4, vit_heads=2, vit_mlp_dim=40,
            vit_window=4, vit_global_blocks=(1, 3), vit_pretrain_grid=4, d_model=32, text_width=32,
            text_layers=2, text_heads=2, text_mlp_dim=128, text_context=32, text_proj_dim=512,
            num_heads=4, ffn_dim=64, geometry_layers=1, encoder_layers=2, decoder_layers=2,
            num_queries=10, scorer_mlp_dim=64,
        )  # fmt: skip

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Sam3Config:
        """Parse `to_json()` output. Every field is required: every writer stores all of them, and a
        default here would be the real model's shape, which a tiny file's tensors then fail to match."""
        unknown = sorted(set(raw) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown Sam3Config fields {unknown}")
        missing = [f for f in cls.__dataclass_fields__ if f not in raw]
        if missing:
            raise ValueError(f"missing Sam3Config fields {missing}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for name, value in raw.items():
            if name == "vit_global_blocks":
                if not isinstance(value, list) or not all(map(is_int, value)):
                    raise ValueError(f"field {name} is {value!r}, expected a list of integers")
            elif not is_int(value):
                raise ValueError(f"field {name} is {value!r}, expected an integer")
        return cls(**{**raw, "vit_global_blocks": tuple(raw["vit_global_blocks"])})
