"""The synthetic shapes data set of the SAM 3 demo model: coloured circles, squares and triangles on
plain or noisy grey backgrounds, with exact per-instance masks, and the text prompts that name them.

A scene is a pure function of (seed, index, size), so the training stream, the held-out set and the
`examples/shapes` images are all reproducible from their seeds without storing ground truth. Prompts
are "<colour> <shape>" ("red circle"), "<colour> shapes" (every shape of that colour) and "<shape>s"
(every shape of that kind, any colour); a prompt's ground truth is the masks of the shapes it names,
possibly none. Shapes never overlap, so every mask is exactly the pixels drawn for its shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 45, 45),
    "green": (45, 170, 70),
    "blue": (45, 90, 225),
    "yellow": (235, 205, 45),
}
KINDS = ("circle", "square", "triangle")
PROMPTS: tuple[str, ...] = (
    *(f"{c} {k}" for c in COLOURS for k in KINDS),
    *(f"{c} shapes" for c in COLOURS),
    *(f"{k}s" for k in KINDS),
)
TRAIN_SEED = 0
HELDOUT_SEED = 1
EXAMPLES_SEED = 2
COLOUR_JITTER = 25  # per channel, so a colour is a range, not one RGB value
MAX_SHAPES = 4


@dataclass(slots=True)
class Shape:
    colour: str
    kind: str
    mask: np.ndarray  # bool [H, W]: exactly the pixels drawn for this shape


@dataclass(slots=True)
class Scene:
    image: np.ndarray  # uint8 [H, W, 3]
    shapes: list[Shape]

    def targets(self, prompt: str) -> list[np.ndarray]:
        """The masks of the shapes `prompt` names (one of PROMPTS), in drawing order."""
        return [s.mask for s in self.shapes if matches(prompt, s)]


def matches(prompt: str, shape: Shape) -> bool:
    if prompt not in PROMPTS:
        raise ValueError(f"unknown shapes prompt {prompt!r}; expected one of {', '.join(PROMPTS)}")
    words = prompt.split()
    if len(words) == 1:
        return words[0] == f"{shape.kind}s"
    return words[0] == shape.colour and words[1] in ("shapes", shape.kind)


def _outline(
    kind: str, x: float, y: float, side: float, rng: np.random.Generator
) -> list[tuple[float, float]]:
    """Polygon points (square, triangle) or the bounding box (circle) of a shape at (x, y)."""
    if kind == "triangle":  # isosceles, pointing up or down
        top, bottom = (y, y + side) if rng.random() < 0.5 else (y + side, y)
        return [(x, bottom), (x + side, bottom), (x + side / 2, top)]
    return [(x, y), (x + side, y + side)]


def make_scene(rng: np.random.Generator, size: int) -> Scene:
    """One size x size scene: 1 to MAX_SHAPES non-overlapping shapes of random colour, kind and size
    (16% to 34% of the side) on a grey background, half of them with per-pixel Gaussian noise."""
    grey = rng.integers(25, 231)
    background = np.clip(grey + rng.integers(-12, 13, size=3), 0, 255)
    image = Image.new("RGB", (size, size), tuple(int(v) for v in background))
    taken = np.zeros((size, size), dtype=bool)
    shapes: list[Shape] = []
    for _ in range(int(rng.integers(1, MAX_SHAPES + 1))):
        colour, kind = str(rng.choice(list(COLOURS))), str(rng.choice(KINDS))
        for _attempt in range(30):
            side = rng.uniform(0.16, 0.34) * size
            x, y = rng.uniform(1, size - side - 1, size=2)
            layer = Image.new("L", (size, size), 0)
            draw = ImageDraw.Draw(layer)
            points = _outline(kind, x, y, side, rng)
            if kind == "circle":
                draw.ellipse(points, fill=255)
            elif kind == "square":
                draw.rectangle(points, fill=255)
            else:
                draw.polygon(points, fill=255)
            mask = np.asarray(layer) > 0
            grown = (
                mask | np.roll(mask, 2, 0) | np.roll(mask, -2, 0) | np.roll(mask, 2, 1) | np.roll(mask, -2, 1)
            )
            if not (grown & taken).any():
                break
        else:
            continue  # no free spot for this one
        rgb = np.clip(
            np.asarray(COLOURS[colour]) + rng.integers(-COLOUR_JITTER, COLOUR_JITTER + 1, 3), 0, 255
        )
        image.paste(tuple(int(v) for v in rgb), mask=layer)
        taken |= mask
        shapes.append(Shape(colour, kind, mask))
    pixels = np.asarray(image, dtype=np.float32)
    if rng.random() < 0.5:
        pixels = pixels + rng.normal(0.0, rng.uniform(6, 24), size=pixels.shape)
    return Scene(np.clip(pixels.round(), 0, 255).astype(np.uint8), shapes)


def scene(seed: int, index: int, size: int) -> Scene:
    """Scene `index` of the stream `seed` (TRAIN_SEED, HELDOUT_SEED, EXAMPLES_SEED)."""
    return make_scene(np.random.default_rng([seed, index]), size)


def scenes(seed: int, count: int, size: int, start: int = 0) -> Iterator[Scene]:
    for i in range(start, start + count):
        yield scene(seed, i, size)


def write_examples(out_dir: str | Path, count: int = 8, size: int = 160) -> Path:
    """The `examples/shapes` image set: `scene-NN.png`, `images.parquet` (the job input: `id`, `image`
    as a relative path, `prompts`: two prompts naming something and one naming nothing) and
    `truth.parquet` (`id`, `prompt`, `instances`: how many shapes each prompt names)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows, truth = [], []
    for i in range(count):
        s = scene(EXAMPLES_SEED, i, size)
        name = f"scene-{i:02d}"
        Image.fromarray(s.image).save(out / f"{name}.png", optimize=True)
        rng = np.random.default_rng([EXAMPLES_SEED, i, 1])
        present = [p for p in PROMPTS if s.targets(p)]
        absent = [p for p in PROMPTS if not s.targets(p)]
        prompts = [*rng.choice(present, size=min(2, len(present)), replace=False), rng.choice(absent)]
        rows.append({"id": name, "image": f"{name}.png", "prompts": [str(p) for p in prompts]})
        truth += [{"id": name, "prompt": str(p), "instances": len(s.targets(str(p)))} for p in prompts]
    pq.write_table(pa.Table.from_pylist(rows), out / "images.parquet")
    pq.write_table(pa.Table.from_pylist(truth), out / "truth.parquet")
    return out


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(
        description="Write the examples/shapes image set (seeded, reproducible)."
    )
    parser.add_argument("--out", default="examples/shapes")
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--size", type=int, default=160)
    args = parser.parse_args()
    print(write_examples(args.out, args.count, args.size))
