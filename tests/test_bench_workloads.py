"""`bench run`: workload token ids, the measured figures, the JSON result, and the lock inside the run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from jobs_fixtures import run_cli

from batchinfer.bench.accuracy_lock import AccuracyLockError
from batchinfer.bench.e2e import ReferenceTokenEngine, measure
from batchinfer.bench.workload_run import build_model, run_benchmark
from batchinfer.bench.workloads import load_workloads, workload_requests
from batchinfer.cli import bench as bench_cli
from batchinfer.cli import cli
from batchinfer.errors import ConfigError

SHARED = Path(__file__).resolve().parents[2] / "shared" / "bench" / "workloads.json"
CPU = torch.device("cpu")
GENERATION = (
    "rng = numpy.random.default_rng(seed); in_lens = rng.integers(in_lo, in_hi + 1, size=n); "
    "out_lens = rng.integers(out_lo, out_hi + 1, size=n); then for i in range(n): "
    "prompt_i = rng.integers(token_lo, token_hi, size=in_lens[i])."
)


@pytest.mark.skipif(not SHARED.exists(), reason="no ../shared/bench/workloads.json beside the checkout")
def test_packaged_workloads_equal_the_shared_file():
    assert load_workloads() == json.loads(SHARED.read_text())


def _rederive(doc: dict, name: str) -> tuple[list[list[int]], list[int]]:
    """The ids straight from the file's generation text, written independently of workloads.py."""
    w = doc["llm"][name]
    rng = np.random.default_rng(doc["seed"])
    ins = rng.integers(w["in_lo"], w["in_hi"] + 1, size=w["n"])
    outs = rng.integers(w["out_lo"], w["out_hi"] + 1, size=w["n"])
    prompts = []
    for i in range(w["n"]):
        prompts.append([int(t) for t in rng.integers(doc["token_lo"], doc["token_hi"], size=ins[i])])
    return prompts, [int(o) for o in outs]


@pytest.mark.parametrize("name", ["single", "conc32", "offline"])
def test_token_ids_follow_the_generation_text(name):
    doc = load_workloads()
    assert doc["generation"]["llm"].startswith(GENERATION)  # the recipe the re-derivation implements
    req = workload_requests(name, vocab_size=1 << 20)
    prompts, outs = _rederive(doc, name)
    assert req.prompts == prompts and req.out_lens == outs and req.deviations == {}
    assert all(doc["token_lo"] <= min(p) and max(p) < doc["token_hi"] for p in req.prompts)


def test_token_ids_pinned():
    """Pinned values: a numpy or file change that moves the ids fails here, not silently in a figure."""
    single = workload_requests("single", vocab_size=1 << 20)
    assert single.prompts[0][:5] == [144453, 33124, 129860, 23997, 60938] and single.out_lens == [512]
    assert len(single.prompts[0]) == 512
    offline = workload_requests("offline", vocab_size=1 << 20)
    assert offline.out_lens[:5] == [991, 1022, 94, 573, 215]
    assert [len(p) for p in offline.prompts[:5]] == [1977, 552, 1791, 435, 908]
    assert offline.prompts[0][:5] == [114999, 24117, 2869, 132134, 30666]
    assert offline.prompt_tokens == 2227330 and sum(offline.out_lens) == 1093387
    # the prompts come after both length draws (numpy draws nothing for a one-value range, so this
    # shows only where lengths vary)
    rng = np.random.default_rng(20261129)
    rng.integers(128, 2049, size=2048)
    assert rng.integers(10, 150000, size=5).tolist() != offline.prompts[0][:5]


def test_shrinking_is_recorded_and_keeps_prefixes():
    full = workload_requests("offline", vocab_size=1 << 20)
    small = workload_requests("offline", vocab_size=512, max_requests=3, max_in=16, max_out=8)
    assert small.deviations == {"max_requests": 3, "max_in": 16, "max_out": 8, "token_ids_mod_vocab": 512}
    assert small.capped and not full.capped
    assert small.prompts == [[t % 512 for t in p[:16]] for p in full.prompts[:3]]
    assert small.out_lens == [min(8, n) for n in full.out_lens[:3]]
    # a cap at or above the workload's own size is no deviation
    assert workload_requests("single", vocab_size=1 << 20, max_requests=5, max_out=512).deviations == {}
    with pytest.raises(ConfigError, match="unknown workload 'bogus'"):
        workload_requests("bogus", vocab_size=512)
    with pytest.raises(ConfigError, match="--max-in must be >= 1, got 0"):
        workload_requests("single", vocab_size=512, max_in=0)


@pytest.fixture(scope="module")
def tiny():
    return build_model(
        model_path=None, preset="tiny-qwen3.5-moe", quant="mixed", device=CPU, dtype=torch.bfloat16
    )


def test_measure_figures_are_consistent(tiny):
    req = workload_requests("offline", vocab_size=512, max_requests=5, max_in=24, max_out=6)
    engine = ReferenceTokenEngine(tiny.model, max_batch_size=2)
    outputs, f = measure(engine, req.prompts, req.out_lens, CPU)
    assert [len(o) for o in outputs] == req.out_lens
    assert f["requests"] == 5 and f["output_tokens"] == sum(req.out_lens)
    assert f["prompt_tokens"] == req.prompt_tokens
    assert f["out_tok_per_s"] == pytest.approx(f["output_tokens"] / f["wall_s"])
    assert f["total_tok_per_s"] == pytest.approx((f["output_tokens"] + f["prompt_tokens"]) / f["wall_s"])
    assert 0 < f["ttft_ms"]["p50"] <= f["ttft_ms"]["max"] <= f["wall_s"] * 1e3
    # batches of 2, 2, 1 rows (sorted by prompt length); rows leave their batch as they finish
    steps = f["batch_sizes"]["steps"]
    assert f["batch_sizes"]["max"] == 2 and sum(k * v for k, v in steps.items()) == f["output_tokens"]
    assert f["peak_memory_kind"] == "process peak RSS" and f["peak_memory_bytes"] > 10 * 2**20


class _ShortEngine(ReferenceTokenEngine):
    def generate_ids(self, prompts, params, on_step):
        return [o[:-1] for o in super().generate_ids(prompts, params, on_step)]


def test_an_engine_that_stops_early_is_an_error(tiny):
    req = workload_requests("single", vocab_size=512, max_in=8, max_out=4)
    with pytest.raises(RuntimeError, match="returned 3 tokens for request 0 \\(expected exactly 4"):
        measure(_ShortEngine(tiny.model, 4), req.prompts, req.out_lens, CPU)


class _WrongTokens(ReferenceTokenEngine):
    """Right count, wrong ids: each token shifted by one."""

    def generate_ids(self, prompts, params, on_step):
        return [[(t + 1) % 512 for t in o] for o in super().generate_ids(prompts, params, on_step)]


class _Repeater(ReferenceTokenEngine):
    """The reference's first 4 tokens, then its 4th token over and over."""

    def generate_ids(self, prompts, params, on_step):
        return [o[:4] + [o[3]] * (len(o) - 4) for o in super().generate_ids(prompts, params, on_step)]


@pytest.mark.parametrize("broken", [_WrongTokens, _Repeater])
def test_broken_engines_fail_the_lock(tiny, broken):
    req = workload_requests("conc32", vocab_size=512, max_requests=2, max_in=16, max_out=40)
    with pytest.raises(AccuracyLockError, match="accuracy lock failed for engine reference: request 0"):
        run_benchmark(broken(tiny.model, 4), tiny, req, CPU)


def test_cli_single_on_the_tiny_preset(tmp_path):
    out = tmp_path / "new" / "single.json"  # --json's folder is made, as export makes its output's
    args = ["bench", "run", "--workload", "single", "--preset", "tiny-qwen3.5-moe", "--random"]
    args += ["--quant", "nvfp4", "--dtype", "bf16", "--max-in", "48", "--max-out", "40", "--json", str(out)]
    res = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["workload"] == "single" and doc["seed"] == 20261129 and doc["capped"] is False
    assert doc["deviations"] == {"max_in": 48, "max_out": 40, "token_ids_mod_vocab": 512}
    assert doc["model"]["quantization"] == "nvfp4" and doc["model"]["model_type"] == "qwen3_5_moe"
    assert doc["engine"] == {
        "engine": "reference",
        "device": "cpu",
        "dtype": "bfloat16",
        "max_batch_size": "16",
    }
    r = doc["results"]
    assert r["requests"] == 1 and r["output_tokens"] == 40 and r["prompt_tokens"] == 48
    assert r["batch_sizes"] == {"max": 1, "mean": 1.0, "steps": {"1": 40}}
    assert r["benchmark_weights_during_run"] == "cpu"  # the reference engine reads them: they stay
    for key in ("wall_s", "out_tok_per_s", "total_tok_per_s", "decode_tok_per_s", "tpot_ms"):
        assert r[key] > 0, key
    lock = doc["accuracy_lock"]
    assert lock["passed"] and lock["sequences"] == [0] and lock["positions"] == 40 and lock["tol_std"] == 0.5
    assert lock["top1_agreement"] > 0.9 and lock["max_gap_std"] <= 0.5
    assert doc["peer"] is None and set(doc["environment"]) == {"commit", "date", "device", "torch"}
    assert "workload single (deviations: max_in=48, max_out=40, token_ids_mod_vocab=512)" in res.output
    assert "accuracy lock passed: 1 sequences, 40 tokens" in res.output


def test_cli_run_refuses_values_and_flags_its_engine_cannot_take(tmp_path, monkeypatch):
    """Refused in one line before any weights are drawn; each was a traceback or silently ignored."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    (tmp_path / "file").write_text("")
    base = [
        "bench",
        "run",
        "--workload",
        "single",
        "--preset",
        "tiny-qwen3-moe",
        "--random",
        "--device",
        "cpu",
    ]
    for extra, message in (
        (["--max-batch-size", "0"], "Invalid value for '--max-batch-size': 0 is not in the range x>=1."),
        (["--peer", "hf", "--peer-max-requests", "0"], "Invalid value for '--peer-max-requests': 0 is not"),
        (["--breakdown", "8"], "--breakdown profiles the fast engine's kernels (--engine fast)"),
        (["--engine", "fast", "--max-batch-size", "4"], "--max-batch-size applies to the reference engine"),
        (
            ["--engine", "fast"],
            "--engine fast runs Triton kernels and needs a CUDA device; --device cpu is cpu",
        ),
        (
            ["--json", str(tmp_path / "file" / "r.json")],
            f"Invalid value for '--json': cannot create its folder {tmp_path / 'file'} (",
        ),
    ):
        res = CliRunner().invoke(cli, [*base, *extra])
        assert res.exit_code == 2 and message in res.output, (extra, res.output)


def test_cli_breakdown_checks_its_model_and_needs_a_gpu():
    runner = CliRunner()
    res = runner.invoke(cli, ["bench", "breakdown", "--preset", "tiny-qwen3-moe"])
    assert res.exit_code == 2 and "--preset draws random weights; say so with --random" in res.output
    res = runner.invoke(cli, ["bench", "breakdown"])
    assert res.exit_code == 2 and "give exactly one of --model PATH or --preset NAME --random" in res.output
    res = runner.invoke(
        cli, ["bench", "breakdown", "--preset", "tiny-qwen3-moe", "--random", "--device", "cpu"]
    )
    assert isinstance(res.exception, ConfigError)  # the console script prints it as "error: ...", exit 2
    assert "profiles CUDA kernels; --device cpu is not a CUDA GPU" in str(res.exception)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cli_gpu_benchmarks_refuse_a_machine_without_one_alike():
    # exit 2 and one line each from the console script: kernels used to exit 1, the others 2
    for args, expected in (
        (["kernels"], "bench kernels needs a CUDA GPU; torch sees none on this machine"),
        (["breakdown", "--preset", "tiny-qwen3-moe", "--random"], "torch sees no CUDA GPU on this machine"),
        (["images", "--workload", "images-1p", "--preset", "sam3", "--random", "--breakdown"],
         "--breakdown profiles CUDA kernels; --device auto is cpu, not a CUDA GPU"),
    ):  # fmt: skip
        res = run_cli("bench", *args)
        assert res.returncode == 2 and expected in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_breakdown_groups_every_deltanet_kernel_as_its_rule():
    # session 18's profile filed the split chunk launches under "other" until their names were added
    from batchinfer.kernels import gdn, gdn_chunk

    from batchinfer.bench.breakdown import GROUPS, _group

    names = [n for mod in (gdn, gdn_chunk) for n in vars(mod) if n.endswith("_kernel")]
    rule = [n for n in names if "rmsnorm" not in n]  # gdn.py holds the gated RMSNorm too
    assert len(rule) >= 6 and {_group(n, GROUPS) for n in rule} == {"deltanet rule"}


def test_breakdown_groups_every_engine_kernel():
    # session 23's profile filed the one-row FP8/NVFP4 GEMVs (740 us of a 2.3 ms step), the KV-cache store
    # and the sampler's launches under "other", and our FP8 tile GEMM under cuBLAS
    import importlib
    import pkgutil

    from batchinfer import kernels
    from batchinfer.bench.breakdown import GROUPS, _group

    found = [m.name for m in pkgutil.iter_modules(kernels.__path__)]
    mods = [importlib.import_module(f"batchinfer.kernels.{n}") for n in found if n != "fp8_quant"]  # images'
    names = {n for mod in mods for n in vars(mod) if n.startswith("_") and n.endswith("_kernel")}
    assert len(names) >= 35 and not [n for n in names if _group(n, GROUPS) == "other"]
    expect = {
        "_fp8_gemv_kernel": "projections (ours)",
        "_nvfp4_gemv_kernel": "projections (ours)",
        "_nvfp4_rows_tc_kernel": "projections (ours)",  # lm_head of 2-64 rows
        "_fp8_gemm_kernel": "projections (ours)",
        "_fp8_rows_mm_kernel": "projections (ours)",
        "_store_kv_kernel": "kv cache write",
        "_moe_offsets_kernel": "moe route + align",
        "_norm_route_kernel": "add + rmsnorm + router + route",
        "_sum_slots_kernel": "moe experts",
        "_decode_combine_kernel": "attention",
        "_draw_kernel": "sampling",
        "nvjet_sm90_tst_128x32_64x10_4x1_v_bz_TNT": "gemm (cuBLAS)",
    }
    assert {n: _group(n, GROUPS) for n in expect} == expect


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cli_breakdown_profiles_each_batch_and_a_pass(tmp_path):
    out = tmp_path / "b.json"
    args = ["bench", "breakdown", "--preset", "tiny-qwen3.5-moe", "--random", "--quant", "mixed"]
    res = CliRunner().invoke(
        cli, [*args, "--batch", "1", "--batch", "4", "--prompt-len", "80", "--json", out]
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert [d["batch"] for d in doc["decode_steps"]] == [1, 4] and doc["prefill_pass"]["prompt_len"] == 80
    for d in [*doc["decode_steps"], doc["prefill_pass"]]:
        assert d["total_us"] > 0 and abs(sum(d["groups"].values()) - d["total_us"]) < 1e-3 * d["total_us"]
        assert d["top_kernels"] and all(k["launches"] >= 1 for k in d["top_kernels"])
    assert "decode step (batch 4 at 512)" in res.output and "prefill pass (1 x 80 tokens)" in res.output


def test_cli_refuses_ambiguous_models(tmp_path):
    runner = CliRunner()
    res = runner.invoke(cli, ["bench", "run", "--workload", "single", "--preset", "tiny-qwen3-moe"])
    assert res.exit_code == 2 and "--preset draws random weights; say so with --random" in res.output
    res = runner.invoke(cli, ["bench", "run", "--workload", "single"])
    assert res.exit_code == 2 and "give exactly one of --model PATH or --preset NAME --random" in res.output
    base = ["bench", "run", "--workload", "single", "--preset", "tiny-qwen3-moe", "--random"]
    res = runner.invoke(cli, [*base, "--lock-sample", "4"])
    assert res.exit_code == 2 and "--lock-sample must be >= 16, got 4" in res.output
    res = runner.invoke(cli, [*base, "--engine", "reference", "--refill-fraction", "0.5"])
    assert res.exit_code == 2 and "--prefill-graph-tokens apply to the fast engine" in res.output
    res = runner.invoke(cli, [*base, "--engine", "reference", "--prefill-graph-tokens", "512"])
    assert res.exit_code == 2 and "--prefill-graph-tokens apply to the fast engine" in res.output
    res = runner.invoke(cli, [*base, "--engine", "reference", "--bf16-experts"])
    assert res.exit_code == 2 and "--bf16-experts applies to the fast engine" in res.output
    res = runner.invoke(
        cli, ["bench", "run", "--workload", "bogus", "--preset", "tiny-qwen3-moe", "--random"]
    )
    assert (
        res.exit_code == 2
        and "Invalid value for --workload: 'bogus'; the workloads file has single" in res.output
    )


def test_cli_model_folder(tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint("tiny-qwen3-moe", "nvfp4")
    out = tmp_path / "r.json"
    args = ["bench", "run", "--workload", "extract", "--model", str(folder), "--max-requests", "2"]
    args += ["--max-in", "20", "--json", str(out)]
    res = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["model"] == {
        "model": str(folder),
        "model_type": "qwen3_moe",
        "quantization": "nvfp4",
        "vocab_size": "512",
    }
    assert doc["results"]["output_tokens"] == 16  # extract: 8 tokens per request, not shrunk
    assert doc["deviations"] == {"max_requests": 2, "max_in": 20, "token_ids_mod_vocab": 512}


def test_cli_schedule_defaults_are_the_engines():
    """`bench run` spells the fast engine's schedule defaults out (its --help imports no torch)."""
    import inspect

    from batchinfer.cli.bench import run
    from batchinfer.engine.fast import MAX_SLOTS, PREFILL_TOKENS, REFILL_FRACTION, FastGenerator

    params = {p.name: p.default for p in run.params}
    assert (params["prefill_tokens"], params["refill_fraction"]) == ((PREFILL_TOKENS,), (REFILL_FRACTION,))
    assert params["max_slots"] == (MAX_SLOTS,)
    graphs = inspect.signature(FastGenerator).parameters["prefill_graph_tokens"].default
    assert params["prefill_graph_tokens"] == graphs


def test_cli_runs_each_workload_under_every_schedule(monkeypatch, tmp_path):
    """Repeated --max-slots / --prefill-tokens / --refill-fraction: every workload once per combination,
    on one model load and one exactness check, each run recording its schedule. The exactness check and
    the runs themselves are stubbed: this is the CLI's plumbing (the runs are tested elsewhere)."""
    from types import SimpleNamespace

    from batchinfer.bench import exactness, workload_run

    checks = []
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(
        exactness,
        "engine_exactness",
        lambda *a, **k: checks.append(1) or SimpleNamespace(passed=True, as_dict=lambda: {"passed": True}),
    )
    monkeypatch.setattr(bench_cli, "format_exactness", lambda e: "exactness stub")
    monkeypatch.setattr(bench_cli, "format_result", lambda result: [])

    def fake_run(engine, bm, requests, device, **kwargs):
        return {"workload": requests.name, "engine": engine.describe(), "peer": None}

    monkeypatch.setattr(workload_run, "run_benchmark", fake_run)
    out = tmp_path / "r.json"
    args = ["bench", "run", "--workload", "single,extract", "--preset", "tiny-qwen3-moe", "--random"]
    args += ["--quant", "nvfp4", "--engine", "fast", "--device", "cpu"]
    args += ["--max-slots", "2", "--max-slots", "8"]
    args += ["--refill-fraction", "0.25", "--refill-fraction", "0.5", "--bf16-experts", "--json", str(out)]
    res = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    runs = json.loads(out.read_text())
    got = [(r["workload"], r["engine"]["max_slots"], r["engine"]["refill_fraction"]) for r in runs]
    assert got == [(w, s, f) for s in ("2", "8") for f in ("0.25", "0.5") for w in ("single", "extract")]
    assert {r["engine"]["bf16_experts"] for r in runs} == {"True"}  # the NVFP4 experts' copies were made
    assert checks == [1] and res.output.count("schedule: max_slots") == 8
    res = CliRunner().invoke(cli, ["bench", "run", "--workload", "single", "--preset", "tiny-qwen3-moe",
                                   "--random", "--engine", "reference", "--max-slots", "4"])  # fmt: skip
    assert res.exit_code == 2 and "--max-slots, --prefill-tokens" in res.output
