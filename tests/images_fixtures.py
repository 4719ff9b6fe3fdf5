"""Shared helpers of tests/test_images_*: synthetic images of pure-colour shapes with known pixels."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

SHAPES = "batchinfer.images.shapes_engine:ColorShapesEngine"


def scene(k: int, width: int = 96, height: int = 64) -> Image.Image:
    """A black image with a red circle (shifted by k), a blue 24x16 rectangle and, for odd k, a red
    triangle: `red` finds 1 or 2 instances, `blue` 1, `green` none."""
    im = Image.new("RGB", (width, height), (0, 0, 0))
    d = ImageDraw.Draw(im)
    d.ellipse((4 + k, 4, 28 + k, 28), fill=(255, 0, 0))
    d.rectangle((50, 6, 73, 21), fill=(0, 0, 255))
    if k % 2:
        d.polygon([(6, 60), (30, 60), (18, 40)], fill=(255, 0, 0))
    return im


def encoded(k: int, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    scene(k).save(buf, fmt)
    return buf.getvalue()


def image_folder(root: Path, n: int = 5, corrupt: bool = True) -> Path:
    """`n` scenes as PNG (and one JPEG in a subfolder), plus a corrupt `broken.png` when asked."""
    d = root / "imgs"
    (d / "sub").mkdir(parents=True, exist_ok=True)
    for k in range(n):
        scene(k).save(d / (f"sub/img{k}.jpg" if k == n - 1 else f"img{k}.png"))
    if corrupt:
        (d / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really a png" * 4)
    return d


def blue_mask(width: int = 96, height: int = 64) -> np.ndarray:
    """The exact pixels of scene()'s blue rectangle."""
    m = np.zeros((height, width), dtype=bool)
    m[6:22, 50:74] = True
    return m
