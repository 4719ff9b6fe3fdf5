"""run_shard in-process with the echo engine: outputs, bad rows, resume, stop, locks, crashes, retries."""

import json
import os
import socket

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from batchinfer.jobs import attempts, commit, query, worker
from batchinfer.jobs import plan as plans
from batchinfer.jobs.echo import EchoEngine
from batchinfer.jobs.lock import shard_lock
from jobs_fixtures import ECHO, model_dir, write_inputs

from batchinfer.errors import InputError, PlanMismatchError


class Counting:
    """Wraps an engine; counts requests and can raise the stop flag after `stop_after` generate calls."""

    def __init__(self, inner, stop=None, stop_after=None):
        self.inner, self.stop, self.stop_after = inner, stop, stop_after
        self.calls = 0
        self.requests = 0

    def describe(self):
        return self.inner.describe()

    def generate(self, requests, on_tokens=None):
        self.calls += 1
        self.requests += len(requests)
        if self.stop is not None and self.calls == self.stop_after:
            self.stop.set()  # as if SIGUSR2 arrived mid-chunk
        yield from self.inner.generate(requests, on_tokens)


def _job(tmp_path, shards=4, chunk_rows=6, sampling=None, out="out", **kw):
    p = plans.build_plan(
        tmp_path / out, [str(tmp_path / "in")], model_dir(tmp_path), sampling or {"max_tokens": 4},
        num_shards=shards, chunk_rows=chunk_rows, engine=ECHO, engine_args={"fail_marker": "FAIL"}, **kw,
    )  # fmt: skip
    return plans.open_or_create(p)


def _engine(tmp_path, **kw):
    return EchoEngine(str(model_dir(tmp_path)), fail_marker="FAIL", **kw)


def _latest(job_dir):
    return {r[0]: r[1:] for r in query.connect(job_dir).sql(
        "SELECT id, text, finish_reason, error, attempt FROM latest").fetchall()}  # fmt: skip


def test_job_over_several_files_with_bad_rows(tmp_path):
    write_inputs(tmp_path, files=3, rows=20)
    p = _job(tmp_path, keep_columns=["topic"])
    results = worker.run_shards(p, list(range(p.num_shards)), _engine(tmp_path))
    assert [r.status for r in results] == ["done"] * 4 and sum(r.rows for r in results) == 60
    con = query.connect(p.job_dir)
    ids = [r[0] for r in con.sql("SELECT id FROM results ORDER BY row").fetchall()]
    assert ids == list(range(60))  # every input id exactly once
    latest = _latest(p.job_dir)
    for base in (0, 20, 40):
        assert latest[base + 1][1:3] == (
            "error",
            "invalid sampling parameters: max_tokens must be >= 1, got 0",
        )
        assert latest[base + 2][1:3] == ("skipped", "empty prompt")
        assert latest[base + 3][1] == "skipped" and "beyond the context length" in latest[base + 3][2]
        assert latest[base + 4][1:3] == ("error", "echo engine failed the row (fail_marker)")
    assert latest[0] == ("0 world the to", "length", None, 1)  # reversed words, cut at max_tokens=4
    topics = dict(con.sql("SELECT id, topic FROM latest").fetchall())
    assert topics[59] == "t2"
    # the on-disk contract: 4 shards x ceil(15 / 6) = 3 chunks, one marker per shard
    files = sorted(str(x.relative_to(p.job_dir)) for x in p.job_dir.rglob("*") if x.is_file())
    chunks = [f"shards/{s:05d}/attempt-01-chunk-{c:05d}.parquet" for s in range(4) for c in range(3)]
    markers = [f"markers/{s:05d}-attempt-01.json" for s in range(4)]
    logs = [f"logs/shard-{s:05d}.log" for s in range(4)]
    locks = [f"locks/{s:05d}.lock" for s in range(4)]
    assert files == sorted(["plan.json", *chunks, *markers, *logs, *locks])
    marker = json.loads((p.job_dir / markers[0]).read_text())
    assert (marker["rows"], marker["errors"], marker["skipped"], marker["chunks"]) == (15, 2, 2, 3)
    meta = pq.read_metadata(p.job_dir / chunks[0]).metadata
    assert meta[b"batchinfer.plan_id"].decode() == p.plan_id
    assert meta[b"batchinfer.quantization"] == b"none"
    assert json.loads(meta[b"batchinfer.sampling"])["max_tokens"] == 4
    assert meta[b"batchinfer.version"] and meta[b"batchinfer.model"].decode().endswith("model")
    kv = duckdb.sql(f"SELECT count(*) FROM parquet_kv_metadata('{p.job_dir}/shards/*/*.parquet') "
                    "WHERE decode(key) = 'batchinfer.plan_id'").fetchall()  # fmt: skip
    assert kv == [(12,)]


def test_stop_commits_chunk_in_flight_and_resume_continues(tmp_path):
    write_inputs(tmp_path, files=1, rows=20)
    p = _job(tmp_path, shards=1, chunk_rows=5)
    stop = worker.StopFlag()
    first = Counting(_engine(tmp_path), stop=stop, stop_after=2)
    r = worker.run_shard(p, 0, first, stop=stop)
    assert r.status == "stopped" and r.chunks == 2 and first.calls == 2
    assert sorted(x.name for x in (p.job_dir / "shards/00000").iterdir()) == [
        "attempt-01-chunk-00000.parquet", "attempt-01-chunk-00001.parquet"]  # fmt: skip
    assert not commit.marker_path(p.job_dir, 0, 1).exists() and attempts.incomplete_shards(p) == [0]
    second = Counting(_engine(tmp_path))
    r = worker.run_shard(p, 0, second)
    assert r.status == "done" and r.rows == 10 and second.requests <= 10  # committed rows not redone
    assert attempts.incomplete_shards(p) == []
    marker = commit.read_json(commit.marker_path(p.job_dir, 0, 1))
    assert marker["rows"] == 20 and marker["chunks"] == 4  # the marker counts chunks of both runs
    assert worker.run_shard(p, 0, Counting(_engine(tmp_path))).rows == 0


def test_locked_shard_is_left_alone(tmp_path):
    write_inputs(tmp_path, files=1, rows=10)
    p = _job(tmp_path, shards=2)
    eng = Counting(_engine(tmp_path))
    with shard_lock(p.job_dir, 1) as held:
        assert held
        results = worker.run_shards(p, [0, 1], eng)
    assert [r.status for r in results] == ["done", "locked"]
    assert not (p.job_dir / "shards/00001").exists() and attempts.incomplete_shards(p) == [1]


def test_engine_crash_keeps_committed_chunks(tmp_path):
    write_inputs(tmp_path, files=1, rows=20)
    crash_table = pq.read_table(tmp_path / "in/part-0.parquet").to_pydict()
    crash_table["prompt"][12] = "BOOM goes the engine"
    pq.write_table(pa.table(crash_table), tmp_path / "in/part-0.parquet")
    p = _job(tmp_path, shards=1, chunk_rows=5)
    with pytest.raises(RuntimeError, match="echo engine crashed"):
        worker.run_shard(p, 0, _engine(tmp_path, crash_marker="BOOM"))
    names = sorted(x.name for x in (p.job_dir / "shards/00000").iterdir())
    assert names == ["attempt-01-chunk-00000.parquet", "attempt-01-chunk-00001.parquet"]
    assert "shard 00000 failed" in (p.job_dir / "logs/shard-00000.log").read_text()
    assert worker.run_shard(p, 0, _engine(tmp_path)).rows == 10
    assert len(_latest(p.job_dir)) == 20


def test_same_text_whatever_the_sharding(tmp_path):
    write_inputs(tmp_path, files=2, rows=15, bad=False)
    sampling = {"max_tokens": 5, "temperature": 0.8}
    a = _job(tmp_path, shards=1, chunk_rows=30, sampling=sampling, out="a")
    b = _job(tmp_path, shards=4, chunk_rows=2, sampling=sampling, out="b")
    worker.run_shards(a, [0], _engine(tmp_path))
    worker.run_shards(b, [3, 1, 0, 2], _engine(tmp_path))
    la, lb = _latest(a.job_dir), _latest(b.job_dir)
    assert la == lb and len(la) == 30
    assert len({v[0] for v in la.values()}) > 1  # seeded shuffles differ per row


def test_stale_temporary_files_are_removed_and_never_read(tmp_path):
    write_inputs(tmp_path, files=1, rows=6)
    p = _job(tmp_path, shards=1)
    stale = p.job_dir / "shards/00000/.attempt-01-chunk-00000.parquet.tmp-99999"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"PAR1 half a file")
    stale_marker = p.job_dir / "markers/.00000-attempt-01.json.tmp-99999"
    stale_marker.parent.mkdir(parents=True)
    stale_marker.write_text("{")
    other_shard = p.job_dir / "markers/.00001-attempt-01.json.tmp-99999"  # not ours to clean
    other_shard.write_text("{")
    assert query.connect(p.job_dir).sql("SELECT count(*) FROM results").fetchall() == [(0,)]
    worker.run_shard(p, 0, _engine(tmp_path))
    assert not stale.exists() and not stale_marker.exists() and other_shard.exists()
    assert query.connect(p.job_dir).sql("SELECT count(*) FROM results").fetchall() == [(6,)]


def test_damaged_chunk_is_set_aside_and_recomputed_and_stray_files_are_ignored(tmp_path):
    write_inputs(tmp_path, files=1, rows=12)
    p = _job(tmp_path, shards=2, chunk_rows=3)
    worker.run_shards(p, [0, 1], _engine(tmp_path))
    before = _latest(p.job_dir)
    stray = p.job_dir / "shards/00000/notes.parquet"
    stray.write_bytes(b"")  # not a chunk name: no reader looks at it
    assert _latest(p.job_dir) == before
    chunk = commit.chunk_path(p.job_dir, 1, 1, 1)
    chunk.write_bytes(chunk.read_bytes()[:-9])  # truncated: its footer is gone
    assert commit.damaged_chunks(commit.chunk_files(p.job_dir)) == [chunk]
    assert attempts.incomplete_shards(p) == []
    with pytest.raises(InputError, match=r"chunk-00001.parquet: a damaged result chunk \(\d+ bytes"):
        query.connect(p.job_dir)
    assert attempts.reopen_damaged(p) == [chunk]
    assert attempts.incomplete_shards(p) == [1] and not chunk.exists()
    assert len(list(chunk.parent.glob(".attempt-01-chunk-00001.parquet.damaged-*"))) == 1
    counting = Counting(_engine(tmp_path))
    worker.run_shards(p, [1], counting)
    assert counting.requests == 3  # that chunk's three rows, no more
    assert _latest(p.job_dir) == before and attempts.incomplete_shards(p) == []
    assert attempts.reopen_damaged(p) == [] and stray.exists()


def test_a_missing_chunk_or_another_plans_marker_leaves_the_shard_to_do(tmp_path):
    """An incomplete copy of the job folder lacks a chunk its marker counts; a runner of a superseded plan
    writes its marker into the new job: neither shard is done, and a run computes only what is missing."""
    write_inputs(tmp_path, files=1, rows=12)
    p = _job(tmp_path, shards=2, chunk_rows=3)
    worker.run_shards(p, [0, 1], _engine(tmp_path))
    before = _latest(p.job_dir)
    chunk = commit.chunk_path(p.job_dir, 1, 1, 1)
    chunk.unlink()
    marker = commit.marker_path(p.job_dir, 0, 1)
    commit.write_json_atomic(marker, {**commit.read_json(marker), "plan_id": "0123456789abcdef"})
    assert attempts.incomplete_shards(p) == [0, 1] and attempts.missing_chunks(p) == [chunk]
    assert attempts.pending_rows(p, 0) == 0 and attempts.pending_rows(p, 1) == 3
    counting = Counting(_engine(tmp_path))
    results = worker.run_shards(p, [0, 1], counting)
    assert [r.chunks for r in results] == [0, 1] and counting.requests == 3  # the missing chunk's rows
    assert _latest(p.job_dir) == before and attempts.incomplete_shards(p) == []
    assert commit.read_json(marker)["plan_id"] == p.plan_id


def test_a_runner_of_a_superseded_plan_stops_before_writing(tmp_path):
    write_inputs(tmp_path, files=1, rows=6)
    old = _job(tmp_path, shards=1)
    plans.set_aside(old.job_dir)
    new = _job(tmp_path, shards=1, sampling={"max_tokens": 2})
    with pytest.raises(PlanMismatchError, match=f"the job's plan is now {new.plan_id}, not this runner's"):
        worker.run_shard(old, 0, _engine(tmp_path))
    assert not (old.job_dir / "shards").exists() and attempts.incomplete_shards(new) == [0]


def test_a_killed_plan_writers_temporary_file_is_removed_a_live_ones_kept(tmp_path):
    write_inputs(tmp_path, files=1, rows=6)
    host = socket.gethostname()  # pids stop below 2**22 (pid_max)
    out = tmp_path / "out"
    out.mkdir()
    dead, live = (out / f".plan.json.tmp-{host}-{pid}" for pid in (2**22 + 7, os.getppid()))
    other_host = out / ".plan.json.tmp-elsewhere-123"  # maybe being written on another node right now
    for p in (dead, live, other_host):
        p.write_text("{")
    _job(tmp_path)
    assert not dead.exists() and live.exists() and other_host.exists()
    assert (out / "plan.json").exists() and not list(out.glob(f".plan.json.tmp-{host}-{2**22 + 7}"))


def test_retry_attempt_reruns_only_failed_rows_and_keeps_history(tmp_path):
    write_inputs(tmp_path, files=2, rows=10)
    p = _job(tmp_path, shards=3, chunk_rows=4)
    worker.run_shards(p, [0, 1, 2], _engine(tmp_path))
    rows = query.rows_to_retry(p.job_dir, ["error"])
    assert sorted(r for rs in rows.values() for r in rs) == [1, 4, 11, 14]
    attempt = attempts.create_retry(p, rows, ["error"])
    assert attempt == 2 and attempts.incomplete_shards(p) == sorted(rows)
    fixed = Counting(EchoEngine(str(model_dir(tmp_path))))  # no fail_marker: the transient error is gone
    worker.run_shards(p, attempts.incomplete_shards(p), fixed)
    assert fixed.requests == 2  # the bad max_tokens rows are job-layer errors and never reach the engine
    latest = _latest(p.job_dir)
    assert latest[4][1:] == ("stop", None, 2) and latest[14][1:] == ("stop", None, 2)
    assert latest[1][1:] == ("error", "invalid sampling parameters: max_tokens must be >= 1, got 0", 2)
    assert latest[0][3] == 1
    n = query.connect(p.job_dir).sql("SELECT count(*) FROM results").fetchall()[0][0]
    assert n == 24 and attempts.incomplete_shards(p) == []


def test_messages_input(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    msgs = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
            [{"role": "user", "content": None}], []]  # fmt: skip
    pq.write_table(pa.table({"id": ["a", "b", "c"], "messages": msgs}), d / "chat.parquet")
    p = _job(tmp_path, shards=1)
    worker.run_shard(p, 0, _engine(tmp_path))
    latest = _latest(p.job_dir)
    assert latest["a"][:2] == ("there hello brief be", "stop")
    assert latest["b"][1:3] == ("error", "messages[0].content is null; expected a string")
    assert latest["c"][1:3] == ("error", "messages is an empty list")
