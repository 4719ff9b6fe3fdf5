"""The Slurm array script and `batchinfer slurm`, against fake sbatch/squeue/scontrol (no cluster needed).

tests/test_slurm_cluster.py runs the same script on a real single-node Slurm.
"""

import json
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from batchinfer.jobs import attempts, commit, slurm
from batchinfer.jobs.plan import Plan, build_plan, open_or_create
from click.testing import CliRunner

from batchinfer.cli import cli
from batchinfer.errors import InputError

TINY_CONFIG = dict(
    model_type="qwen3_moe", vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096,
    tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    norm_topk_prob=True,
)  # fmt: skip


def make_job(root: Path, rows: int, shards: int, chunk_rows: int = 1000, engine_args=None) -> Plan:
    """A planned job over one input file, run by the model-free echo engine."""
    model = root / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(TINY_CONFIG))
    table = pa.table({"id": list(range(rows)), "prompt": [f"row {i} says hello" for i in range(rows)]})
    pq.write_table(table, root / "input.parquet")
    plan = build_plan(root / "job", [str(root / "input.parquet")], model, sampling={"max_tokens": 8},
                      num_shards=shards, chunk_rows=chunk_rows, engine="batchinfer.jobs.echo:EchoEngine",
                      engine_args=engine_args)  # fmt: skip
    return open_or_create(plan)


def mark_done(plan: Plan, shard: int) -> None:
    """A marker of this plan for a shard of no chunk files: done without running it."""
    doc = {"plan_id": plan.plan_id, "shard": shard, "attempt": 1, "chunks": 0}
    commit.write_json_atomic(commit.marker_path(plan.job_dir, shard, 1), doc)


FAKE = """#!/usr/bin/env bash
{{ printf '%q ' "$(basename "$0")" "$@"; echo; }} >> {log}
{body}
"""


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """sbatch/squeue/scontrol stand-ins on PATH; returns (call log, bin dir)."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    log.touch()
    bodies = {
        "sbatch": 'n=$(grep -c ^sbatch {log}); echo "$((99 + n))"',
        "squeue": "cat {bin}/squeue.out 2>/dev/null; cat {bin}/squeue.err >&2 2>/dev/null\n"
        'exit "$(cat {bin}/squeue.rc 2>/dev/null || echo 0)"',
        "scontrol": 'echo "MaxArraySize            = $(cat {bin}/max_array 2>/dev/null || echo 1001)"',
    }
    for name, body in bodies.items():
        path = bin_dir / name
        path.write_text(FAKE.format(log=log, body=body.format(log=log, bin=bin_dir)))
        path.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return log, bin_dir


def calls(log: Path, prog: str) -> list[list[str]]:
    return [shlex.split(line)[1:] for line in log.read_text().splitlines() if line.startswith(prog + " ")]


def requeues(log: Path) -> list[list[str]]:
    return [c for c in calls(log, "scontrol") if c[0] == "requeue"]


def test_compress_writes_slurm_ranges():
    assert slurm.compress([5, 0, 1, 2, 7, 8, 8]) == "0-2,5,7-8"
    assert slurm.compress([3]) == "3"
    assert slurm.compress(list(range(1000))) == "0-999"


def test_array_groups_stay_below_max_array_size():
    groups = slurm.array_groups(list(range(25)), max_array_size=10)
    assert [(g.offset, g.spec()) for g in groups] == [(0, "0-9"), (10, "0-9"), (20, "0-4")]
    # a retry of scattered shards: indices are shard % size, the offset adds the base back
    groups = slurm.array_groups([3, 17, 12, 29, 4], max_array_size=10)
    assert [(g.offset, g.spec(max_running=2)) for g in groups] == [(0, "3-4%2"), (10, "2,7%2"), (20, "9%2")]
    for g in groups:
        assert all(0 <= s - g.offset < 10 for s in g.shards)
    assert sorted(s for g in groups for s in g.shards) == [3, 4, 12, 17, 29]


def test_max_array_size_read_from_scontrol_or_defaulted(fake_slurm, monkeypatch):
    _, bin_dir = fake_slurm
    (bin_dir / "max_array").write_text("40001")
    assert slurm.max_array_size() == 40001
    monkeypatch.setenv("PATH", "/nonexistent")
    assert slurm.max_array_size() == slurm.DEFAULT_MAX_ARRAY_SIZE


def test_options_render_into_sbatch_header():
    opts = slurm.SlurmOptions(partition="gpu", time="4:00:00", account="proj", gpus_per_task=2, mem="64G",
                              sbatch_args=["--constraint=h200"])  # fmt: skip
    assert opts.sbatch_lines() == [
        "--partition=gpu", "--time=4:00:00", "--account=proj", "--mem=64G", "--gres=gpu:2",
        "--constraint=h200",
    ]  # fmt: skip
    assert slurm.SlurmOptions(gpus_per_task=0).sbatch_lines() == []
    with pytest.raises(InputError, match="--sbatch-arg 'constraint=h200'"):
        slurm.SlurmOptions(sbatch_args=["constraint=h200"])
    with pytest.raises(InputError, match="--max-running must be >= 1, got 0"):
        slurm.SlurmOptions(max_running=0)
    for ok in ("90", "30:00", "4:00:00", "2-00", "1-12:00", "1-12:00:00", "UNLIMITED"):
        assert slurm.SlurmOptions(time=ok).time == ok
    for kwargs, message in (
        ({"time": "banana"}, "--time 'banana': expected a Slurm time"),
        ({"time": "-5"}, "--time '-5': expected a Slurm time"),
        ({"mem": "lots"}, "--mem 'lots': expected a size"),
        ({"cpus_per_task": 0}, "--cpus-per-task must be >= 1, got 0"),
        ({"job_name": "a b\n#SBATCH --x"}, "--job-name 'a b\\n#SBATCH --x': expected a value without spaces"),
        ({"sbatch_args": ["--comment=a\nb"]}, "--sbatch-arg '--comment=a\\nb': expected a value without"),
    ):
        with pytest.raises(InputError, match=re.escape(message)):
            slurm.SlurmOptions(**kwargs)


def test_signal_seconds_must_fall_inside_the_time_limit(tmp_path, fake_slurm):
    plan = make_job(tmp_path, rows=4, shards=2)
    result = CliRunner().invoke(cli, ["slurm", str(plan.job_dir), "--time", "2"])
    assert isinstance(result.exception, InputError)
    assert "--signal-seconds 300 is not under --time 2 (120 s)" in str(result.exception)
    assert not (plan.job_dir / "slurm" / "batchinfer.sbatch").exists()
    assert (
        CliRunner()
        .invoke(cli, ["slurm", str(plan.job_dir), "--time", "2", "--signal-seconds", "60"])
        .exit_code
        == 0
    )
    for time_, seconds in (
        ("90", 5400),
        ("1:30", 90),
        ("2:00:00", 7200),
        ("1-12", 129600),
        ("1-0:0:5", 86405),
    ):
        with pytest.raises(InputError, match=re.escape(f"({seconds} s)")):
            slurm.SlurmOptions(time=time_, signal_seconds=seconds).check_signal()
        slurm.SlurmOptions(time=time_, signal_seconds=seconds - 1).check_signal()
    slurm.SlurmOptions(time="unlimited", signal_seconds=10**6).check_signal()


def test_hand_submitted_throttled_blocks_wait_for_the_one_above(tmp_path):
    groups = slurm.array_groups(list(range(5)), 2)
    script = tmp_path / "s.sbatch"
    throttled = slurm.manual_commands(script, groups, slurm.SlurmOptions(max_running=1))
    assert "--dependency" not in throttled[0]
    assert all("--dependency=afterany:JOB_ID_OF_THE_ONE_ABOVE" in c for c in throttled[1:])
    assert not any("--dependency" in c for c in slurm.manual_commands(script, groups, slurm.SlurmOptions()))


def test_the_requeue_failure_hint_prints_the_job_path_as_it_is(tmp_path):
    job_dir = tmp_path / "job$HOME`echo x`"
    text = slurm.render(job_dir, "p", 1, slurm.array_groups([0], 10), slurm.SlurmOptions(), 10)
    line = next(x.strip() for x in text.splitlines() if "resubmit with" in x)
    out = subprocess.run(["bash", "-c", line], capture_output=True, text=True).stdout
    assert out.strip().endswith(f"resubmit with: batchinfer slurm {job_dir} --retry")


def _header(script: Path) -> list[str]:
    return [
        line[len("#SBATCH ") :] for line in script.read_text().splitlines() if line.startswith("#SBATCH ")
    ]


def test_cli_writes_a_valid_script_and_prints_commands(tmp_path, fake_slurm):
    plan = make_job(tmp_path, rows=12, shards=4)
    result = CliRunner().invoke(
        cli, ["slurm", str(plan.job_dir), "--partition", "gpu", "--time", "1:00:00",
              "--signal-seconds", "120", "--max-running", "2", "--setup", "module load cuda"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    script = plan.job_dir / "slurm" / "batchinfer.sbatch"
    assert f"wrote {script} for 4 of 4 shards (0-3)" in result.output
    assert f"sbatch --array=0-3%2 --export=ALL,BATCHINFER_SHARD_OFFSET=0 {script}" in result.output
    header = _header(script)
    for line in (
        "--requeue",
        "--signal=B:USR2@120",
        "--array=0-3%2",
        "--partition=gpu",
        "--time=1:00:00",
        "--gres=gpu:1",
        f"--output={plan.job_dir}/slurm/logs/%A_%a.out",
        "--open-mode=append",
    ):
        assert line in header  # fmt: skip
    text = script.read_text()
    assert "module load cuda" in text
    assert f'run --output {plan.job_dir} --shard "$shard" &' in text
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert (plan.job_dir / "slurm" / "logs").is_dir()
    assert calls(fake_slurm[0], "sbatch") == []  # nothing submitted without --submit


def test_cli_submit_uses_offsets_beyond_max_array_size(tmp_path, fake_slurm):
    log, bin_dir = fake_slurm
    (bin_dir / "max_array").write_text("4")
    plan = make_job(tmp_path, rows=20, shards=10)
    mark_done(plan, 5)
    result = CliRunner().invoke(cli, ["slurm", str(plan.job_dir), "--submit", "--gpus-per-task", "0"])
    assert result.exit_code == 0, result.output
    script = str(plan.job_dir / "slurm" / "batchinfer.sbatch")
    assert calls(log, "sbatch") == [
        ["--parsable", "--array=0-3", "--export=ALL,BATCHINFER_SHARD_OFFSET=0", script],
        ["--parsable", "--array=0,2-3", "--export=ALL,BATCHINFER_SHARD_OFFSET=4", script],
        ["--parsable", "--array=0-1", "--export=ALL,BATCHINFER_SHARD_OFFSET=8", script],
    ]
    assert not any(line.startswith("--array") for line in _header(Path(script)))  # set per sbatch call
    recorded = slurm.submissions(plan.job_dir)
    assert [(r["job_id"], r["offset"], r["shards"]) for r in recorded] == [
        ("100", 0, "0-3"), ("101", 4, "4,6-7"), ("102", 8, "8-9")
    ]  # fmt: skip
    assert "submitted array job 101: shards 4,6-7" in result.output


def test_throttled_groups_run_one_after_another(tmp_path, fake_slurm):
    log, bin_dir = fake_slurm
    (bin_dir / "max_array").write_text("2")
    plan = make_job(tmp_path, rows=6, shards=3)
    result = CliRunner().invoke(cli, ["slurm", str(plan.job_dir), "--submit", "--max-running", "1"])
    assert result.exit_code == 0, result.output
    argvs = calls(log, "sbatch")
    assert "--dependency=afterany:100" in argvs[1]
    assert not any(a.startswith("--dependency") for a in argvs[0])


def test_retry_skips_done_and_queued_shards_and_reuses_options(tmp_path, fake_slurm):
    log, bin_dir = fake_slurm
    plan = make_job(tmp_path, rows=16, shards=8)
    first = CliRunner().invoke(cli, ["slurm", str(plan.job_dir), "--submit", "--partition", "h200"])
    assert first.exit_code == 0, first.output
    for s in (0, 1, 2):
        mark_done(plan, s)
    # squeue still lists shard 3 running and 6 pending; 4, 5 and 7 died
    (bin_dir / "squeue.out").write_text("100 3 RUNNING\n100 6 PENDING\n")
    again = CliRunner().invoke(cli, ["slurm", str(plan.job_dir), "--submit"])
    assert isinstance(again.exception, InputError)
    assert "2 shards of earlier submissions are still queued or running (e.g. shard 3: RUNNING)" in str(
        again.exception
    )
    retry = CliRunner().invoke(cli, ["slurm", str(plan.job_dir), "--retry", "--time", "2:00:00"])
    assert retry.exit_code == 0, retry.output
    assert calls(log, "sbatch")[-1][:2] == ["--parsable", "--array=4-5,7"]
    assert calls(log, "squeue")[-1] == ["--noheader", "--array", "--jobs=100", "--format=%F %K %T"]
    header = _header(plan.job_dir / "slurm" / "batchinfer.sbatch")
    assert "--partition=h200" in header and "--time=2:00:00" in header  # saved option kept, new one added


def test_nothing_to_do_exits_zero(tmp_path, fake_slurm):
    log, bin_dir = fake_slurm
    plan = make_job(tmp_path, rows=4, shards=2)
    (bin_dir / "squeue.out").write_text("100 0 RUNNING\n100 1 PENDING\n")
    CliRunner().invoke(cli, ["slurm", str(plan.job_dir), "--submit"])
    queued = CliRunner().invoke(cli, ["slurm", str(plan.job_dir), "--retry"])
    assert queued.exit_code == 0
    assert "all 2 unfinished shards are queued or running in Slurm; nothing to resubmit" in queued.output
    mark_done(plan, 0)
    mark_done(plan, 1)
    done = CliRunner().invoke(cli, ["slurm", str(plan.job_dir), "--retry"])
    assert done.exit_code == 0
    assert "all 2 shards of" in done.output and "are done; nothing to submit" in done.output
    assert len(calls(log, "sbatch")) == 1


def test_squeue_forgetting_every_job_means_nothing_active(tmp_path, fake_slurm):
    _, bin_dir = fake_slurm
    plan = make_job(tmp_path, rows=4, shards=2)
    CliRunner().invoke(cli, ["slurm", str(plan.job_dir), "--submit"])
    (bin_dir / "squeue.err").write_text("slurm_load_jobs error: Invalid job id specified\n")
    (bin_dir / "squeue.rc").write_text("1")
    assert slurm.active_shards(plan.job_dir) == {}


def test_sbatch_failure_is_a_clear_error(tmp_path, fake_slurm):
    _, bin_dir = fake_slurm
    (bin_dir / "sbatch").write_text(
        "#!/bin/sh\necho 'sbatch: error: invalid partition specified: nope' >&2\nexit 1\n"
    )
    plan = make_job(tmp_path, rows=4, shards=2)
    result = CliRunner().invoke(cli, ["slurm", str(plan.job_dir), "--submit", "--partition", "nope"])
    assert isinstance(result.exception, slurm.SlurmError)
    assert "failed (1): sbatch: error: invalid partition specified: nope" in str(result.exception)


def test_slurm_without_plan_says_how_to_start(tmp_path):
    result = CliRunner().invoke(cli, ["slurm", str(tmp_path / "nojob")])
    assert isinstance(result.exception, InputError)
    assert "no plan here" in str(result.exception)


def _run_script(plan: Plan, task: int, offset: int = 0) -> subprocess.Popen:
    """Run the rendered array script as Slurm would start one task (fake scontrol on PATH)."""
    env = {**os.environ, "SLURM_ARRAY_TASK_ID": str(task), "SLURM_ARRAY_JOB_ID": "55", "SLURM_JOB_ID": "56",
           "BATCHINFER_SHARD_OFFSET": str(offset)}  # fmt: skip
    script = plan.job_dir / "slurm" / "batchinfer.sbatch"
    return subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip


def _ids(plan: Plan, shard: int) -> list[int]:
    ids: list[int] = []
    for path in (plan.job_dir / commit.SHARDS_DIR / f"{shard:05d}").glob("*.parquet"):
        ids += pq.read_table(path, columns=["id"]).column("id").to_pylist()
    return sorted(ids)


def test_script_runs_the_offset_shard(tmp_path, fake_slurm):
    plan = make_job(tmp_path, rows=12, shards=6)
    assert CliRunner().invoke(cli, ["slurm", str(plan.job_dir)]).exit_code == 0
    proc = _run_script(plan, task=1, offset=4)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "batchinfer: shard 5, array task 55_1 (job 56)" in out
    assert attempts.incomplete_shards(plan) == [0, 1, 2, 3, 4]
    assert _ids(plan, 5) == [10, 11]
    assert requeues(fake_slurm[0]) == []


def test_script_forwards_usr2_commits_and_requeues_itself(tmp_path, fake_slurm):
    log, _ = fake_slurm
    plan = make_job(tmp_path, rows=30, shards=1, chunk_rows=2, engine_args={"delay": "0.1"})
    assert CliRunner().invoke(cli, ["slurm", str(plan.job_dir)]).exit_code == 0
    proc = _run_script(plan, task=0)
    chunks = plan.job_dir / commit.SHARDS_DIR / "00000"
    deadline = time.monotonic() + 60
    while len(list(chunks.glob("*.parquet"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR2)  # what --signal=B:USR2@N does: only the batch shell gets it
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "worker exited with 75" in out and "requeueing shard 0" in out
    assert requeues(log) == [["requeue", "56"]]
    committed = _ids(plan, 0)
    assert 2 * 2 <= len(committed) < 30  # stopped early, with whole chunks only
    again = _run_script(plan, task=0)  # the requeued task
    out, _ = again.communicate(timeout=60)
    assert again.returncode == 0, out
    assert _ids(plan, 0) == list(range(30))
    assert requeues(log) == [["requeue", "56"]]  # finished: no second requeue


def test_script_passes_a_worker_failure_on_without_requeue(tmp_path, fake_slurm):
    plan = make_job(tmp_path, rows=4, shards=1, engine_args={"crash_marker": "row 2"})
    assert CliRunner().invoke(cli, ["slurm", str(plan.job_dir)]).exit_code == 0
    proc = _run_script(plan, task=0)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out  # the task fails, so `--retry` picks the shard up again
    assert "echo engine crashed" in out
    assert requeues(fake_slurm[0]) == []


def test_corrupt_saved_options_name_the_file(tmp_path):
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / "options.json").write_text("{not json")
    with pytest.raises(InputError, match=r"slurm/options.json: not valid saved Slurm options"):
        slurm.SlurmOptions.load(tmp_path)
