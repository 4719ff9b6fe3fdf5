"""Real `batchinfer run` subprocesses: SIGKILL at random moments, concurrent runners, SIGUSR2/TERM stops.

The echo engine sleeps per row to widen the window in which a kill lands mid-chunk.
"""

import json
import random
import re
import signal
import subprocess
import time

import duckdb
import pytest
from batchinfer.jobs import attempts
from batchinfer.jobs import plan as plans
from jobs_fixtures import BATCHINFER, echo_args, model_dir, run_cli, write_inputs

ROWS = 3 * 40


def _job(tmp_path, delay="0.01", shards="3", chunk_rows="4"):
    write_inputs(tmp_path, files=3, rows=40)
    model_dir(tmp_path)
    out = tmp_path / "out"
    args = echo_args(
        tmp_path, out, "--shards", shards, "--chunk-rows", chunk_rows, "--engine-arg", f"delay={delay}"
    )
    return out, args


def _counts(out):
    """(rows, distinct ids) over every committed file, read the way a user's DuckDB would."""
    if not list(out.glob("shards/*/*.parquet")):
        return 0, 0
    return (
        duckdb.connect()
        .execute(f"SELECT count(*), count(DISTINCT id) FROM read_parquet('{out}/shards/*/*.parquet')")
        .fetchone()
    )


def _start(args):
    return subprocess.Popen([BATCHINFER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigkill_at_random_moments_then_resume(tmp_path):
    out, args = _job(tmp_path, delay="0.05")
    rng = random.Random(20261130)
    start = time.monotonic()
    seen = 0
    for trial in range(6):
        # even trials: a random moment from process start (startup, planning, work); odd trials: a random
        # moment after this process's first commit, so the kill lands mid-chunk with work in flight
        proc = _start(args)
        start_seen = seen
        deadline = time.monotonic() + rng.uniform(0.2, 1.2)
        while proc.poll() is None:
            rows, distinct = _counts(out)  # queries succeed at every moment, and never see a duplicate
            assert rows == distinct and rows >= seen
            seen = rows
            if trial % 2 == 1 and seen == start_seen:
                deadline = time.monotonic() + rng.uniform(0.0, 0.3)
                assert time.monotonic() < start + 60
            elif time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        rows, distinct = _counts(out)
        assert rows == distinct and rows >= seen  # nothing committed was lost to the kill
        seen = rows
    assert 0 < seen < ROWS, "the kills should land after some commits and before the job finishes"
    done = run_cli(*args)
    assert done.returncode == 0, done.stderr
    con = duckdb.connect()
    got = [
        r[0]
        for r in con.sql(f"SELECT id FROM read_parquet('{out}/shards/*/*.parquet') ORDER BY id").fetchall()
    ]
    assert got == list(range(ROWS))  # output ids == input ids, no duplicates
    assert not list(out.rglob(".*.tmp-*"))
    assert attempts.incomplete_shards(plans.Plan.load(out)) == []


def test_two_concurrent_runners_share_the_work_without_overlap(tmp_path):
    out, args = _job(tmp_path, delay="0.005", shards="6", chunk_rows="5")
    procs = [_start(args), _start(args)]  # they also race to create the plan
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    processed = [int(re.search(r"^(\d+) rows processed in", err, re.M).group(1)) for _, err in results]
    assert sum(processed) == ROWS  # no shard was done twice
    assert _counts(out) == (ROWS, ROWS)


@pytest.mark.parametrize("sig", [signal.SIGUSR2, signal.SIGTERM])
def test_stop_signal_commits_chunk_and_exits_for_requeue(tmp_path, sig):
    out, args = _job(tmp_path, delay="0.02", shards="1", chunk_rows="10")
    proc = _start(args)
    first = out / "shards/00000/attempt-01-chunk-00000.parquet"
    deadline = time.monotonic() + 60
    while not first.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    s = json.loads(run_cli("status", str(out), "--json").stdout)  # status works mid-run, from disk
    assert s["shards_running"] == 1 and f" {proc.pid} " in s["running"]["00000"]
    assert 10 <= s["rows_done"] < ROWS and s["shards_done"] == 0
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err
    assert f"stopped by {sig.name}" in err
    rows, distinct = _counts(out)
    assert rows == distinct and rows % 10 == 0 and 10 <= rows < ROWS  # whole chunks only
    assert not list(out.rglob(".*.tmp-*"))
    done = run_cli(*args)
    assert done.returncode == 0 and _counts(out) == (ROWS, ROWS)


def test_stop_signal_during_the_last_chunk_exits_0_once_everything_is_done(tmp_path):
    """A stop that lands while the last chunk runs leaves nothing to requeue: the chunk commits and the run
    exits 0 (a scheduler requeues on 75 for nothing otherwise)."""
    out, args = _job(tmp_path, delay="0.05", shards="1", chunk_rows=str(ROWS))  # one chunk of ~6 s
    proc = _start(args)
    deadline = time.monotonic() + 60
    running = False
    while not running and time.monotonic() < deadline:
        running = json.loads(run_cli("status", str(out), "--json").stdout or "{}").get("shards_running") == 1
        time.sleep(0.05)
    assert running, "the run never started its shard"
    time.sleep(1.0)  # inside the chunk
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "rerun to continue" not in err and "are done" in err
    assert _counts(out) == (ROWS, ROWS)
