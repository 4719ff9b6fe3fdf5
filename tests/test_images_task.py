"""The image task end to end on the shared job layer (plan, shards, chunks, query, export, retry), with
the colour-shapes engine: folder and Parquet inputs, error rows, no-detection rows, metadata, DuckDB."""

import json

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from batchinfer.jobs import attempts, query, status, worker
from batchinfer.jobs import plan as plans
from images_fixtures import SHAPES, blue_mask, encoded, image_folder, scene

from batchinfer.engine.api import ImageResult
from batchinfer.errors import InputError, PlanMismatchError
from batchinfer.images import rle, sources
from batchinfer.images.shapes_engine import ColorShapesEngine


def _job(job, patterns, prompts=("red", "blue", "green"), threshold=0.5, engine=None, **kw):
    parquet, images = sources.split_inputs([str(p) for p in patterns])
    if images:
        parquet.append(str(sources.write_manifest(job, images, list(prompts))))
    params = {"score_threshold": threshold, "prompts": list(prompts)}
    plan = plans.open_or_create(plans.build_plan(job, parquet, "", params, engine=SHAPES, task="image", **kw))
    worker.run_shards(plan, list(range(plan.num_shards)), engine or ColorShapesEngine(batch_size="2"))
    return plan


def test_folder_job_one_row_per_instance_absence_and_error(tmp_path):
    job = tmp_path / "job"
    plan = _job(job, [image_folder(tmp_path, n=4)], num_shards=2, chunk_rows=2)
    con = query.connect(job)
    rows = con.sql("SELECT * FROM latest ORDER BY row, prompt_index, instance").fetchall()
    cols = [d[0] for d in con.sql("SELECT * FROM latest").description]
    got = [dict(zip(cols, r, strict=True)) for r in rows]
    (broken,) = [r for r in got if r["id"] == "broken.png"]
    assert broken["prompt"] is None and broken["instance"] is None and "broken.png" in broken["error"]
    per = {(r["id"], r["prompt"]): [] for r in got if r["prompt"]}
    for r in got:
        if r["prompt"]:
            per[(r["id"], r["prompt"])].append(r)
    for k, name in enumerate(["img0.png", "img1.png", "img2.png", "sub/img3.jpg"]):
        assert [r["instance"] for r in per[(name, "red")]] == ([0, 1] if k % 2 else [0])
        (green,) = per[(name, "green")]  # absence is one queryable row
        assert green["instance"] is None and green["mask_rle"] is None and green["error"] is None
        assert green["presence_score"] == 0.0 and green["score"] is None
        (blue,) = per[(name, "blue")]
        assert (blue["height"], blue["width"]) == (64, 96) and blue["prompt_index"] == 1
        mask = rle.decode(blue["mask_rle"], 64, 96)
        if name.endswith(".png"):  # lossless: exact pixels
            assert np.array_equal(mask, blue_mask()) and blue["area"] == 24 * 16
            assert blue["box"] == [50.0, 6.0, 74.0, 22.0]
        assert blue["area"] == int(mask.sum()) and blue["score"] == 1.0 and blue["presence_score"] == 1.0
    s = status.summarize(job)
    assert s["task"] == "image" and s["rows_done"] == 5 and s["finish_reasons"] == {"ok": 4, "error": 1}
    assert s["shards_done"] == 2 and plan.doc["task"] == "image"


def test_parquet_inputs_bytes_paths_prompts_and_kept_columns(tmp_path):
    scene(0).save(tmp_path / "a.png")
    pq.write_table(pa.table({"id": [10, 11], "image": [encoded(1), b"junk"],
                             "prompts": [["blue", "red", "blue", " "], None], "tag": ["x", "y"]}),
                   tmp_path / "p1.parquet")  # fmt: skip
    pq.write_table(pa.table({"id": [12, 13], "image": ["a.png", None],
                             "prompts": pa.array([[], ["red"]], pa.list_(pa.string())), "tag": ["z", "w"]}),
                   tmp_path / "p2.parquet")  # fmt: skip
    job = tmp_path / "job"
    _job(job, [tmp_path / "p1.parquet", tmp_path / "p2.parquet"], prompts=["green"], keep_columns=["tag"])
    con = query.connect(job)
    out = con.sql("SELECT id, tag, prompt, prompt_index, instance, error FROM latest "
                  "ORDER BY row, prompt_index, instance").fetchall()  # fmt: skip
    assert out[:3] == [
        (10, "x", "blue", 0, 0, None),
        (10, "x", "red", 1, 0, None),
        (10, "x", "red", 1, 1, None),
    ]
    assert out[3][:4] == (11, "y", None, None) and "not an image format" in out[3][5]
    assert out[4] == (12, "z", "green", 0, None, None)  # empty list: the job's --prompt
    assert out[5][:3] == (13, "w", None) and out[5][5].startswith("image is null")
    assert con.execute("SELECT typeof(id) FROM latest LIMIT 1").fetchone()[0] == "BIGINT"


def test_image_bytes_in_huge_row_groups_get_a_warning_at_planning(tmp_path, monkeypatch, caplog):
    from batchinfer.images import task

    rows = {"id": [1, 2, 3], "image": [encoded(k) for k in range(3)], "prompts": [["red"]] * 3}
    pq.write_table(pa.table(rows), tmp_path / "one.parquet")
    pq.write_table(pa.table(rows), tmp_path / "three.parquet", row_group_size=1)
    group = pq.ParquetFile(tmp_path / "one.parquet").metadata.row_group(0).total_byte_size
    monkeypatch.setattr(task, "ROW_GROUP_WARN_BYTES", group - 1)  # the 3-image group is "huge" now
    warned = {}
    for name in ("one", "three"):
        caplog.clear()
        params = {"score_threshold": 0.5, "prompts": []}
        plans.build_plan(tmp_path / name, [str(tmp_path / f"{name}.parquet")], "", params, engine=SHAPES,
                         task="image")  # fmt: skip
        warned[name] = [r.getMessage() for r in caplog.records if "row group" in r.getMessage()]
    assert not warned["three"] and len(warned["one"]) == 1
    assert "one.parquet: row group 0 holds" in warned["one"][0] and "row_group_size=256" in warned["one"][0]


def test_metadata_and_plain_duckdb_over_masks(tmp_path):
    job = tmp_path / "job"
    plan = _job(job, [image_folder(tmp_path, n=3, corrupt=False)], threshold=0.25, chunk_rows=10)
    (path,) = job.glob("shards/*/*.parquet")
    meta = {k.decode(): v.decode() for k, v in pq.read_metadata(path).metadata.items()}
    assert json.loads(meta["batchinfer.thresholds"]) == {"score_threshold": 0.25}
    assert json.loads(meta["batchinfer.prompts"]) == ["red", "blue", "green"]
    assert meta["batchinfer.schema"] == "mask_output/1" and meta["batchinfer.plan_id"] == plan.plan_id
    assert json.loads(meta["batchinfer.engine"])["engine"] == "color-shapes"
    chunk = json.loads(meta["batchinfer.chunk"])
    assert chunk["instances"] == 4 + 3  # red 1+2+1, blue 3
    assert 0 < chunk["engine_seconds"] <= chunk["seconds"]
    assert 0 <= chunk["decode_wait_seconds"] <= chunk["seconds"]
    found = duckdb.sql(f"""
        SELECT prompt, count(instance) AS n, sum(area) FILTER (WHERE id LIKE '%.png') AS png_px,
               count(*) FILTER (WHERE instance IS NULL) AS none
        FROM read_parquet('{job}/shards/*/*.parquet') GROUP BY prompt ORDER BY prompt""").fetchall()
    red_px = int(sum(np.asarray(scene(k))[..., 0].astype(bool).sum() for k in range(2)))  # the PNGs
    assert found == [("blue", 3, 2 * 24 * 16, 0), ("green", 0, None, 3), ("red", 4, red_px, 0)]
    masks = duckdb.sql(f"SELECT mask_rle, area FROM read_parquet('{job}/shards/*/*.parquet') WHERE area > 0")
    assert all(rle.area(m) == a for m, a in masks.fetchall())
    out = tmp_path / "all.parquet"
    assert query.export(job, out) == 4 + 3 + 3  # red, blue, green (none) rows
    table = pq.read_table(out)
    assert table.column("id").to_pylist()[:5] == ["img0.png"] * 3 + ["img1.png"] * 2
    exported = {k.decode(): v.decode() for k, v in pq.read_metadata(out).metadata.items()}
    for key in ("batchinfer.thresholds", "batchinfer.prompts", "batchinfer.schema", "batchinfer.plan_id"):
        assert exported[key] == meta[key], key  # the exported file still says how its rows were made


def test_retry_errors_reruns_failed_images_as_new_attempt(tmp_path):
    d = image_folder(tmp_path, n=2)
    job = tmp_path / "job"
    plan = _job(job, [d])
    rows = query.rows_to_retry(job, ["error"])
    assert rows == {0: [0]}  # broken.png sorts first
    scene(0).save(d / "broken.png")  # repaired in place
    attempts.create_retry(plan, rows, ["error"])
    worker.run_shards(plan, attempts.incomplete_shards(plan), ColorShapesEngine())
    con = query.connect(job)
    assert con.sql("SELECT attempt, count(*) FROM results WHERE id = 'broken.png' GROUP BY 1 ORDER BY 1"
                   ).fetchall() == [(1, 1), (2, 3)]  # fmt: skip
    assert con.execute("SELECT count(*) FROM latest WHERE error IS NOT NULL").fetchone()[0] == 0
    assert status.summarize(job)["finish_reasons"] == {"ok": 3}


def test_changed_threshold_is_a_different_plan(tmp_path):
    d = image_folder(tmp_path, n=2)
    _job(tmp_path / "job", [d])
    with pytest.raises(PlanMismatchError, match="score_threshold"):
        _job(tmp_path / "job", [d], threshold=0.7)


class _BadEngine:
    """Fails its second image in-band and, when asked, returns a result twice."""

    batch_size = 4
    input_size = None

    def __init__(self, repeat=False):
        self.repeat = repeat

    def describe(self):
        return {"engine": "bad"}

    def segment(self, requests, score_threshold):
        for r in requests:
            error = "engine says no" if r.index == 1 else None
            yield ImageResult(
                r.index, [[] for _ in r.prompts] if not error else [], [0.1] * len(r.prompts), error
            )
            if self.repeat:
                yield ImageResult(r.index, [], [], "again")


def test_engine_errors_are_rows_and_contract_breaks_raise(tmp_path):
    d = image_folder(tmp_path, n=3, corrupt=False)
    con = query.connect(_job(tmp_path / "a", [d], prompts=["red"], engine=_BadEngine()).job_dir)
    assert con.sql("SELECT id, presence_score, error FROM latest ORDER BY row").fetchall() == [
        ("img0.png", pytest.approx(0.1), None), ("img1.png", None, "engine says no"),
        ("sub/img2.jpg", pytest.approx(0.1), None)]  # fmt: skip
    with pytest.raises(RuntimeError, match="unknown or repeated result index 0"):
        _job(tmp_path / "b", [d], prompts=["red"], engine=_BadEngine(repeat=True))
    assert not list((tmp_path / "b").glob("shards/*/*.parquet"))


@pytest.mark.parametrize(
    "params, message",
    [
        ({"score_threshold": 0.5, "prompts": [], "top_k": 3}, r"unknown \['top_k'\]"),
        ({"score_threshold": True, "prompts": []}, "must be a number in"),
        ({"score_threshold": 0.5, "prompts": "red"}, "must be a list of strings"),
    ],
)
def test_bad_job_parameters_are_refused_at_plan_time(tmp_path, params, message):
    d = image_folder(tmp_path, n=1, corrupt=False)
    _, images = sources.split_inputs([str(d)])
    manifest = sources.write_manifest(tmp_path / "job", images, ["red"])
    with pytest.raises(InputError, match=message):
        plans.build_plan(tmp_path / "job", [str(manifest)], "", params, engine=SHAPES, task="image")
