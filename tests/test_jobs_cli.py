"""The job commands as a user runs them: run, status, query, export, retry-errors, spec files, errors."""

import hashlib
import json
import os
import shutil
import socket
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from batchinfer.jobs.spec import load_spec
from jobs_fixtures import ECHO, echo_args, model_dir, run_cli, write_inputs

REPO = Path(__file__).resolve().parents[1]
DEMO_MODEL = REPO / "models" / "demo-qwen3.5-moe"


def _digest(out: Path) -> dict[str, str]:
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in out.glob("shards/*/*")
    }


def test_run_status_query_export(tmp_path):
    write_inputs(tmp_path, files=3, rows=20)
    model_dir(tmp_path)
    out = tmp_path / "out"
    args = echo_args(tmp_path, out, "--shards", "4", "--chunk-rows", "6", "--keep-columns", "topic")
    args[args.index("--progress") + 1] = "json"
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    events = [json.loads(line) for line in r.stdout.splitlines()]
    assert events[0] == {"event": "start", "rows_total": 60, "shards": 4}
    assert [e["event"] for e in events].count("chunk") == 12
    assert events[-1]["event"] == "end" and events[-1]["rows_done"] == 60 and events[-1]["status"] == "done"
    assert "60 rows processed in 12 chunks (6 errors, 6 skipped)" in r.stderr

    again = run_cli(
        *echo_args(tmp_path, out, "--shards", "4", "--chunk-rows", "6", "--keep-columns", "topic")
    )
    assert again.returncode == 0 and "nothing to do" in again.stderr
    resume_short = run_cli("run", "--output", str(out), "--progress", "none")
    assert resume_short.returncode == 0 and "nothing to do" in resume_short.stderr

    s = run_cli("status", str(out), "--json")
    summary = json.loads(s.stdout)
    assert summary["rows_done"] == 60 and summary["shards_done"] == 4 and summary["shards_pending"] == 0
    assert summary["finish_reasons"] == {"error": 6, "skipped": 6, "stop": 48}
    assert summary["output_tokens"] == 48 * 8 and summary["engine_tokens_per_s"] > 0
    text = run_cli("status", str(out)).stdout
    assert "shards   4/4 done" in text and "rows     60/60 done (100.0%)" in text

    q = run_cli("query", str(out), "SELECT finish_reason, count(*) AS n FROM latest GROUP BY 1 ORDER BY 1")
    assert q.returncode == 0 and "error" in q.stdout and "skipped" in q.stdout
    csv = tmp_path / "errors.csv"
    q = run_cli(
        "query",
        str(out),
        "SELECT id, error FROM latest WHERE error IS NOT NULL ORDER BY id",
        "--out",
        str(csv),
    )
    assert (
        q.returncode == 0
        and csv.read_text().splitlines()[0] == "id,error"
        and len(csv.read_text().splitlines()) == 13
    )
    j = run_cli(
        "query", str(out), "SELECT count(*) FROM inputs i JOIN latest l USING (id) WHERE i.topic = l.topic"
    )
    assert j.returncode == 0 and "60" in j.stdout
    bad = run_cli("query", str(out), "SELECT nope FROM latest")
    assert bad.returncode == 2 and "query failed" in bad.stderr

    exp = tmp_path / "export.parquet"
    e = run_cli("export", str(out), str(exp))
    assert e.returncode == 0
    t = pq.read_table(exp)
    assert t.column("id").to_pylist() == list(range(60)) and t.column("topic").to_pylist()[:3] == [
        "t0",
        "t1",
        "t2",
    ]
    meta = pq.read_metadata(exp).metadata
    assert meta[b"batchinfer.plan_id"] and meta[b"batchinfer.schema"] == b"llm_output/1"
    assert "max_tokens" in json.loads(meta[b"batchinfer.sampling"])  # the job's parameters, as chunk files
    chunk = pq.read_metadata(next(out.glob("shards/00000/*.parquet"))).metadata
    for key in (b"batchinfer.engine", b"batchinfer.quantization"):  # the engine that wrote the rows
        assert meta[key] == chunk[key]


def test_quiet_keeps_the_shard_logs(tmp_path):
    """-q quiets stderr (the cron lines of docs/JOBS.md and docs/SLURM.md use it); each shard's log file
    still records its chunk commits."""
    write_inputs(tmp_path, files=1, rows=12)
    model_dir(tmp_path)
    out = tmp_path / "out"
    r = run_cli("-q", *echo_args(tmp_path, out, "--shards", "2", "--chunk-rows", "3"))
    assert r.returncode == 0, r.stderr
    assert "INFO" not in r.stderr
    for shard in range(2):
        text = (out / f"logs/shard-{shard:05d}.log").read_text()
        assert text.count(f"shard {shard:05d} attempt 1 chunk") == 2 and "done" in text


def test_export_refuses_unfinished_job_unless_partial(tmp_path):
    write_inputs(tmp_path, files=2, rows=10)
    model_dir(tmp_path)
    out = tmp_path / "out"
    assert run_cli(*echo_args(tmp_path, out, "--shards", "2", "--shard", "1")).returncode == 0
    e = run_cli("export", str(out), str(tmp_path / "x.parquet"))
    assert e.returncode == 2 and "only 10 of 20 rows are done" in e.stderr
    e = run_cli("export", str(out), str(tmp_path / "x.parquet"), "--partial")
    assert e.returncode == 0 and pq.read_table(tmp_path / "x.parquet").column("id").to_pylist() == list(
        range(10, 20)
    )
    s = json.loads(run_cli("status", str(out), "--json").stdout)
    assert (s["shards_done"], s["shards_pending"], s["rows_done"]) == (1, 1, 10)


def test_export_and_query_out_never_overwrite_the_jobs_files(tmp_path):
    """An existing OUT needs --force; an input file or a file in the job directory is refused even then (a
    committed chunk overwritten corrupted the job, an input overwritten stopped its resume)."""
    paths = write_inputs(tmp_path, files=2, rows=10)
    model_dir(tmp_path)
    out = tmp_path / "out"
    assert run_cli(*echo_args(tmp_path, out)).returncode == 0
    before = _digest(out)
    chunk = next(out.glob("shards/*/*.parquet"))
    for target, message in (
        (paths[0], "an input file of the job"),
        (chunk, "inside the job directory"),
        (out / "export.csv", "inside the job directory"),
        (paths[0] / "x.csv", f"{paths[0]} is a file, not a folder"),
    ):
        for cmd in (
            ["export", str(out), str(target), "--force"],
            ["query", str(out), "SELECT 1", "--out", str(target)],
        ):
            r = run_cli(*cmd)
            assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert _digest(out) == before and run_cli("run", "--output", str(out)).returncode == 0
    exp = tmp_path / "x.parquet"
    assert run_cli("export", str(out), str(exp)).returncode == 0
    r = run_cli("export", str(out), str(exp))
    assert r.returncode == 2 and "exists; pass --force to overwrite it" in r.stderr
    assert run_cli("export", str(out), str(exp), "--force").returncode == 0
    r = run_cli("export", str(out), "")
    assert r.returncode == 2 and "error: output file name '' is empty; expected a file name" in r.stderr
    r = run_cli("query", str(out), "SELECT 1", "--max-rows", "0")
    assert r.returncode == 2 and "Invalid value for '--max-rows'" in r.stderr
    for sql in ("SELECT id FROM latest;", "SELECT id FROM latest -- ids"):  # the COPY wrapper broke on them
        r = run_cli("query", str(out), sql, "--out", str(tmp_path / "ids.csv"), "--force")
        assert r.returncode == 0 and "wrote 20 rows" in r.stderr, r.stderr
    r = run_cli("query", str(out), "CREATE TABLE t (a INT)", "--out", str(tmp_path / "t.csv"))
    assert r.returncode == 2 and "query failed: Parser Error" in r.stderr, r.stderr
    paths[0].write_bytes(b"not parquet")  # status and queries of the results crashed reading it
    assert run_cli("status", str(out)).returncode == 0
    r = run_cli("query", str(out), "SELECT count(*) AS n FROM latest")
    assert r.returncode == 0 and "20" in r.stdout, r.stderr
    r = run_cli("query", str(out), "SELECT count(*) FROM inputs")  # nor is a changed file the job's input
    assert r.returncode == 2 and "readable and unchanged" in r.stderr and "Traceback" not in r.stderr
    paths[1].rename(tmp_path / "moved.parquet")  # the inputs view is gone, not a Python variable's scan
    r = run_cli("query", str(out), "SELECT count(*) FROM inputs")
    assert r.returncode == 2 and "the view inputs exists while the job's input files are readable" in r.stderr


def test_a_damaged_chunk_is_named_and_the_next_run_computes_it_again(tmp_path):
    write_inputs(tmp_path, files=1, rows=10)
    model_dir(tmp_path)
    out = tmp_path / "out"
    assert run_cli(*echo_args(tmp_path, out, "--chunk-rows", "4")).returncode == 0
    chunk = out / "shards/00000/attempt-01-chunk-00001.parquet"
    chunk.write_bytes(b"")  # as an interrupted copy of the folder leaves it
    for args in (("status", str(out)), ("query", str(out), "SELECT count(*) FROM latest")):
        r = run_cli(*args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"{chunk}: a damaged result chunk (0 bytes, not a whole Parquet file); rerun" in r.stderr
    r = run_cli("run", "--output", str(out), "--progress", "none")
    assert r.returncode == 0 and "set aside as .attempt-01-chunk-00001.parquet.damaged-" in r.stderr, r.stderr
    assert "4 rows processed in 1 chunks" in r.stderr
    r = run_cli("query", str(out), "SELECT count(*) AS n FROM latest")
    assert r.returncode == 0 and "10" in r.stdout, r.stderr


def test_a_chunk_missing_from_a_done_shard_is_named_and_computed_again(tmp_path):
    """An incomplete copy of the job folder: status said every shard done, run had nothing to do."""
    write_inputs(tmp_path, files=1, rows=10)
    model_dir(tmp_path)
    out = tmp_path / "out"
    assert run_cli(*echo_args(tmp_path, out, "--chunk-rows", "2", "--shards", "2")).returncode == 0
    chunk = out / "shards/00001/attempt-01-chunk-00001.parquet"
    chunk.unlink()
    r = run_cli("status", str(out), "--json")
    s = json.loads(r.stdout)
    assert s["shards_done"] == 1 and s["shards_partial"] == 1 and s["missing_chunks"] == [str(chunk)]
    assert (
        f"missing  1 chunk file(s) their shard's marker counts (first: {chunk})"
        in run_cli("status", str(out)).stdout
    )
    r = run_cli("run", "--output", str(out), "--progress", "none")
    assert r.returncode == 0, r.stderr
    assert f"{chunk}: missing, though its shard's marker counts it; its rows computed again" in r.stderr
    assert "2 rows processed in 1 chunks" in r.stderr
    s = json.loads(run_cli("status", str(out), "--json").stdout)
    assert s["shards_done"] == 2 and s["rows_done"] == 10 and s["missing_chunks"] == []


def test_force_new_plan_is_refused_while_a_runner_works_on_the_job(tmp_path):
    """It used to set the plan aside under a running runner, whose old-plan chunks and marker then made
    the new job look done with the old rows."""
    from batchinfer.jobs.lock import shard_lock

    write_inputs(tmp_path, files=1, rows=10)
    model_dir(tmp_path)
    out = tmp_path / "out"
    assert run_cli(*echo_args(tmp_path, out, "--shards", "2", "--plan-only")).returncode == 0
    plan = (out / "plan.json").read_text()
    with shard_lock(out, 1) as held:
        assert held
        r = run_cli(*echo_args(tmp_path, out, "--shards", "2", "--max-tokens", "2", "--force-new-plan"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {out}/locks/00001.lock: shard 00001 of plan ")
    assert f" is being run by {socket.gethostname()} {os.getpid()} " in last
    assert (out / "plan.json").read_text() == plan and not (out / "superseded").exists()
    r = run_cli(*echo_args(tmp_path, out, "--shards", "2", "--max-tokens", "2", "--force-new-plan"))
    assert r.returncode == 0 and (out / "superseded").is_dir(), r.stderr


def test_argument_mistakes_are_one_line_errors(tmp_path):
    paths = write_inputs(tmp_path, files=1, rows=10)
    model_dir(tmp_path)
    out = tmp_path / "out"
    r = run_cli(*echo_args(tmp_path, out, "--keep-columns", "topic,topic"))  # every run crashed in pyarrow
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == "error: --keep-columns names column 'topic' twice; expected each column once"
    assert not (out / "plan.json").exists()
    r = run_cli("run", str(paths[0]), "--output", str(out))  # was a UnicodeDecodeError traceback
    assert r.returncode == 2 and r.stderr.strip() == (
        f"error: {paths[0]}: a Parquet file, not a TOML or JSON job spec; pass input files with --input (-i)"
    )
    (tmp_path / "job.toml").write_bytes(b"\xff\xfe")
    r = run_cli("run", str(tmp_path / "job.toml"))
    assert r.returncode == 2 and "job.toml: not a TOML or JSON job spec (not UTF-8 text)" in r.stderr
    assert run_cli(*echo_args(tmp_path, out)).returncode == 0
    for sql in ("", "  "):  # printed nothing, exit 0
        r = run_cli("query", str(out), sql)
        assert r.returncode == 2 and "Invalid value for 'SQL': empty; expected a query" in r.stderr
    r = run_cli("run", "--output", str(out), "--force-new-plan")
    assert r.returncode == 2 and r.stderr.strip() == (
        f"error: {out}: --force-new-plan starts a new job, which needs --input and --model"
    )


def _bad_inputs(d: Path, case: str) -> None:
    if case == "missing column":
        pq.write_table(pa.table({"id": [100], "text": ["x"]}), d / "z.parquet")
    elif case == "wrong type":
        pq.write_table(pa.table({"id": [100], "prompt": [1.5]}), d / "z.parquet")
    elif case == "empty file":
        (d / "z.parquet").write_bytes(b"")
    elif case == "corrupt file":
        (d / "z.parquet").write_bytes(b"PAR1" + b"\x00" * 100 + b"PAR1")
    elif case == "duplicate ids":
        pq.write_table(pa.table({"id": [5], "prompt": ["again"]}), d / "z.parquet")


CASES = {
    "missing column": "needs one of the columns ['prompt', 'messages']",
    "wrong type": "column 'prompt': expected type string, found double",
    "empty file": "empty file (0 bytes)",
    "corrupt file": "not a readable Parquet file",
    "duplicate ids": "id 5 appears at",
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_inputs_are_clear_errors_and_lose_nothing(tmp_path, case):
    write_inputs(tmp_path, files=2, rows=10)
    model_dir(tmp_path)
    # a fresh job with the bad file: exit 2, a one-line message, no plan
    _bad_inputs(tmp_path / "in", case)
    r = run_cli(*echo_args(tmp_path, tmp_path / "fresh"))
    assert r.returncode == 2 and CASES[case] in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "fresh" / "plan.json").exists()
    # a job with committed results whose input gains the bad file: refused, every committed file intact
    (tmp_path / "in" / "z.parquet").unlink()
    out = tmp_path / "out"
    assert run_cli(*echo_args(tmp_path, out, "--shards", "2", "--shard", "0")).returncode == 0
    before = _digest(out)
    _bad_inputs(tmp_path / "in", case)
    r = run_cli(*echo_args(tmp_path, out, "--shards", "2"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert CASES[case] in r.stderr or "describes a different job" in r.stderr
    assert _digest(out) == before and before


def test_changed_input_refused_then_force_new_plan(tmp_path):
    paths = write_inputs(tmp_path, files=2, rows=10)
    model_dir(tmp_path)
    out = tmp_path / "out"
    assert run_cli(*echo_args(tmp_path, out)).returncode == 0
    before = _digest(out)
    t = pq.read_table(paths[0]).to_pydict()
    t["prompt"][0] = "a different prompt now"
    pq.write_table(pa.table(t), paths[0])
    r = run_cli("run", "--output", str(out))
    assert (
        r.returncode == 2
        and "the inputs or the model changed since the plan was made" in r.stderr
        and "part-0" in r.stderr
    )
    r = run_cli(*echo_args(tmp_path, out, "--max-tokens", "3"))
    assert r.returncode == 2 and "describes a different job" in r.stderr and "sampling" in r.stderr
    r = run_cli(*echo_args(tmp_path, out, "--force-new-plan"))
    assert r.returncode == 0, r.stderr
    old = next((out / "superseded").iterdir())
    assert {k: v for k, v in _digest(old).items()} == before  # the old results were set aside, not lost
    q = run_cli("query", str(out), "SELECT text FROM latest WHERE id = 0")
    assert "now prompt different a" in q.stdout


def test_null_prompt_is_a_job_level_error_and_loses_nothing(tmp_path):
    model_dir(tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    pq.write_table(pa.table({"id": ["a", "b", "c"], "prompt": ["fine", None, "more"]}), bad / "x.parquet")
    new = tmp_path / "new"
    bad_run = ["run", "--input", str(bad), "--model", str(tmp_path / "model"), "--engine", ECHO, "--progress",
               "none", "--output"]  # fmt: skip
    r = run_cli(*bad_run, str(new))
    assert r.returncode == 2, r.stderr
    assert "x.parquet: row 1 (id 'b'): column 'prompt' is null" in r.stderr and "Traceback" not in r.stderr
    assert not (new / "plan.json").exists() and not list(new.glob("shards/*/*"))
    # an existing job with committed results: a new plan over the bad file is refused before the old
    # results are set aside, and so is an input file rewritten with a null prompt
    paths = write_inputs(tmp_path, files=2, rows=10, bad=False)
    out = tmp_path / "out"
    assert run_cli(*echo_args(tmp_path, out, "--shards", "2", "--shard", "0")).returncode == 0
    before, plan = _digest(out), (out / "plan.json").read_bytes()
    assert before
    r = run_cli(*bad_run, str(out), "--force-new-plan")
    assert r.returncode == 2 and "row 1 (id 'b'): column 'prompt' is null" in r.stderr
    t = pq.read_table(paths[1]).to_pydict()
    t["prompt"][3] = None
    pq.write_table(pa.table(t), paths[1])
    r = run_cli("run", "--output", str(out))
    assert r.returncode == 2 and "the inputs or the model changed since the plan was made" in r.stderr
    assert _digest(out) == before and (out / "plan.json").read_bytes() == plan
    assert not (out / "superseded").exists()


def test_retry_errors(tmp_path):
    write_inputs(tmp_path, files=2, rows=10)
    model_dir(tmp_path)
    out = tmp_path / "out"
    assert run_cli(*echo_args(tmp_path, out, "--shards", "2", "--shard", "0")).returncode == 0
    r = run_cli("retry-errors", str(out))
    assert r.returncode == 2 and "1 shard(s) are not finished" in r.stderr
    assert run_cli("run", "--output", str(out)).returncode == 0
    r = run_cli("retry-errors", str(out), "--finish-reason", "error", "--progress", "none")
    assert r.returncode == 0 and "attempt 2: retrying 4 row(s) in 2 shard(s)" in r.stderr
    q = run_cli("query", str(out), "SELECT count(*) FILTER (attempt = 2), count(*) FROM results")
    assert "4" in q.stdout and "24" in q.stdout
    exp = tmp_path / "e.parquet"
    assert run_cli("export", str(out), str(exp)).returncode == 0
    t = pq.read_table(exp).to_pydict()
    assert t["id"] == list(range(20)) and t["attempt"][1] == 2 and t["attempt"][2] == 1
    s = json.loads(run_cli("status", str(out), "--json").stdout)
    assert s["attempts"] == 2 and s["shards_done"] == 2
    for p in [out / "markers/00001-attempt-02.json", *out.glob("shards/00001/attempt-02-*.parquet")]:
        p.unlink()  # as if attempt 2 had been killed in shard 1
    r = run_cli("retry-errors", str(out), "--finish-reason", "skipped", "--progress", "none")
    assert r.returncode == 0 and "resuming attempt 2 (1 shard(s) left)" in r.stderr, r.stderr
    assert "attempt 2 retries finish_reason error, not skipped: it finishes first; rerun" in r.stderr


def test_spec_file_and_examples(tmp_path):
    write_inputs(tmp_path, files=1, rows=10, bad=False)
    model_dir(tmp_path)
    spec = tmp_path / "job.toml"
    spec.write_text(
        'input = "in/*.parquet"\noutput = "out"\nmodel = "model"\nengine = "' + ECHO + '"\nchunk_rows = 3\n'
        "keep_columns = ['topic']\nseed = 7\n[sampling]\nmax_tokens = 2\ntemperature = 0.7\n"
    )
    r = run_cli("run", str(spec), "--progress", "none")
    assert r.returncode == 0, r.stderr
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plan["chunk_rows"] == 3 and plan["seed"] == 7 and plan["sampling"]["max_tokens"] == 2
    assert plan["sampling"]["temperature"] == 0.7 and plan["keep_columns"] == ["topic"]
    assert run_cli("run", str(spec)).returncode == 0
    r = run_cli("run", str(spec), "--max-tokens", "5")  # flags override the file, so this is a different job
    assert r.returncode == 2 and "max_tokens" in r.stderr
    original = spec.read_text()
    spec.write_text(original + '[engine_args]\nfail_marker = "FAIL"\n')
    r = run_cli(
        "run", str(spec), "-o", str(tmp_path / "merged"), "--engine-arg", "max_context=100", "--plan-only"
    )
    assert r.returncode == 0, r.stderr  # the flag adds its key to the file's table
    args = json.loads((tmp_path / "merged" / "plan.json").read_text())["engine"]["args"]
    assert args == {"fail_marker": "FAIL", "max_context": "100"}
    spec.write_text(original + "[engine_args]\nflag = true\n")  # spelled as `--engine-arg flag=true` is
    assert load_spec(spec)["engine_args"] == {"flag": "true"}
    spec.write_text(original)
    spec.write_text(spec.read_text().replace("[sampling]", 'progress = "json"\n[sampling]'))
    r = run_cli("run", str(spec))
    assert r.returncode == 0 and json.loads(r.stdout.splitlines()[-1])["event"] == "end"
    spec.write_text('progress = "loud"\n')
    r = run_cli("run", str(spec))
    assert r.returncode == 2 and "key 'progress': expected bar, json or none" in r.stderr
    spec.write_text('inptu = "x"\n')
    r = run_cli("run", str(spec))
    assert r.returncode == 2 and "unknown key 'inptu'" in r.stderr
    spec.write_text("max_tokens = 4\n")  # a `run` flag, but its spec key lives in [sampling]
    r = run_cli("run", str(spec))
    assert r.returncode == 2 and "'max_tokens' is a sampling parameter; put it in the sampling" in r.stderr
    for name, text, message in (
        ("list.json", "[1, 2]", "expected a JSON object of run arguments, found list"),
        ("job.toml", "input = [1]\n", "key 'input': expected a list of strings, found [1]"),
        ("job.toml", "shards = 0\n", "key 'shards': expected a whole number >= 1, found 0"),
        ("job.toml", "[sampling]\nstop = [1]\n", "key 'sampling.stop': expected a list of strings"),
        ("job.toml", "[sampling]\ntemperature = -1\n", "job.toml: [sampling]: temperature must be"),
        ("job.toml", "[engine_args]\na = [1]\n", "key 'engine_args.a': expected a string, number or"),
    ):
        (tmp_path / name).write_text(text)
        r = run_cli("run", str(tmp_path / name))
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    examples = sorted((REPO / "jobs" / "examples").glob("*.toml"))
    assert examples
    for ex in examples:
        parsed = load_spec(ex)
        assert parsed["output"] and parsed["model"] and parsed["input"]


def test_engine_and_usage_errors(tmp_path):
    write_inputs(tmp_path, files=1, rows=10)
    model_dir(tmp_path)
    r = run_cli("run", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "o"), "--model",
                str(tmp_path / "model"), "--engine", "no_such_module:Engine")  # fmt: skip
    assert r.returncode == 2 and "cannot import module 'no_such_module'" in r.stderr
    r = run_cli("run", "--output", str(tmp_path / "new"))
    assert r.returncode == 2 and "a new job needs --input and --model" in r.stderr
    r = run_cli(*echo_args(tmp_path, tmp_path / "typo", "--engine-arg", "dely=1"))
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        f"error: --engine-arg for {ECHO}: got an unexpected keyword argument 'dely'; "
        "it accepts delay, fail_marker, crash_marker, max_context"
    )
    assert not (tmp_path / "typo" / "plan.json").exists()  # refused before the plan records it
    for arg, expected in (
        ("max_context=abc", "a whole number >= 1"),
        ("max_context=\u00b2", "a whole number >= 1"),  # isdigit() is True for it
        ("delay=-1", "seconds >= 0"),
    ):
        r = run_cli(*echo_args(tmp_path, tmp_path / "bad", "--engine-arg", arg))  # was a traceback at load
        assert r.returncode == 2 and f"--engine-arg {arg}: expected {expected}" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and not (tmp_path / "bad" / "plan.json").exists()
    r = run_cli(*echo_args(tmp_path, tmp_path / "zero", "--shards", "0"))  # was taken as "default"
    assert r.returncode == 2 and "Invalid value for '--shards': 0 is not in the range x>=1" in r.stderr
    r = run_cli("run", *echo_args(tmp_path, tmp_path / "o2")[1:], "--shard", "9")
    assert r.returncode == 2 and "shard 9 does not exist" in r.stderr
    args = echo_args(tmp_path, tmp_path / "o4")
    args[args.index("--model") + 1] = str(tmp_path / "model" / "config.json")
    r = run_cli(*args)
    assert r.returncode == 2 and "expected a checkpoint folder" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "o4" / "plan.json").exists()  # refused before the plan, so the fix is a rerun
    (tmp_path / "afile").write_text("x")
    r = run_cli(*echo_args(tmp_path, tmp_path / "afile"))
    assert r.returncode == 2 and "a file; expected a job directory" in r.stderr
    assert "Traceback" not in r.stderr
    for command in (echo_args(tmp_path, tmp_path / "afile" / "job"), ["eval", "-m", str(REPO / "models" /
                    "demo-qwen3.5-moe"), "-o", str(tmp_path / "afile" / "job")]):  # fmt: skip
        r = run_cli(*command)  # a traceback (NotADirectoryError) when the plan was written
        assert r.returncode == 2 and f"{tmp_path / 'afile'} is a file, not a folder" in r.stderr, r.stderr
    shutil.rmtree(tmp_path / "model")
    r = run_cli(*echo_args(tmp_path, tmp_path / "o3"))
    assert r.returncode == 2 and f"{tmp_path / 'model'}: no such checkpoint folder" in r.stderr


def test_plan_only_writes_the_plan_and_no_results(tmp_path):
    write_inputs(tmp_path, files=2, rows=10)
    model_dir(tmp_path)
    out = tmp_path / "out"
    r = run_cli(*echo_args(tmp_path, out, "--shards", "3", "--plan-only"))
    assert r.returncode == 0 and "20 rows in 3 shards, 2 input files" in r.stderr
    assert (out / "plan.json").exists() and not (out / "shards").exists()
    s = json.loads(run_cli("status", str(out), "--json").stdout)
    assert (s["rows_done"], s["shards_pending"], s["finish_reasons"]) == (0, 3, {})
    assert run_cli("run", "--output", str(out), "--progress", "none").returncode == 0
    assert json.loads(run_cli("status", str(out), "--json").stdout)["rows_done"] == 20


def test_gpus_runs_one_worker_per_device(tmp_path):
    write_inputs(tmp_path, files=2, rows=10)
    model_dir(tmp_path)
    out = tmp_path / "out"
    # the echo engine ignores the device, so two "GPUs" work on a CPU machine
    r = run_cli(*echo_args(tmp_path, out, "--shards", "4", "--engine-arg", "delay=0.02", "--gpus", "all"),
                env={"CUDA_VISIBLE_DEVICES": "0,1"})  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "[gpu 0]" in r.stderr and "[gpu 1]" in r.stderr
    s = json.loads(run_cli("status", str(out), "--json").stdout)
    assert (s["rows_done"], s["shards_done"]) == (20, 4)


def test_gpus_workers_are_as_quiet_as_their_parent(tmp_path):
    write_inputs(tmp_path, files=1, rows=8)
    model_dir(tmp_path)
    out = tmp_path / "out"
    r = run_cli("-q", *echo_args(tmp_path, out, "--shards", "2", "--gpus", "all"),
                env={"CUDA_VISIBLE_DEVICES": "0,1"})  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "INFO" not in r.stderr, r.stderr  # the workers' lines reach the parent's stderr as [gpu N] ...
    assert "shard 00000 attempt 1 chunk" in (out / "logs/shard-00000.log").read_text()


def test_eval_refuses_unknown_engine_arg_before_writing_anything(tmp_path):
    r = run_cli(
        "eval", "-m", str(tmp_path / "model"), "-o", str(tmp_path / "ev"), "--engine-arg", "devic=cpu"
    )
    assert r.returncode == 2 and "got an unexpected keyword argument 'devic'; it accepts device," in r.stderr
    assert not (tmp_path / "ev").exists()


def test_engine_arg_values_are_checked_before_the_plan(tmp_path):
    """A value the default engine would refuse at load is refused before the plan records it (correcting
    it later would change the plan); a plan made where the run's GPU is absent is not refused for it."""
    write_inputs(tmp_path, files=1, rows=4)
    base = ["run", "-i", str(tmp_path / "in"), "-m", str(DEMO_MODEL), "--progress", "none"]
    for args, message in (
        (["max_slots=abc"], "max_slots='abc' is not an integer"),
        (["engine=reference", "deltanet_state=float16"], "deltanet_state=float16 applies to the fast engine"),
        (["device=gpu"], "device 'gpu' is not a device"),
        (
            ["device=cpu", "kv_cache=fp8"],
            "kv_cache=fp8 applies to the fast engine",
        ),  # auto on a cpu: reference
    ):
        out = tmp_path / "bad"
        r = run_cli(*base, "-o", str(out), *[a for x in args for a in ("--engine-arg", x)])
        assert r.returncode == 2 and message in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
        assert not (out / "plan.json").exists()
    for i, args in enumerate((["device=cuda:1", "deltanet_state=float16"], ["engine=fast", "dtype=bf16"])):
        ok = [*[a for x in args for a in ("--engine-arg", x)], "--plan-only"]
        assert run_cli(*base, "-o", str(tmp_path / f"login{i}"), *ok).returncode == 0  # the GPU node checks
    partial = tmp_path / "partial"  # a checkpoint the engine could never load, --plan-only or not
    partial.mkdir()
    shutil.copy(DEMO_MODEL / "config.json", partial)
    for extra in ((), ("--plan-only",)):
        r = run_cli(*base[:3], "-m", str(partial), "-o", str(tmp_path / "p"), *extra)
        assert r.returncode == 2 and f"{partial / 'tokenizer.json'}: no tokenizer.json found" in r.stderr
        assert not (tmp_path / "p").exists()
    shutil.copy(DEMO_MODEL / "tokenizer.json", partial)
    r = run_cli(*base[:3], "-m", str(partial), "-o", str(tmp_path / "p"), "--plan-only")
    assert r.returncode == 2 and f"{partial}: no model.safetensors or model.safetensors.index" in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a CUDA GPU")
def test_a_run_starting_here_checks_its_engine_arguments_on_this_machine(tmp_path):
    """Without --plan-only the engine starts here: on a CPU-only machine an argument only the GPU's engine
    takes, or a CUDA device, is refused before the plan records it (else every rerun fails at load, and
    correcting it is a different job); --plan-only keeps the plan for a GPU machine."""
    write_inputs(tmp_path, files=1, rows=4)
    base = ["run", "-i", str(tmp_path / "in"), "-m", str(DEMO_MODEL), "--progress", "none"]
    for arg, message in (
        ("kv_cache=fp8", "kv_cache=fp8 applies to the fast engine (engine=fast); this machine has no CUDA"),
        ("bf16_experts=true", "this machine has no CUDA GPU, so device=auto is its CPU and engine=auto the"),
        ("engine=fast", "needs a CUDA device, got device 'cpu' (engine=reference runs anywhere"),
        ("device=cuda", "--engine-arg device=cuda: this machine has no CUDA GPU"),
    ):
        out = tmp_path / "here"
        r = run_cli(*base, "-o", str(out), "--engine-arg", arg, env={"TRITON_INTERPRET": "0"})
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not (out / "plan.json").exists()
        assert run_cli(*base, "-o", str(tmp_path / arg), "--engine-arg", arg, "--plan-only").returncode == 0
    r = run_cli(
        "eval", "-m", str(tmp_path / "model"), "-o", str(tmp_path / "ev"), "--engine-arg", "device=cuda"
    )
    assert r.returncode == 2 and "device=cuda: this machine has no CUDA GPU" in r.stderr, r.stderr
    assert not (tmp_path / "ev").exists()  # eval has no --force-new-plan: a plan here could not be corrected


def test_engine_arg_checks_take_the_loaders_arguments():
    import inspect

    from batchinfer.engine import loader
    from batchinfer.images import sam3_engine

    for mod in (loader, sam3_engine):
        names = list(inspect.signature(mod.load_engine).parameters)[1:]  # after the model path
        assert list(inspect.signature(mod.load_engine.check_args).parameters) == names, mod.__name__


def test_eval_refuses_an_unknown_task_in_one_line(tmp_path):
    r = run_cli("eval", "-m", str(tmp_path / "model"), "-o", str(tmp_path / "ev"), "--tasks", "bogus")
    assert r.returncode == 2 and "unknown task 'bogus'; known tasks:" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "ev").exists()


def test_a_model_replaced_in_place_is_refused_on_resume(tmp_path):
    """Another quantization of the same model has the same config.json: the plan's fingerprints of the
    checkpoint's files catch it, so one job's results never mix two models."""
    write_inputs(tmp_path, files=2, rows=10)
    model_dir(tmp_path)
    out = tmp_path / "out"
    assert run_cli(*echo_args(tmp_path, out, "--shards", "2", "--shard", "0")).returncode == 0
    before = _digest(out)
    (tmp_path / "model" / "hf_quant_config.json").write_text('{"quantization": {"quant_algo": "NVFP4"}}')
    r = run_cli("run", "--output", str(out), "--progress", "none")  # a plain resume
    assert r.returncode == 2 and "the inputs or the model changed" in r.stderr
    assert "model file hf_quant_config.json: added" in r.stderr
    r = run_cli(*echo_args(tmp_path, out, "--shards", "2"))  # the original command
    assert r.returncode == 2 and "describes a different job" in r.stderr
    assert "model file hf_quant_config.json: added" in r.stderr
    assert _digest(out) == before
    (tmp_path / "model" / "hf_quant_config.json").unlink()
    assert run_cli("run", "--output", str(out), "--progress", "none").returncode == 0
    assert json.loads(run_cli("status", str(out), "--json").stdout)["rows_done"] == 20


def test_eval_refuses_bad_arguments_before_writing_anything(tmp_path):
    model = REPO / "models" / "demo-qwen3.5-moe"
    (tmp_path / "file").write_text("")
    for args, message in (
        (
            ["-m", str(model), "--n-per-task", "-3"],
            "Invalid value for '--n-per-task': -3 is not in the range",
        ),
        (["-m", str(model), "--max-tokens", "0"], "Invalid value for '--max-tokens': 0 is not in the range"),
        (["-m", str(tmp_path / "nope")], f"error: {tmp_path / 'nope'}: no such checkpoint folder"),
        (["-m", str(model), "-o", str(tmp_path / "file")], f"error: --output {tmp_path / 'file'}: a file;"),
    ):
        r = run_cli("eval", "-o", str(tmp_path / "ev"), *args)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not (tmp_path / "ev").exists()


def test_eval_rerun_keeps_the_jobs_heldout_set(tmp_path):
    """A rerun with another held-out set is refused before it overwrites the job's input file (a resume
    of the job then found its input changed); other changes get a hint eval can follow."""
    ev = tmp_path / "ev"
    base = ["eval", "-m", str(REPO / "models" / "demo-qwen3.5-moe"), "-o", str(ev), "--progress", "none"]
    base += ["--tasks", "add,sort", "--n-per-task", "2", "--max-tokens", "8"]
    r = run_cli(*base, "--json", str(tmp_path / "new" / "ev.json"))
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "new" / "ev.json").read_text())["n_per_task"] == 2
    heldout = (ev / "heldout.parquet").read_bytes()
    r = run_cli(*base, "--n-per-task", "3")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: {ev / 'heldout.parquet'}: this evaluation job's held-out set is 4 prompts of add, sort; "
        "--n-per-task 3 --seed 1 --tasks add,sort gives 6 prompts of add, sort. Rerun with the job's own "
        "--n-per-task, --seed and --tasks (or without them) to resume, or use a new --output directory"
    ]
    assert (ev / "heldout.parquet").read_bytes() == heldout
    r = run_cli(*base, "--max-tokens", "4")
    assert r.returncode == 2 and "changed: sampling:" in r.stderr and "--force-new-plan" not in r.stderr
    assert r.stderr.rstrip().endswith(
        "Rerun with the original arguments to resume, or use a new --output directory"
    )
    r = run_cli("run", "--output", str(ev), "--progress", "none")
    assert r.returncode == 0 and "nothing to do" in r.stderr, r.stderr
    r = run_cli(*base[:-6], "--json", str(tmp_path / "left-out.json"))  # the job's own options, not defaults
    assert r.returncode == 0 and "nothing to do" in r.stderr, r.stderr
    assert json.loads((tmp_path / "left-out.json").read_text())["n_per_task"] == 2
    r = run_cli(*base[:-6], "--tasks", "sort,add", "--n-per-task", "2", "--max-tokens", "8")
    assert (
        r.returncode == 2
        and "gives 4 prompts of add, sort (the same tasks in another --tasks order" in r.stderr
    )
    # --json never over the job's own files (a plan.json written over wrecked the job), nor an existing file
    for target in (ev / "plan.json", ev / "heldout.parquet"):
        r = run_cli(*base, "--json", str(target))
        assert r.returncode == 2 and "inside the job directory" in r.stderr, r.stderr
    assert (ev / "heldout.parquet").read_bytes() == heldout
    r = run_cli(*base, "--json", str(tmp_path / "new" / "ev.json"))
    assert r.returncode == 2 and "ev.json: exists; pass --force to overwrite it" in r.stderr
    assert run_cli(*base, "--json", str(tmp_path / "new" / "ev.json"), "--force").returncode == 0
    assert run_cli("status", str(ev)).returncode == 0
    # another job's folder: refused without leaving a held-out file in it
    r = run_cli(*base[:4], str(tmp_path / "run"), *base[5:])
    assert r.returncode == 0
    (tmp_path / "run" / "heldout.parquet").unlink()
    r = run_cli(*base[:4], str(tmp_path / "run"), *base[5:])
    assert r.returncode == 2 and "holds a job that is not an evaluation" in r.stderr
    assert not (tmp_path / "run" / "heldout.parquet").exists()


def test_a_moved_job_folder_resumes(tmp_path):
    """An evaluation's input (heldout.parquet) lives in its job folder: a moved folder still finds it and
    still hashes to the same plan; a plain job's inputs outside the folder are found where they were."""
    ev = tmp_path / "ev"
    base = ["-m", str(REPO / "models" / "demo-qwen3.5-moe"), "--progress", "none", "--tasks", "add"]
    base += ["--n-per-task", "2", "--max-tokens", "4"]
    assert run_cli("eval", "-o", str(ev), *base).returncode == 0
    plan = json.loads((ev / "plan.json").read_text())
    assert plan["inputs"][0]["path"] == "heldout.parquet"
    moved = tmp_path / "moved"
    shutil.copytree(ev, moved)
    shutil.rmtree(ev)
    r = run_cli("eval", "-o", str(moved), *base)
    assert r.returncode == 0 and "add " in r.stdout, r.stderr
    assert json.loads((moved / "plan.json").read_text())["plan_id"] == plan["plan_id"]
    r = run_cli("query", str(moved), "SELECT count(*) AS n FROM inputs")
    assert r.returncode == 0 and " 2 " in r.stdout, r.stderr
    write_inputs(tmp_path, files=1, rows=4)
    model_dir(tmp_path)
    out = tmp_path / "job"
    assert run_cli(*echo_args(tmp_path, out)).returncode == 0
    out.rename(tmp_path / "job2")
    r = run_cli("run", "--output", str(tmp_path / "job2"), "--progress", "none")
    assert r.returncode == 0 and "nothing to do" in r.stderr, r.stderr


def test_eval_does_not_score_a_job_another_runner_holds(tmp_path):
    """A shard locked by another runner used to be scored as missing rows: a table of zeros, exit 0."""
    from batchinfer.jobs.lock import shard_lock

    ev, figures = tmp_path / "ev", tmp_path / "ev.json"
    args = ["eval", "-m", str(REPO / "models" / "demo-qwen3.5-moe"), "-o", str(ev), "--progress", "none",
            "--tasks", "add", "--n-per-task", "2", "--max-tokens", "4", "--json", str(figures)]  # fmt: skip
    with shard_lock(ev, 0) as held:
        assert held
        r = run_cli(*args)
    assert r.returncode == 75 and "still being run by another runner; not scored" in r.stderr, r.stderr
    assert "mean" not in r.stdout and not figures.exists()
    r = run_cli(*args)
    assert r.returncode == 0 and json.loads(figures.read_text())["tasks"]["add"]["rows"] == 2, r.stderr


def test_eval_counts_skipped_rows_as_not_answered(tmp_path):
    """Prompts beyond the context are skipped rows: the table used to show them as plain misses."""
    ev = tmp_path / "ev"
    r = run_cli("eval", "-m", str(REPO / "models" / "demo-qwen3.5-moe"), "-o", str(ev), "--progress", "none",
                "--tasks", "add", "--n-per-task", "2", "--engine-arg", "max_model_len=4", "--json",
                str(tmp_path / "ev.json"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "ev.json").read_text())["tasks"]["add"] == {
        "rows": 2, "correct": 0, "exact_match": 0.0, "not_answered": 2
    }  # fmt: skip
    assert "add             2        0        0.000             2" in r.stdout
    assert "2 rows ended in error or were skipped and count as wrong" in r.stderr
    r = run_cli("eval", "-m", str(REPO / "models" / "demo-qwen3.5-moe"), "-o", str(ev), "--tasks", "")
    assert r.returncode == 2 and "Invalid value for --tasks: empty; expected task names" in r.stderr


def test_eval_refuses_an_empty_output_not_taking_the_current_folder(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from batchinfer.cli import cli

    monkeypatch.chdir(tmp_path)
    args = ["eval", "-m", str(REPO / "models" / "demo-qwen3.5-moe"), "-o", "", "--tasks", "add"]
    r = CliRunner().invoke(cli, [*args, "--n-per-task", "1", "--max-tokens", "2", "--progress", "none"])
    assert r.exit_code == 2 and "Invalid value for '-o' / '--output': empty; expected a folder" in r.output
    assert list(tmp_path.iterdir()) == []
