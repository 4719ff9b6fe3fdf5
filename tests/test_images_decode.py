"""Image decoding: formats, resize, EXIF orientation, and every way an image fails as an error value."""

import io

import numpy as np
from images_fixtures import encoded, scene
from PIL import Image

from batchinfer.images.decode import load


def test_png_path_and_bytes_give_exact_pixels(tmp_path):
    scene(1).save(tmp_path / "a.png")
    for source, base in (("a.png", str(tmp_path)), (str(tmp_path / "a.png"), "/elsewhere"), (encoded(1), "")):
        d = load(source, base, None)
        assert d.error is None and (d.height, d.width) == (64, 96)
        assert d.image.shape == (64, 96, 3) and d.image.dtype == np.uint8 and d.image.flags.writeable
        assert np.array_equal(d.image, np.asarray(scene(1)))


def test_resize_keeps_original_size_and_converts_modes():
    d = load(encoded(0, "JPEG"), "", 32)
    assert d.error is None and d.image.shape == (32, 32, 3) and (d.height, d.width) == (64, 96)
    buf = io.BytesIO()
    Image.new("L", (10, 20), 200).save(buf, "PNG")  # greyscale -> RGB
    d = load(buf.getvalue(), "", None)
    assert d.image.shape == (20, 10, 3) and (d.image == 200).all()


def test_exif_orientation_is_applied():
    im = Image.new("RGB", (40, 10), (255, 0, 0))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise for display
    buf = io.BytesIO()
    im.save(buf, "JPEG", exif=exif.tobytes())
    d = load(buf.getvalue(), "", None)
    assert (d.height, d.width) == (40, 10) and d.image.shape == (40, 10, 3)


def test_failures_are_values_not_exceptions(tmp_path):
    data = encoded(0, "JPEG")
    truncated = load(data[: len(data) // 2], "", None)
    assert truncated.image is None and "truncated" in truncated.error.lower()
    assert "not an image format" in load(b"garbage", "", None).error
    missing = load("nope.png", str(tmp_path), None)
    assert missing.error == f"image file '{tmp_path / 'nope.png'}': no such file"
    assert load(None, "", None).error.startswith("image is null")


def test_decompression_bomb_is_an_error_value(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 96 x 64 > 2 x 1000 pixels
    d = load(encoded(0), "", None)
    assert d.image is None and "DecompressionBombError" in d.error


def test_16_bit_greyscale_is_scaled_not_clipped(tmp_path):
    levels = np.array([[0, 257 * 29, 257 * 76, 65535]], dtype=np.uint16)  # 8-bit 0, 29, 76, 255 scaled up
    Image.fromarray(levels).save(tmp_path / "g16.png")
    Image.fromarray(levels).save(tmp_path / "g16.tif")
    Image.fromarray(levels.astype(np.int32)).save(tmp_path / "g32.tif")  # opens as mode "I"
    for name in ("g16.png", "g16.tif", "g32.tif"):
        d = load(name, str(tmp_path), None)
        assert d.error is None and d.image.shape == (1, 4, 3), name
        assert d.image[0, :, 0].tolist() == [0, 29, 76, 255], name
        assert (d.image == d.image[..., :1]).all()
    eight = np.array([[0, 100, 200, 255]], dtype=np.int32)  # an int32 TIFF of 8-bit data: mode "I" too
    Image.fromarray(eight).save(tmp_path / "g8.tif")
    assert load("g8.tif", str(tmp_path), None).image[0, :, 0].tolist() == [0, 100, 200, 255]
    dim = b"P5 4 1 65535\n" + np.array([0, 100, 200, 255], ">u2").tobytes()  # a dark 16-bit PGM
    (tmp_path / "dim.pgm").write_bytes(dim)
    assert Image.open(tmp_path / "dim.pgm").mode == "I"  # scaled by its format, not guessed from its values
    assert load("dim.pgm", str(tmp_path), None).image[0, :, 0].tolist() == [0, 0, 1, 1]


def test_empty_sources_say_so(tmp_path):
    (tmp_path / "zero.png").write_bytes(b"")
    assert load(str(tmp_path / "zero.png"), "", None).error.endswith(": empty file")
    for empty in ("", b""):  # "" once named the base folder: IsADirectoryError
        assert load(empty, str(tmp_path), None).error.startswith("image is empty")
