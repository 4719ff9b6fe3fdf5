"""Image job inputs: Parquet files (`schemas/image_input`), or folders and globs of image files, which
become one manifest Parquet file in the job directory so the shared job layer (plans, shards, row
ranges, fingerprints) sees nothing but Parquet.

A folder is searched recursively for image files; a row's id is the file's path relative to the folder
(for a glob, relative to the glob's folder part; for a single file, its name). The manifest is
`DIR/inputs/images-<hash>.parquet`, its name a hash of the listed files (path, size) and the job's
prompts, so a rerun over the same folder finds the same manifest and a changed folder makes a
different plan (refused like a changed input file).
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer.errors import InputError
from batchinfer.jobs import commit
from batchinfer.jobs import plan as plans
from batchinfer.jobs.plan import Plan

IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".jfif"}
)
MANIFEST_DIR = "inputs"


def _is_image(p: Path) -> bool:
    return p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS


def _images_of(pattern: str) -> list[tuple[str, Path]] | None:
    """(id, path) of the image files `pattern` names, or None when it names Parquet input instead."""
    p = Path(pattern).expanduser()
    if p.is_dir():
        found = sorted(x for x in p.rglob("*") if _is_image(x))
        if not found and any(p.rglob("*.parquet")):
            return None
        if not found:
            raise InputError(
                f"{pattern}: folder holds no image files; expected files ending in "
                f"{', '.join(sorted(IMAGE_EXTENSIONS))} (or Parquet files)"
            )
        return [(x.relative_to(p).as_posix(), x) for x in found]
    if glob.has_magic(pattern):
        hits = sorted(Path(x) for x in glob.glob(str(p), recursive=True) if Path(x).is_file())
        if hits and all(h.suffix.lower() == ".parquet" for h in hits):
            return None
        found = [h for h in hits if _is_image(h)]
        if not found:
            raise InputError(f"{pattern}: matches no image files (nor only Parquet files)")
        root = Path(*[part for part in p.parts[: _first_magic(p.parts)]])
        return [(h.relative_to(root).as_posix(), h) for h in found]
    if p.is_file():
        return [(p.name, p)] if p.suffix.lower() in IMAGE_EXTENSIONS else None
    raise InputError(f"{pattern}: no such file or directory")


def _first_magic(parts: Sequence[str]) -> int:
    return next(i for i, part in enumerate(parts) if glob.has_magic(part))


def split_inputs(patterns: Sequence[str]) -> tuple[list[str], list[tuple[str, Path]]]:
    """Separate Parquet inputs (returned as given) from image files (id, absolute path), in input order;
    a file named twice (a folder and a glob inside it) counts once, under the first input's id; two files
    with one id are refused."""
    parquet: list[str] = []
    paths: dict[str, Path] = {}  # id -> file; checked here, where the message can name both files
    listed: set[str] = set()  # absolute paths as named: symlinks to one file stay separate images
    for pattern in patterns:
        found = _images_of(pattern)
        if found is None:
            parquet.append(pattern)
            continue
        for image_id, path in found:
            named = os.path.abspath(path)
            if named in listed:  # ids are relative to each folder or glob: the first one names it
                continue
            listed.add(named)
            path = path.resolve()
            if paths.setdefault(image_id, path) != path:
                raise InputError(
                    f"{pattern}: id {image_id!r} of {path} is also the id of {paths[image_id]}; ids (paths "
                    "relative to the folder or glob given) must be unique: pass their common parent folder"
                )
    return parquet, list(paths.items())


def write_manifest(job_dir: Path, images: Sequence[tuple[str, Path]], prompts: Sequence[str]) -> Path:
    """The manifest Parquet file (id, image path, prompts) of image files; written once, atomically."""
    if not prompts:
        raise InputError(
            f"{len(images)} image files given as folder/glob input but no prompts; "
            "pass --prompt TEXT (repeatable) to say what to segment"
        )
    h = hashlib.sha256("\x00".join(prompts).encode())
    for image_id, path in images:
        h.update(f"\x01{image_id}\x00{path}\x00{path.stat().st_size}".encode())
    final = job_dir / MANIFEST_DIR / f"images-{h.hexdigest()[:16]}.parquet"
    if not final.exists():
        table = pa.table(
            {
                "id": pa.array([i for i, _ in images], pa.string()),
                "image": pa.array([str(p) for _, p in images], pa.string()),
                "prompts": pa.array([list(prompts)] * len(images), pa.list_(pa.string())),
            }
        )
        commit.write_parquet_atomic(final, table, {"batchinfer.manifest": "image files of --input"})
    return final


def _manifests(doc: dict[str, Any]) -> list[Path]:
    """The plan's inputs that are manifests of image files (this module's, in its job directory); `doc`'s
    input paths absolute (`plan.absolute_inputs`)."""
    paths = [Path(f["path"]) for f in doc["inputs"]]
    return [p for p in paths if p.parent.name == MANIFEST_DIR and p.name.startswith("images-")]


def listing_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The image files that two plans' listings differ by, to refuse the new plan with (the manifests'
    hashed names tell a user nothing): those added and removed, or, with the same files, that a file's size
    or the prompts changed (both are in a manifest's name)."""

    def images(doc: dict[str, Any]) -> dict[str, None]:
        files: dict[str, None] = {}
        for p in _manifests(doc):
            if p.exists():
                files.update(dict.fromkeys(pq.read_table(p, columns=["image"]).column("image").to_pylist()))
        return files

    if set(_manifests(old)) == set(_manifests(new)):
        return []
    before, after = images(old), images(new)
    changes = [
        f"image files {what}: "
        + ", ".join(names[:5])
        + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        for what, names in (
            ("added", [f for f in after if f not in before]),
            ("removed", [f for f in before if f not in after]),
        )
        if names
    ]
    return changes or ["the same image files, but one's size or the prompts changed"]


def remove_new_manifests(new: Plan, old: Plan) -> None:
    """Delete the manifests a refused plan `new` wrote that the job's plan `old` does not read."""
    keep = set(_manifests(plans.absolute_inputs(old.doc, old.job_dir)))
    for p in _manifests(plans.absolute_inputs(new.doc, new.job_dir)):
        if p not in keep:
            p.unlink(missing_ok=True)
