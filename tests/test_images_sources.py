"""Image inputs: folders, globs and single files become a manifest Parquet file; Parquet passes through."""

import pyarrow.parquet as pq
import pytest
from images_fixtures import image_folder

from batchinfer.errors import InputError
from batchinfer.images import sources


def test_folder_ids_are_relative_paths(tmp_path):
    d = image_folder(tmp_path, n=3)
    (d / "notes.txt").write_text("not an image")
    parquet, images = sources.split_inputs([str(d)])
    assert parquet == []
    assert [i for i, _ in images] == ["broken.png", "img0.png", "img1.png", "sub/img2.jpg"]
    assert all(p.is_absolute() and p.exists() for _, p in images)


def test_globs_single_files_and_parquet(tmp_path):
    d = image_folder(tmp_path, n=3)
    (tmp_path / "t.parquet").write_bytes(b"")
    parquet, images = sources.split_inputs(
        [
            str(d / "**" / "*.jpg"),
            str(d / "img0.png"),
            str(tmp_path / "t.parquet"),
            str(tmp_path / "*.parquet"),
        ]
    )
    assert [i for i, _ in images] == ["sub/img2.jpg", "img0.png"]
    assert parquet == [str(tmp_path / "t.parquet"), str(tmp_path / "*.parquet")]


def test_empty_or_missing_inputs_are_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="folder holds no image files"):
        sources.split_inputs([str(tmp_path / "empty")])
    with pytest.raises(InputError, match="matches no image files"):
        sources.split_inputs([str(tmp_path / "*.png")])
    with pytest.raises(InputError, match="no such file or directory"):
        sources.split_inputs([str(tmp_path / "nope")])


def test_manifest_is_stable_and_follows_changes(tmp_path):
    d = image_folder(tmp_path, n=2, corrupt=False)
    _, images = sources.split_inputs([str(d)])
    job = tmp_path / "job"
    path = sources.write_manifest(job, images, ["red", "blue"])
    table = pq.read_table(path)
    assert table.column("id").to_pylist() == ["img0.png", "sub/img1.jpg"]
    assert table.column("prompts").to_pylist() == [["red", "blue"]] * 2
    assert sources.write_manifest(job, images, ["red", "blue"]) == path  # same listing, same file
    assert sources.write_manifest(job, images, ["red"]) != path  # other prompts, other manifest
    (d / "img0.png").write_bytes((d / "img0.png").read_bytes() + b"\0")
    assert sources.write_manifest(job, sources.split_inputs([str(d)])[1], ["red", "blue"]) != path
    with pytest.raises(InputError, match="pass --prompt"):
        sources.write_manifest(job, images, [])


def test_same_id_from_two_files_names_both_files(tmp_path):
    d = image_folder(tmp_path, n=2, corrupt=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "img0.png").write_bytes((d / "img0.png").read_bytes())
    with pytest.raises(InputError) as e:
        sources.split_inputs([str(d / "img0.png"), str(tmp_path / "other")])
    assert str(d / "img0.png") in str(e.value) and str(tmp_path / "other" / "img0.png") in str(e.value)
    assert "id 'img0.png'" in str(e.value)
    # one file named twice (a folder and a glob inside it) is one image, as a Parquet file given twice
    _, images = sources.split_inputs([str(d), str(d / "*.png")])
    assert [i for i, _ in images] == ["img0.png", "sub/img1.jpg"]
    for inner in (d / "sub/*.jpg", d / "sub/img1.jpg"):  # another id for the same file: the first one holds
        _, images = sources.split_inputs([str(d), str(inner)])
        assert [i for i, _ in images] == ["img0.png", "sub/img1.jpg"]
    (d / "link.png").symlink_to(d / "img0.png")  # two names of one file (a hub snapshot's blobs): two images
    _, images = sources.split_inputs([str(d)])
    assert [i for i, _ in images] == ["img0.png", "link.png", "sub/img1.jpg"]
