"""Image decoding for the CPU decode workers: a path or encoded bytes in, RGB pixels and the original size
out, or the reason the image is unusable (a row-level error, never an exception).

EXIF orientation is applied, so height and width are those of the image as viewers show it. With a
target `size`, the image is resized to size x size (bilinear with antialiasing, aspect ratio not kept,
as SAM 3's processor does), and JPEG decoding uses Pillow's draft mode to decode at a reduced scale
first when the target is much smaller. Pillow releases the GIL while decoding and resizing, so a
thread pool decodes in parallel with the engine.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

_ROTATED = (5, 6, 7, 8)  # EXIF orientations that swap width and height
_DECODE_ERRORS = (
    OSError,
    ValueError,
    SyntaxError,
    Image.DecompressionBombError,
)


@dataclass(slots=True)
class Decoded:
    image: np.ndarray | None  # uint8 [h, w, 3] RGB (writable); None on error
    height: int | None  # original size, after EXIF orientation; None when unknown
    width: int | None
    error: str | None = None


def _sixteen_bit(img: Image.Image) -> bool | None:
    """Whether an integer greyscale image holds 16-bit samples: modes I;16* always; mode I (as Pillow
    opens 16-bit PNG and PGM files, and 16- or 32-bit TIFFs) unless a TIFF says otherwise (BitsPerSample
    not 16: an int32 TIFF, often 0..255 data); None for a TIFF whose values must decide. Read before
    `exif_transpose`, which drops the TIFF tags."""
    if img.mode.startswith("I;16"):
        return True
    if img.mode != "I":
        return False
    if img.format != "TIFF":
        return True
    bits = img.tag_v2.get(258)  # type: ignore[attr-defined]
    return True if (bits[0] if isinstance(bits, tuple) else bits) == 16 else None


def _to_8_bit(img: Image.Image, sixteen: bool | None) -> Image.Image:
    """16-bit greyscale scaled to 8 bits, 65535 -> 255 (Pillow's own conversion clips every value above
    255 to white); an undecided TIFF (`_sixteen_bit`) only when it holds values above 255."""
    if sixteen is False:
        return img
    wide = np.asarray(img)
    if sixteen is None and int(wide.max(initial=0)) <= 255:
        return img
    x = wide.astype(np.uint32) if wide.dtype.kind == "u" else np.clip(wide, 0, 65535).astype(np.uint32)
    np.minimum(x, 65535, out=x)
    x += 128
    x //= 257
    return Image.fromarray(x.astype(np.uint8))


def load(source: str | bytes | None, base_dir: str, size: int | None) -> Decoded:
    """Decode `source`: a file path (relative paths resolve against `base_dir`) or encoded bytes."""
    if source is None:
        return Decoded(None, None, None, "image is null; expected a path or encoded image bytes")
    if not source:  # an empty path would name the base folder itself
        return Decoded(None, None, None, "image is empty; expected a path or encoded image bytes")
    if isinstance(source, str):
        what = os.path.join(base_dir, source) if not os.path.isabs(source) else source
        opener: str | io.BytesIO = what
        label = f"image file {what!r}"
    else:
        opener = io.BytesIO(source)
        label = f"image bytes ({len(source)} bytes)"
    height = width = None
    try:
        with Image.open(opener) as img:  # over 2x Image.MAX_IMAGE_PIXELS: DecompressionBombError
            width, height = img.size
            orientation = img.getexif().get(0x0112)
            if orientation in _ROTATED:
                width, height = height, width
            if size is not None and img.format == "JPEG":
                img.draft("RGB", (size, size))
            sixteen = _sixteen_bit(img)
            if orientation not in (None, 1):  # both calls copy the pixels even when they have nothing to do
                img = ImageOps.exif_transpose(img)
            rgb = img if img.mode == "RGB" else _to_8_bit(img, sixteen).convert("RGB")
            if size is not None and rgb.size != (size, size):
                rgb = rgb.resize((size, size), Image.Resampling.BILINEAR)
            pixels = np.array(rgb)
    except FileNotFoundError:
        return Decoded(None, None, None, f"{label}: no such file")
    except UnidentifiedImageError:
        empty = isinstance(opener, str) and os.path.getsize(opener) == 0
        return Decoded(
            None, None, None, f"{label}: {'empty file' if empty else 'not an image format Pillow can read'}"
        )
    except _DECODE_ERRORS as e:
        return Decoded(None, height, width, f"{label}: cannot decode ({type(e).__name__}: {e})")
    return Decoded(pixels, height, width)
