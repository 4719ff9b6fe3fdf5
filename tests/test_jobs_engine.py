"""The job layer over the real reference engine (`load_engine`) and a tiny random NVFP4 checkpoint."""

import random
import signal
import subprocess
import time

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from batchinfer.jobs import attempts, query, worker
from batchinfer.jobs import plan as plans
from batchinfer.jobs.engines import LazyEngine
from jobs_fixtures import BATCHINFER, run_cli

from batchinfer.checkpoint.presets import write_preset
from batchinfer.errors import ConfigError

ENGINE_ARGS = {"max_model_len": "64", "max_batch_size": "8"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_preset("tiny-qwen3.5-moe", tmp_path_factory.mktemp("ckpt") / "model", quant="nvfp4", seed=3)


def _inputs(tmp_path, files=2, rows=12):
    d = tmp_path / "in"
    d.mkdir()
    for f in range(files):
        ids = [f"r{f}-{i:02d}" for i in range(rows)]
        prompts = [
            f"The number {i} and the colour {'red green blue'.split()[i % 3]} are" for i in range(rows)
        ]
        prompts[2], prompts[3] = "", "many words " * 80  # empty, over-long
        max_tokens = [0 if i == 1 else None for i in range(rows)]  # invalid per-row sampling value
        table = pa.table({"id": ids, "prompt": prompts, "max_tokens": pa.array(max_tokens, pa.int64())})
        pq.write_table(table, d / f"p{f}.parquet")
    return d


def _plan(tmp_path, checkpoint, out="out", shards=1, chunk_rows=6, sampling=None):
    p = plans.build_plan(tmp_path / out, [str(tmp_path / "in")], checkpoint, sampling or {"max_tokens": 6},
                         num_shards=shards, chunk_rows=chunk_rows, engine_args=ENGINE_ARGS)  # fmt: skip
    return plans.open_or_create(p)


def _engine(p):
    return LazyEngine(p.doc["engine"]["factory"], p.doc["model"]["path"], p.doc["engine"]["args"])


def _latest(job_dir):
    con = query.connect(job_dir)
    return {
        r[0]: r[1:]
        for r in con.sql("SELECT id, text, finish_reason, error, output_tokens FROM latest").fetchall()
    }


def test_real_engine_job_with_bad_rows(tmp_path, checkpoint):
    _inputs(tmp_path)
    p = _plan(tmp_path, checkpoint, shards=2)
    assert (
        p.doc["engine"]["factory"] == plans.DEFAULT_ENGINE and p.doc["model"]["model_type"] == "qwen3_5_moe"
    )
    results = worker.run_shards(p, [0, 1], _engine(p))
    assert sum(r.rows for r in results) == 24 and attempts.incomplete_shards(p) == []
    latest = _latest(p.job_dir)
    assert sorted(latest) == sorted(f"r{f}-{i:02d}" for f in range(2) for i in range(12))
    for f in range(2):
        assert latest[f"r{f}-01"][1:3] == (
            "error",
            "invalid sampling parameters: max_tokens must be >= 1, got 0",
        )
        assert latest[f"r{f}-02"][1] == "skipped" and latest[f"r{f}-02"][2]
        assert latest[f"r{f}-03"][1] == "skipped" and "64" in latest[f"r{f}-03"][2]  # beyond max_model_len
        for i in (0, *range(4, 12)):
            text, reason, error, n = latest[f"r{f}-{i:02d}"]
            assert reason in ("stop", "length") and error is None and text is not None and 0 < n <= 6
    meta = pq.read_metadata(next(p.job_dir.glob("shards/00000/*.parquet"))).metadata
    assert meta[b"batchinfer.quantization"] == b"nvfp4"


def test_real_engine_text_survives_resharding_and_resume(tmp_path, checkpoint):
    _inputs(tmp_path, files=1, rows=12)
    sampling = {"max_tokens": 5, "temperature": 0.9, "top_p": 0.95}
    a = _plan(tmp_path, checkpoint, out="a", shards=1, chunk_rows=12, sampling=sampling)
    b = _plan(tmp_path, checkpoint, out="b", shards=3, chunk_rows=2, sampling=sampling)
    worker.run_shards(a, [0], _engine(a))
    stop = worker.StopFlag()
    stop.set()
    engine_b = _engine(b)
    assert worker.run_shard(b, 2, engine_b, stop=stop).status == "stopped"
    worker.run_shards(b, [2, 0, 1], engine_b)
    la, lb = _latest(a.job_dir), _latest(b.job_dir)
    assert la == lb
    texts = [v[0] for v in la.values() if v[1] in ("stop", "length")]
    assert len(texts) == 9 and len(set(texts)) > 1


def test_sigkill_trials_with_tiny_checkpoint(tmp_path, checkpoint):
    _inputs(tmp_path, files=2, rows=12)
    out = tmp_path / "out"
    args = ["run", "--input", str(tmp_path / "in"), "--output", str(out), "--model", str(checkpoint),
            "--max-tokens", "32", "--ignore-eos", "--chunk-rows", "2", "--shards", "2", "--progress", "none",
            "--engine-arg", "max_model_len=128", "--engine-arg", "max_batch_size=2"]  # fmt: skip
    glob = f"{out}/shards/*/*.parquet"
    rng = random.Random(7)
    seen = killed_running = 0
    for _trial in range(5):
        proc = subprocess.Popen([BATCHINFER, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        start_seen, deadline, limit = seen, None, time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < limit:
            if list(out.glob("shards/*/*.parquet")):
                rows, distinct = (
                    duckdb.connect().execute(f"SELECT count(*), count(DISTINCT id) FROM '{glob}'").fetchone()
                )
                assert rows == distinct and rows >= seen
                seen = rows
            if deadline is None and seen > start_seen:
                # mid-chunk: within one chunk's time of this run's first commit
                chunk_s = min(worker.chunk_stats(f)["seconds"] for f in out.glob("shards/*/*.parquet"))
                deadline = time.monotonic() + rng.uniform(0.0, 0.8) * chunk_s
            if deadline is not None and time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        killed_running += proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert killed_running == 5 and 0 < seen  # every trial killed a runner with work in flight
    done = run_cli(*args, timeout=300)
    assert done.returncode == 0, done.stderr
    ids = duckdb.connect().execute(f"SELECT id FROM '{glob}' ORDER BY id").fetchall()
    assert [i for (i,) in ids] == sorted(f"r{f}-{i:02d}" for f in range(2) for i in range(12))


def test_lazy_engine_refuses_unknown_engine_args_by_name(checkpoint):
    # A plan written before run checked engine args must still fail with a user error, not a TypeError.
    engine = LazyEngine(plans.DEFAULT_ENGINE, str(checkpoint), {**ENGINE_ARGS, "max_batch": "4"})
    with pytest.raises(
        ConfigError, match="unexpected keyword argument 'max_batch'; it accepts device, dtype"
    ):
        engine.describe()
    assert not engine.loaded
