"""`batchinfer segment` as a user runs it: kill -9 mid-job and resume (also through `batchinfer run`),
status, refused plan changes and one-line input errors."""

import json
import signal
import subprocess
import time

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from images_fixtures import SHAPES, image_folder, scene
from jobs_fixtures import BATCHINFER, run_cli

from batchinfer.sam3.checkpoint import write_random_sam3
from batchinfer.sam3.config import Sam3Config

KEY = "id, prompt_index, instance"


def _args(d, out, *extra):
    return ["segment", "-i", str(d), "-o", str(out), "-p", "red", "-p", "blue", "-p", "green",
            "--engine", SHAPES, "--progress", "none", *extra]  # fmt: skip


def _rows(out):
    glob = f"{out}/shards/*/*.parquet"
    if not list(out.glob("shards/*/*.parquet")):
        return 0, 0
    return duckdb.execute(f"SELECT count(*), count(DISTINCT ({KEY})) FROM read_parquet('{glob}')").fetchone()


def test_kill_then_resume_gives_every_row_exactly_once(tmp_path):
    d = image_folder(tmp_path, n=3)
    for k in range(3, 24):
        scene(k).save(d / f"more{k:02d}.png")
    out = tmp_path / "out"
    args = _args(d, out, "--shards", "2", "--chunk-rows", "2", "--engine-arg", "delay=0.04")
    for _ in range(3):
        before = len(list(out.glob("shards/*/*.parquet")))
        proc = subprocess.Popen([BATCHINFER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while len(list(out.glob("shards/*/*.parquet"))) <= before and time.monotonic() < deadline:
            rows, distinct = _rows(out)  # readable at every moment, never a duplicate
            assert rows == distinct
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    done = len(list(out.glob("shards/*/*.parquet")))
    assert 3 <= done < 13  # 25 images in chunks of 2 over 2 shards: 13 chunks
    resumed = run_cli("-q", "run", "--output", str(out), "--progress", "none")  # any job resumes this way
    assert resumed.returncode == 0, resumed.stderr
    fresh = tmp_path / "fresh"
    assert run_cli(*_args(d, fresh, "--chunk-rows", "100")).returncode == 0
    query = f"SELECT * EXCLUDE (shard) FROM read_parquet('{{}}/shards/*/*.parquet') ORDER BY {KEY}"
    killed = duckdb.execute(query.format(out)).fetchall()
    assert killed == duckdb.execute(query.format(fresh)).fetchall()
    assert len({(r[0], r[3], r[4]) for r in killed}) == len(killed) and len({r[0] for r in killed}) == 25
    status = run_cli("status", str(out))
    assert "25/25 done" in status.stdout and "error 1, ok 24" in status.stdout and "images/s" in status.stdout


def test_a_moved_job_folder_resumes_on_its_own_image_listing(tmp_path):
    """The listing a folder input becomes lives in the job folder; the plan names it relative to the folder,
    so a copy elsewhere resumes, and a changed folder is still explained and its new listing removed."""
    d = image_folder(tmp_path, n=3)
    out = tmp_path / "out"
    assert run_cli(*_args(d, out, "--chunk-rows", "2", "--shard", "0", "--shards", "2")).returncode == 0
    assert json.loads((out / "plan.json").read_text())["inputs"][0]["path"].startswith("inputs/images-")
    moved = tmp_path / "elsewhere" / "job"
    moved.parent.mkdir()
    out.rename(moved)
    r = run_cli(*_args(d, moved, "--chunk-rows", "2"))
    assert r.returncode == 0 and "all selected shards" in r.stderr, r.stderr
    assert "4/4 done" in run_cli("status", str(moved)).stdout  # three scenes and broken.png
    r = run_cli("query", str(moved), "SELECT count(*) AS n FROM inputs")
    assert r.returncode == 0 and " 4 " in r.stdout, r.stderr
    scene(9).save(d / "new.png")
    r = run_cli(*_args(d, moved, "--chunk-rows", "2"))
    assert r.returncode == 2 and f"image files added: {d / 'new.png'}" in r.stderr, r.stderr
    assert len(list((moved / "inputs").iterdir())) == 1


def test_user_errors_are_one_line_exit_2(tmp_path):
    d = image_folder(tmp_path, n=2)
    out = tmp_path / "out"
    r = run_cli("segment", "-i", str(d), "-o", str(out), "--engine", SHAPES)
    assert r.returncode == 2 and "no prompts; pass --prompt TEXT" in r.stderr
    r = run_cli(*_args(d, out, "--engine-arg", "colour=red"))
    assert r.returncode == 2 and "--engine-arg for" in r.stderr and "colour" in r.stderr
    assert run_cli(*_args(d, out, "--score-threshold", "0.6")).returncode == 0
    assert run_cli(*_args(d, out)).returncode == 0  # unspecified parameters come from the plan: a resume
    r = run_cli(*_args(d, out, "--score-threshold", "0.5"))
    assert r.returncode == 2 and "score_threshold" in r.stderr and "--force-new-plan" in r.stderr
    r = run_cli(*_args(d, out, "--score-threshold", "1.5", "--force-new-plan"))
    assert r.returncode == 2 and "--score-threshold must be a number in [0, 1), got 1.5" in r.stderr
    r = run_cli("segment", "-o", str(out), "--plan-only")
    assert r.returncode == 0 and "3 images in 1 shards" in r.stderr
    for flag in ("--shards", "--chunk-rows"):  # 0 was taken as "the default"
        r = run_cli(*_args(d, tmp_path / "zero", flag, "0"))
        assert r.returncode == 2 and f"Invalid value for '{flag}': 0 is not in the range x>=1" in r.stderr
    r = run_cli(*_args(d, tmp_path / "one", "--chunk-rows", "1", "--plan-only"))  # a given value is kept
    assert r.returncode == 0 and '"chunk_rows": 1' in (tmp_path / "one" / "plan.json").read_text()
    r = run_cli("run", "-o", str(out), "-i", str(d), "-m", str(tmp_path))  # text flags on an image job
    assert r.returncode == 2 and "an image job; resume it with `batchinfer run --output" in r.stderr
    assert run_cli("run", "-o", str(out), "--progress", "none").returncode == 0  # a plain resume still runs
    scene(7).save(d / "new.png")  # the folder gains an image: refused, the message names it, no new manifest
    r = run_cli(*_args(d, out))
    assert r.returncode == 2 and f"image files added: {d / 'new.png'};" in r.stderr, r.stderr
    assert len(list((out / "inputs").glob("images-*.parquet"))) == 1
    (d / "img0.png").unlink()
    r = run_cli(*_args(d, out))
    assert f"image files removed: {d / 'img0.png'}" in r.stderr, r.stderr


def test_duplicate_keep_columns_are_refused_before_the_plan(tmp_path):
    """They were planned, then every run failed in pyarrow."""
    pq.write_table(pa.table({"id": [1], "image": ["a.png"], "prompts": [["red"]], "src": ["x"]}),
                   tmp_path / "img.parquet")  # fmt: skip
    out = tmp_path / "out"
    r = run_cli(*_args(tmp_path / "img.parquet", out, "--keep-columns", "src,src"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == "error: --keep-columns names column 'src' twice; expected each column once"
    assert not (out / "plan.json").exists()


def test_keep_columns_of_image_files_are_refused_before_a_manifest(tmp_path):
    """Image folders have no columns: the error says so and leaves no manifest behind (it named the
    manifest's missing column)."""
    d = image_folder(tmp_path / "imgs", n=2)
    out = tmp_path / "out"
    r = run_cli(*_args(d, out, "--keep-columns", "src"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--keep-columns 'src': applies to Parquet inputs only" in r.stderr
    assert not (out / "inputs").exists() and not (out / "plan.json").exists()


def test_progress_counts_images(tmp_path):
    d = image_folder(tmp_path / "imgs", n=4)
    r = run_cli(*_args(d, tmp_path / "j")[:-2], "--chunk-rows", "2", "--progress", "json")
    events = [json.loads(line) for line in r.stdout.splitlines()]
    assert r.returncode == 0 and [e["rows_done"] for e in events if e["event"] == "chunk"] == [2, 4, 5]
    assert events[-1]["event"] == "end" and events[-1]["rows_per_s"] > 0
    r = run_cli(*_args(d, tmp_path / "k")[:-2], "--progress", "bar")  # tqdm writes to stderr, tty or not
    assert r.returncode == 0 and "images" in r.stderr and "tokens" not in r.stderr, r.stderr


def test_gpus_workers_are_as_quiet_as_segment(tmp_path):
    d = image_folder(tmp_path / "imgs", n=3)
    out = tmp_path / "g"
    r = run_cli("-q", *_args(d, out, "--shards", "2", "--gpus", "all"), env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert r.returncode == 0 and "INFO" not in r.stderr, r.stderr  # workers' lines come back as [gpu N] ...
    assert "attempt 1 chunk" in (out / "logs/shard-00000.log").read_text()


def test_default_engine_without_a_model_file_is_refused_before_any_plan(tmp_path):
    d = image_folder(tmp_path, n=1)
    out = tmp_path / "out"
    r = run_cli("segment", "-i", str(d), "-o", str(out), "-p", "red", "--progress", "none")
    assert r.returncode == 2 and "needs --model" in r.stderr, r.stderr
    assert not out.exists()  # else adding --model is refused as a different job (a plan without a model)
    (tmp_path / "sam3").mkdir()
    (tmp_path / "sam3" / "sam3.safetensors").write_bytes(b"")
    r = run_cli("segment", "-i", str(d), "-o", str(out), "-p", "red", "-m", str(tmp_path / "sam3"))
    assert r.returncode == 2 and "is a folder" in r.stderr and "it holds sam3.safetensors" in r.stderr
    assert not out.exists()
    # a file that is no SAM 3 checkpoint: was recorded in the plan, failed at load, and the correct
    # --model was then refused as a different job
    from batchinfer.checkpoint.presets import write_preset

    qwen = write_preset("tiny-qwen3-moe", tmp_path / "qwen") / "model.safetensors"
    for model, message in (
        (tmp_path / "sam3" / "sam3.safetensors", "not a readable safetensors file"),
        (BATCHINFER, "not a readable torch checkpoint"),  # any file that is not one
        (
            qwen,
            "no SAM 3 detector tensors (keys starting with 'detector.'); first keys found: lm_head.weight",
        ),
    ):
        r = run_cli("segment", "-i", str(d), "-o", str(out), "-p", "red", "-m", str(model))
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not out.exists()


def test_sam3_engine_arg_values_are_checked_before_the_plan(tmp_path):
    d = image_folder(tmp_path / "imgs", n=2)
    ckpt = tmp_path / "sam3.safetensors"
    write_random_sam3(ckpt, Sam3Config.tiny(), seed=0)  # its tensors are not read before the run
    base = ["segment", "-i", str(d), "-p", "red", "-m", str(ckpt), "--progress", "none"]
    r = run_cli(*base, "-o", str(tmp_path / "bad"), "--engine-arg", "batch_size=abc")
    assert r.returncode == 2 and "batch_size='abc': expected a whole number >= 1" in r.stderr, r.stderr
    assert not (tmp_path / "bad" / "plan.json").exists()
    r = run_cli(*base, "-o", str(tmp_path / "login"), "--engine-arg", "device=cuda", "--plan-only")
    assert r.returncode == 0, r.stderr  # the GPU is the run's business, not the planning machine's


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a CUDA GPU")
def test_a_segment_run_starting_here_needs_the_gpu_it_names(tmp_path):
    d = image_folder(tmp_path / "imgs", n=2)
    ckpt = tmp_path / "sam3.safetensors"
    write_random_sam3(ckpt, Sam3Config.tiny(), seed=0)  # its tensors are not read before the run
    out = tmp_path / "here"
    r = run_cli("segment", "-i", str(d), "-p", "red", "-m", str(ckpt), "-o", str(out), "--engine-arg",
                "device=cuda")  # fmt: skip
    assert r.returncode == 2 and "device=cuda: this machine has no CUDA GPU" in r.stderr, r.stderr
    assert not (out / "plan.json").exists()


def test_shared_commands_help_says_what_image_jobs_get():
    """query, export, retry-errors and status serve image jobs too; their help said one row per id."""
    for command in ("query", "export", "retry-errors", "status"):
        text = " ".join(run_cli(command, "--help").stdout.split())
        assert "image jobs" in text, command
