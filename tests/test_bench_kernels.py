"""The kernel benchmark harness on CPU: case registry, shapes, targets, table (timing needs a GPU)."""

import pytest
import torch

from batchinfer.bench.kernel_cases_gemm import _weights, linear_shapes
from batchinfer.bench.kernels import (
    L2_BYTES,
    KernelCase,
    Target,
    _target_met,
    bench_models,
    collect_cases,
    format_table,
    rotating_sets,
)

CEILINGS = {"op": "ceilings", "copy_bytes_per_s": 4.0e12, "bf16_flops_per_s": 800e12, "launch_s": 0.9e-6}


def test_rotating_sets_exceed_twice_l2():
    assert rotating_sets(1) == 256  # capped
    assert rotating_sets(10 * L2_BYTES) == 2
    n = rotating_sets(7 * 2**20)
    assert n * 7 * 2**20 >= 2 * L2_BYTES and (n - 1) * 7 * 2**20 < 2 * L2_BYTES


def test_model_shapes_match_the_published_configs():
    models = bench_models()
    q36 = dict((name, (n, k)) for name, n, k in linear_shapes(models["qwen3.6"]))
    assert q36["q_proj"] == (8192, 2048) and q36["o_proj"] == (2048, 4096)
    assert q36["in_proj_z"] == (4096, 2048) and q36["lm_head"] == (248320, 2048)
    assert "in_proj_qkv" not in q36  # same shape as q_proj, timed once
    q30 = dict((name, (n, k)) for name, n, k in linear_shapes(models["qwen3-30b"]))
    assert q30["q_proj"] == (4096, 2048) and q30["expert_gate_up"] == (768, 2048)
    assert q30["lm_head"] == (151936, 2048) and "in_proj_z" not in q30


def test_rotated_weights_are_distinct_for_both_formats():
    for kind in ("nvfp4", "fp8"):
        ws = _weights(kind, 16, 64, 3, torch.device("cpu"))
        deq = [w.dequantize() for w in ws]
        assert len(ws) == 3 and not torch.equal(deq[0], deq[1]) and deq[0].shape == (16, 64)


def test_collect_cases_covers_ops_models_and_m():
    cases = collect_cases(["qwen3.6", "qwen3-30b"], ms=(1, 4096))
    ops = ("nvfp4_gemm", "fp8_gemm", "fused_moe")
    ours = {(c.op, c.model) for c in cases if c.op in ops}
    assert ours == {(op, m) for op in ops for m in ("qwen3.6", "qwen3-30b")}
    moe = [c for c in cases if c.op == "fused_moe" and c.model == "qwen3.6"]
    assert [c.m for c in moe] == [1, 4096]
    assert moe[0].target == Target("bandwidth", 0.60) and moe[1].target is None
    lin = {c.m: c.target for c in cases if c.op == "nvfp4_gemm" and c.shape.startswith("q_proj")}
    assert lin[1] == Target("bandwidth", 0.70) and lin[4096] == Target("baseline:cublas_bf16", 0.70)
    rows_mm = collect_cases(["qwen3.6"], ms=(1, 8, 32, 128))  # decode batches of 2-64 only, FP8 shapes only
    assert {c.m for c in rows_mm if c.op == "fp8_rows_mm"} == {8, 32}
    shapes = {op: {c.shape for c in rows_mm if c.op == op} for op in ("fp8_rows_mm", "fp8_gemm")}
    assert shapes["fp8_rows_mm"] == shapes["fp8_gemm"]
    rows_tc = [c for c in rows_mm if c.op == "nvfp4_rows_tc"]  # 1-64 rows, NVFP4 linears but the experts
    assert {c.m for c in rows_tc} == {1, 8, 32}
    nvfp4 = {c.shape for c in rows_mm if c.op == "nvfp4_gemm"}
    assert {c.shape for c in rows_tc} == {s for s in nvfp4 if not s.startswith("expert")}
    assert any(s.startswith("lm_head") for s in nvfp4)
    emb = {(c.model, c.m, c.shape) for c in cases if c.op == "embedding"}
    assert emb == {
        (m, t, f"V={v} D=2048") for m, v in (("qwen3.6", 248320), ("qwen3-30b", 151936)) for t in (1, 4096)
    }


@pytest.mark.parametrize("m", [1, 5])
def test_rows_tc_case_computes_what_its_baselines_compute(m):
    """The `nvfp4_rows_tc` case's call and the kernel it stands beside (the one-row GEMV, or the fused
    GEMM) give the same product (a small weight, under the interpreter on CPU)."""
    from batchinfer.bench.kernel_cases_gemm import _linear_timed

    timed = _linear_timed("nvfp4", m, 64, 128, torch.device("cpu"), rows_tc=True)
    other = timed.baselines["nvfp4_gemv" if m == 1 else "nvfp4_gemm"]
    for i in (0, timed.n_sets - 1):
        ours, theirs = timed.run(i).float().clone(), other(i).float()
        assert (ours - theirs).norm() <= 1e-2 * theirs.norm()


def test_embedding_case_gathers_what_torch_gathers():
    """The embedding case's kernel call and its PyTorch baseline return the same rows (a small table)."""
    from types import SimpleNamespace

    from batchinfer.bench.kernel_cases_attn import _embedding

    timed = _embedding(7, SimpleNamespace(vocab_size=50, hidden_size=32), torch.device("cpu"))
    for i in (0, timed.n_sets - 1):
        assert torch.equal(timed.run(i), timed.baselines["torch"](i))


@pytest.mark.parametrize(
    ("target", "row", "met"),
    [
        (Target("bandwidth", 0.7), {"tb_s": 2.9}, True),
        (Target("bandwidth", 0.7), {"tb_s": 2.7}, False),
        (Target("flops", 0.5), {"tflop_s": 390.0}, False),
        (Target("baseline:cublas_bf16", 0.7), {"us": 140.0, "baselines_us": {"cublas_bf16": 100.0}}, True),
        (Target("baseline:cublas_bf16", 0.7), {"us": 150.0, "baselines_us": {"cublas_bf16": 100.0}}, False),
        (Target("baseline:x", 0.7), {"us": 1.0, "baselines_us": {"x": float("nan")}}, None),
    ],
)
def test_target_evaluation(target, row, met):
    case = KernelCase("op", "qwen3.6", "s", 1, build=lambda dev: None, target=target)
    assert _target_met(case, row, CEILINGS) is met


def test_format_table_marks_targets():
    row = {
        "op": "nvfp4_gemm",
        "model": "qwen3.6",
        "shape": "q_proj N=8192 K=2048",
        "m": 1,
        "us": 3.5,
        "tb_s": 2.69,
        "bw_frac": 0.67,
        "tflop_s": 0.01,
        "flop_frac": 0.0,
        "baselines_us": {"cublas_bf16": 10.5},
        "target": "bandwidth>=70%",
        "target_met": False,
    }
    text = format_table([CEILINGS, row])
    assert text.splitlines()[0] == "ceilings: copy 4.00 TB/s, bf16 GEMM 800 TFLOP/s, an empty launch 0.90 us"
    assert text.splitlines()[-1] == (
        "| nvfp4_gemm | qwen3.6 | q_proj N=8192 K=2048 | 1 | 3.5 | 2.69 | 67% | 0.0 | 0% | cublas_bf16 10.5 "
        "| bandwidth>=70%: NOT met |"
    )


def test_moe_paths_times_every_path_the_table_chooses_between(monkeypatch):
    """`tune_kernels --kinds moe_paths` plumbing on CPU (the timer is faked: timing needs a GPU): each
    path once, the table's choice beside them."""
    from batchinfer.kernels.moe import MoEDecodeConfig, MoEGroupedMMConfig
    from batchinfer.kernels.moe_direct import MoEDirectConfig
    from batchinfer.kernels.moe_tc import MoETCConfig

    from batchinfer.bench import tune_kernels

    seen = []

    def fake_timer(model, t, dev):
        def run(c):
            seen.append(c)
            return 1e-6 * len(seen)

        return run, t * 9, 257, 512

    monkeypatch.setattr(tune_kernels, "_moe_timer", fake_timer)
    r = tune_kernels.time_moe_paths("qwen3.6", 12, torch.device("cpu"))
    names = ["direct", "decode", "moe_tc16", "moe_tc32", "moe_tc64", "moe_tc128", "grouped_mm"]
    assert list(r["us"]) == names
    assert isinstance(seen[0], MoEDirectConfig) and isinstance(seen[1], MoEDecodeConfig)
    assert isinstance(seen[-1], MoEGroupedMMConfig)
    assert [c.block_m for c in seen[2:-1]] == [16, 32, 64, 128]
    assert all(isinstance(c, MoETCConfig) for c in seen[2:-1])
    assert r["entries"] == 108 and r["per_expert"] == pytest.approx(108 / 257)
    assert r["us"]["grouped_mm"] == pytest.approx(7.0)
    assert r["table"][0] in ("MoETCConfig", "MoEDecodeConfig")


def test_commit_id_prefers_the_environment(monkeypatch):
    """The device copy's `.git` can be stale: BATCHINFER_COMMIT wins; without it, git's short hash."""
    from batchinfer.bench import commit_id

    monkeypatch.setenv("BATCHINFER_COMMIT", "abc1234")
    assert commit_id() == "abc1234"
    monkeypatch.delenv("BATCHINFER_COMMIT")
    found = commit_id()
    assert found == "unknown" or (len(found) >= 7 and all(c in "0123456789abcdef" for c in found))


def test_cli_refuses_a_token_count_below_one():
    """Before the GPU check: a machine without CUDA answers it too (it built cases of 0 tokens)."""
    from click.testing import CliRunner

    from batchinfer.cli import cli

    res = CliRunner().invoke(cli, ["bench", "kernels", "--m", "8", "--m", "0"])
    assert res.exit_code == 2 and "Invalid value for '--m': 0 is not in the range x>=1." in res.output


def test_moe_direct_sweeps_gate_up_splits_then_down(monkeypatch):
    """`tune_kernels --kinds moe_direct` plumbing on CPU (the timer is faked): every gate_up tile and split
    with the first down tile, then the other down tiles with the best gate_up, then the best under each
    register cap; the table's config and the decode path beside them."""
    from batchinfer.kernels.moe import MoEDecodeConfig

    from batchinfer.bench import tune_kernels

    seen = []

    def fake_timer(model, t, dev):
        def run(c):
            seen.append(c)
            return 1e-6 * (len(seen) if isinstance(c, MoEDecodeConfig) or c.gate_up[-1] != 2 else 0.5)

        return run, t * 9, 257, 512

    monkeypatch.setattr(tune_kernels, "_moe_timer", fake_timer)
    r = tune_kernels.tune_moe_direct("qwen3.6", 1, torch.device("cpu"))
    sweeps = len(tune_kernels.MOE_DIRECT_GATE_UP) * len(tune_kernels.MOE_DIRECT_SPLITS)
    caps = len(tune_kernels.MOE_MAX_REGS)
    assert len(r["timings"]) == sweeps + len(tune_kernels.MOE_DIRECT_DOWN) - 1 + caps
    assert r["best"][0][-1] == 2 and r["entries"] == 9  # a split-2 config timed fastest
    capped = [c for c, _ in r["timings"][-caps:]]  # the best tiles, capped
    assert [c[-1] for c in capped] == list(tune_kernels.MOE_MAX_REGS)
    assert {c[:2] for c in capped} == {r["best"][:2]}
    assert isinstance(seen[-1], MoEDecodeConfig) and r["decode_us"] == pytest.approx(len(seen))
