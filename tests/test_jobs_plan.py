"""plan.json: input validation (job-level errors), shard ranges, refusal of a changed job, set-aside."""

import json
import os
import socket

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from batchinfer.jobs import commit
from batchinfer.jobs import plan as plans
from batchinfer.jobs.lock import shard_lock
from jobs_fixtures import ECHO, model_dir, write_inputs

from batchinfer.errors import InputError, PlanMismatchError


def _plan(tmp_path, patterns=None, **kw):
    kw.setdefault("engine", ECHO)
    return plans.build_plan(
        tmp_path / "out", patterns or [str(tmp_path / "in")], model_dir(tmp_path), {"max_tokens": 8}, **kw
    )


def test_plan_describes_inputs_shards_model_and_versions(tmp_path):
    paths = write_inputs(tmp_path, files=3, rows=20)
    p = _plan(tmp_path, num_shards=4, chunk_rows=6, seed=5, keep_columns=["topic"])
    d = p.doc
    assert [f["path"] for f in d["inputs"]] == [str(x.resolve()) for x in paths]
    assert [f["rows"] for f in d["inputs"]] == [20, 20, 20]
    assert [f["row_offset"] for f in d["inputs"]] == [0, 20, 40]
    assert all(f["size"] > 0 and len(f["fingerprint"]) == 16 for f in d["inputs"])
    assert [(s["start"], s["end"]) for s in d["shards"]] == [(0, 15), (15, 30), (30, 45), (45, 60)]
    assert d["model"]["model_type"] == "qwen3_moe" and len(d["model"]["config_hash"]) == 16
    assert d["schemas"]["llm_output"] == 1 and d["id_type"] == "int64" and d["seed"] == 5
    assert d["plan_id"] == plans.hash_plan(d)
    assert p.save() and not p.save()  # exclusive: a second writer never replaces the plan
    again = plans.Plan.load(tmp_path / "out")
    assert again.doc == d


def test_split_rows_covers_everything_evenly():
    for total, n in [(10, 3), (7, 7), (100, 1), (5, 2)]:
        ranges = plans.split_rows(total, n)
        assert ranges[0][0] == 0 and ranges[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
        sizes = [e - s for s, e in ranges]
        assert max(sizes) - min(sizes) <= 1


def test_more_shards_than_rows_is_capped(tmp_path):
    write_inputs(tmp_path, files=1, rows=5)
    assert _plan(tmp_path, num_shards=50).num_shards == 5


def test_changed_input_file_is_refused_with_what_changed(tmp_path):
    paths = write_inputs(tmp_path, files=2, rows=10)
    first = plans.open_or_create(_plan(tmp_path))
    plans.verify_inputs(first)
    pq.write_table(pa.table({"id": list(range(10, 20)), "prompt": ["changed"] * 10}), paths[1])
    with pytest.raises(PlanMismatchError, match=r"part-1.parquet: (size changed|content changed)"):
        plans.verify_inputs(first)
    with pytest.raises(PlanMismatchError, match=r"changed: input file changed: .*part-1.parquet"):
        plans.open_or_create(_plan(tmp_path, check_rows=False))


def test_changed_parameters_are_refused_and_listed(tmp_path):
    write_inputs(tmp_path, files=1, rows=10)
    plans.open_or_create(_plan(tmp_path, seed=1))
    other = plans.build_plan(
        tmp_path / "out", [str(tmp_path / "in")], model_dir(tmp_path), {"max_tokens": 9}, seed=2, engine=ECHO
    )
    with pytest.raises(PlanMismatchError) as e:
        plans.open_or_create(other)
    assert (
        "sampling: " in str(e.value) and '"max_tokens": 8' in str(e.value) and "seed: 1 -> 2" in str(e.value)
    )
    same = plans.open_or_create(_plan(tmp_path, seed=1))
    assert same.plan_id == plans.Plan.load(tmp_path / "out").plan_id


def _write(tmp_path, name, table):
    d = tmp_path / "in"
    d.mkdir(exist_ok=True)
    pq.write_table(table, d / name)
    return d / name


@pytest.mark.parametrize(
    "table, message",
    [
        (pa.table({"prompt": ["a"]}), r"bad.parquet: missing required column 'id'"),
        (
            pa.table({"id": [1], "text": ["a"]}),
            r"bad.parquet: needs one of the columns \['prompt', 'messages'\]",
        ),
        (
            pa.table({"id": [1.5], "prompt": ["a"]}),
            r"bad.parquet: column 'id': expected type string\|integer, found double",
        ),
        (
            pa.table({"id": [1], "prompt": [3]}),
            r"bad.parquet: column 'prompt': expected type string, found int64",
        ),
        (
            pa.table({"id": [1], "prompt": ["a"], "max_tokens": ["ten"]}),
            r"column 'max_tokens': expected type integer",
        ),
        (
            pa.table({"id": pa.array([], pa.int64()), "prompt": pa.array([], pa.string())}),
            r"bad.parquet: has 0 rows",
        ),
        (
            pa.table({"id": [1, None], "prompt": ["a", "b"]}),
            r"bad.parquet: column 'id' has 1 null value\(s\), first at row 1",
        ),
    ],
)
def test_job_level_input_errors(tmp_path, table, message):
    _write(tmp_path, "bad.parquet", table)
    with pytest.raises(InputError, match=message):
        _plan(tmp_path)


USER = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    "columns, message",
    [
        ({"prompt": ["a", None, "c", None]},
         r"bad.parquet: row 1 \(id 11\): column 'prompt' is null and the file has no 'messages' column "
         r"\(2 such rows in its row group\)"),
        ({"prompt": ["a", "b", None, "d"], "messages": [None, None, None, USER]},
         r"bad.parquet: row 2 \(id 12\): column 'prompt' is null and column 'messages' is null"),
        ({"messages": [USER, None, [], None]},
         r"bad.parquet: row 1 \(id 11\): column 'prompt' is null and column 'messages' is null"),
        ({"prompt": ["a", "b", None, "d"], "messages": [None, None, [], USER]},
         r"bad.parquet: row 3 \(id 13\): columns 'prompt' and 'messages' are both set"),
    ],
)  # fmt: skip
def test_rows_without_exactly_one_of_prompt_messages_are_job_level(tmp_path, columns, message):
    _write(tmp_path, "bad.parquet", pa.table({"id": [10, 11, 12, 13], **columns}))
    with pytest.raises(InputError, match=message):
        _plan(tmp_path)


def test_prompt_scan_trusts_statistics_and_reads_only_what_it_must(tmp_path, monkeypatch):
    d = tmp_path / "in"
    d.mkdir()
    n = 40
    pq.write_table(pa.table({"id": list(range(n)), "prompt": [f"p{i}" for i in range(n)]}), d / "a.parquet",
                   row_group_size=10)  # fmt: skip
    prompts = [f"p{i}" for i in range(n)]
    msgs = [None] * n
    prompts[33], msgs[33] = None, [{"role": "user", "content": "hi"}]  # valid: messages instead of prompt
    pq.write_table(pa.table({"id": list(range(n, 2 * n)), "prompt": prompts, "messages": msgs}),
                   d / "b.parquet", row_group_size=10)  # fmt: skip
    reads = []
    original = pq.ParquetFile.read_row_group

    def counting(self, i, columns=None, **kw):
        reads.append((i, tuple(columns)))
        return original(self, i, columns=columns, **kw)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counting)
    assert _plan(tmp_path).doc["total_rows"] == 2 * n
    # a.parquet: no null prompts by its statistics, no messages column: nothing read beyond the ids.
    # b.parquet: prompt text only in the group holding the null; messages only by its roles leaf.
    assert sorted(reads) == [(0, ("messages.list.element.role",)), (1, ("messages.list.element.role",)),
                             (2, ("messages.list.element.role",)), (3, ("messages.list.element.role",)),
                             (3, ("prompt",))]  # fmt: skip


def test_empty_and_corrupt_files(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    (d / "empty.parquet").write_bytes(b"")
    with pytest.raises(InputError, match=r"empty.parquet: empty file \(0 bytes\)"):
        _plan(tmp_path)
    (d / "empty.parquet").unlink()
    good = _write(tmp_path, "good.parquet", pa.table({"id": [1, 2], "prompt": ["a", "b"]}))
    data = good.read_bytes()
    (d / "corrupt.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match=r"corrupt.parquet: not a readable Parquet file"):
        _plan(tmp_path)


def test_duplicate_ids_across_files_name_both_places(tmp_path):
    _write(tmp_path, "a.parquet", pa.table({"id": ["x", "y"], "prompt": ["1", "2"]}))
    _write(tmp_path, "b.parquet", pa.table({"id": ["z", "y"], "prompt": ["3", "4"]}))
    with pytest.raises(InputError, match=r"id 'y' appears at .*a.parquet row 1, .*b.parquet row 1"):
        _plan(tmp_path)


def test_mixed_id_types_and_keep_column_problems(tmp_path):
    _write(tmp_path, "a.parquet", pa.table({"id": [1], "prompt": ["1"], "k": [1]}))
    _write(tmp_path, "b.parquet", pa.table({"id": ["2"], "prompt": ["2"]}))
    with pytest.raises(InputError, match=r"column 'id' must have one type across input files"):
        _plan(tmp_path)
    (tmp_path / "in" / "b.parquet").unlink()
    _write(tmp_path, "b.parquet", pa.table({"id": [2], "prompt": ["2"]}))
    with pytest.raises(
        InputError, match=r"b.parquet: --keep-columns names column 'k', which this file lacks"
    ):
        _plan(tmp_path, keep_columns=["k"])
    with pytest.raises(InputError, match=r"--keep-columns 'text' collides with the output column"):
        _plan(tmp_path, keep_columns=["text"])
    with pytest.raises(InputError, match=r"--keep-columns names column 'prompt' twice; expected each"):
        _plan(tmp_path, keep_columns=["prompt", "prompt"])  # was planned, then every run failed in pyarrow


def test_missing_input_and_bad_sampling(tmp_path):
    with pytest.raises(InputError, match=r"nope.parquet: no such file"):
        _plan(tmp_path, [str(tmp_path / "nope.parquet")])
    with pytest.raises(InputError, match=r"matches no Parquet files"):
        _plan(tmp_path, [str(tmp_path / "*.parquet")])
    write_inputs(tmp_path, files=1, rows=3)
    with pytest.raises(InputError, match="sampling parameters: temperature must be a finite number >= 0"):
        plans.build_plan(tmp_path / "o", [str(tmp_path / "in")], model_dir(tmp_path), {"temperature": -1})


def test_set_aside_keeps_old_results(tmp_path):
    write_inputs(tmp_path, files=1, rows=4)
    p = plans.open_or_create(_plan(tmp_path))
    chunk = commit.chunk_path(p.job_dir, 0, 1, 0)
    commit.write_parquet_atomic(chunk, pa.table({"x": [1]}), {})
    dest = plans.set_aside(p.job_dir)
    assert not (p.job_dir / "plan.json").exists() and not chunk.exists()
    assert json.loads((dest / "plan.json").read_text())["plan_id"] == p.plan_id
    assert (dest / "shards" / "00000" / chunk.name).exists()
    assert plans.set_aside(p.job_dir) is None


def test_set_aside_is_refused_while_a_runner_holds_a_shard(tmp_path):
    """A runner kept writing the old plan's chunks and marker into the new job, which then looked done."""
    write_inputs(tmp_path, files=1, rows=4)
    p = plans.open_or_create(_plan(tmp_path, num_shards=2))
    with shard_lock(p.job_dir, 1) as held:
        assert held
        with pytest.raises(InputError) as e:
            plans.set_aside(p.job_dir)
    assert str(e.value).startswith(
        f"{p.job_dir}/locks/00001.lock: shard 00001 of plan {p.plan_id} is being run by "
        f"{socket.gethostname()} {os.getpid()} "
    )
    assert (p.job_dir / "plan.json").exists() and not (p.job_dir / "superseded").exists()
    assert plans.set_aside(p.job_dir) is not None  # once the runner is gone
