"""Kernel microbenchmarks: our Triton kernels against PyTorch baselines and measured H200 ceilings.

Timing: each case allocates enough rotating input sets that together they exceed twice the L2, one
CUDA graph replays one call per set (so launch gaps stay out, as in the engine's decode graphs), and
the median over many replays, divided by the number of sets, is the time per call. Ceilings are
measured in the same run: device-to-device copy bandwidth (bytes read + written), cuBLAS bf16 GEMM
at 8192^3 on random data, and one empty launch as the decode kernels are launched (`stream_read` of 0
bytes); decode-size cases also time `stream_read` of their weight bytes as a baseline, what a launch
that only reads those bytes takes here.

Adding cases (the registration API): a case module holds functions decorated with `@register`; each
takes `(model_name, config, ms)` and yields `KernelCase`s. A case's `build(device)` allocates its
inputs on the GPU and returns a `Timed`: `run(i)` does one call on input set `i`, `baselines` maps a
name to a callable of the same form, `bytes`/`flops` are the fewest bytes one call must move and its
floating-point operations. `target` marks the points where issue 5 sets a floor. Case modules are
listed in `CASE_MODULES`; `rotating_sets(bytes_per_set)` says how many input sets to allocate.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import logging
import math
import statistics
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from batchinfer.bench import commit_id
from batchinfer.bench.stream_read import stream_read_baseline
from batchinfer.models.config import ModelConfig

log = logging.getLogger(__name__)

CASE_MODULES = ("batchinfer.bench.kernel_cases_gemm", "batchinfer.bench.kernel_cases_attn")
M_VALUES = (1, 8, 32, 128, 512, 4096)
L2_BYTES = 60 * 2**20  # H200; rotating inputs cover at least twice this

# The two benchmarked architectures, with the fields of their published config.json files.
_QWEN36 = {
    "model_type": "qwen3_5_moe",
    "text_config": {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": 248320,
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "full_attention_interval": 4,
        "rope_parameters": {"rope_theta": 10000000, "partial_rotary_factor": 0.25, "rope_type": "default"},
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "max_position_embeddings": 262144,
        "eos_token_id": 248044,
    },
}
_QWEN3_30B = {
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "rope_theta": 1000000.0,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "max_position_embeddings": 40960,
    "eos_token_id": 151645,
}


def bench_models() -> dict[str, ModelConfig]:
    """Benchmark model name -> config (the names `batchinfer bench kernels --model` accepts)."""
    return {
        "qwen3.6": ModelConfig.from_hf(_QWEN36, source="qwen3.6 preset"),
        "qwen3-30b": ModelConfig.from_hf(_QWEN3_30B, source="qwen3-30b preset"),
    }


@dataclass(frozen=True, slots=True)
class Target:
    """An issue-5 floor: `metric` is "bandwidth" (of measured copy bandwidth), "flops" (of the
    measured bf16 GEMM ceiling) or "baseline:<name>" (speed relative to that baseline's time)."""

    metric: str
    fraction: float


@dataclass(slots=True)
class Timed:
    """One benchmark point on the GPU; see the module docstring."""

    run: Callable[[int], Any]
    n_sets: int
    bytes: int
    flops: int
    baselines: dict[str, Callable[[int], Any]] = field(default_factory=dict)
    eager: frozenset[str] = frozenset()  # baselines that sync with the host: timed without a CUDA graph


@dataclass(frozen=True, slots=True)
class KernelCase:
    op: str  # kernel name, e.g. "nvfp4_gemm"
    model: str  # key of bench_models()
    shape: str  # human description, e.g. "q_proj N=8192 K=2048"
    m: int  # tokens (rows) per call
    build: Callable[[torch.device], Timed]
    target: Target | None = None


CaseFactory = Callable[[str, ModelConfig, Sequence[int]], Iterable[KernelCase]]
_FACTORIES: list[CaseFactory] = []


def register(factory: CaseFactory) -> CaseFactory:
    """Decorator: add a case factory (called once per benchmarked model)."""
    _FACTORIES.append(factory)
    return factory


def rotating_sets(bytes_per_set: int, cap: int = 256) -> int:
    """How many input sets to rotate through so that together they exceed twice the L2."""
    return max(2, min(cap, math.ceil(2 * L2_BYTES / max(bytes_per_set, 1))))


def collect_cases(models: Sequence[str], ms: Sequence[int] = M_VALUES) -> list[KernelCase]:
    for name in CASE_MODULES:
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)
    configs = bench_models()
    return [case for model in models for factory in _FACTORIES for case in factory(model, configs[model], ms)]


def time_per_call(fn: Callable[[int], Any], n_sets: int, budget_s: float = 0.3, graph: bool = True) -> float:
    """Median seconds per call over replays of `n_sets` calls: one CUDA graph, or eager if `graph` is
    False (code that syncs with the host cannot be captured)."""
    for i in range(n_sets):  # warm-up: compiles, allocates workspaces outside the graph
        fn(i)
    torch.cuda.synchronize()

    def replay() -> None:
        for i in range(n_sets):
            fn(i)

    if graph:
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            replay()
        replay = cuda_graph.replay

    replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    replay()
    end.record()
    end.synchronize()
    reps = max(5, min(200, int(budget_s * 1e3 / max(start.elapsed_time(end), 1e-3))))
    times = []
    for _ in range(reps):
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times) / n_sets


def measure_ceilings(device: torch.device) -> dict[str, float]:
    """Copy bandwidth (bytes/s, read + write), cuBLAS bf16 GEMM (flop/s) and one empty PDL launch in a
    CUDA graph (s) on this GPU, now."""
    src = torch.randn(2**29, device=device, dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    # Eager: a captured copy becomes a graph memcpy node, which measured 2.7 TB/s on the H200 against
    # 4.2-4.3 TB/s for the eager copy kernel.
    t_copy = time_per_call(lambda i: dst.copy_(src), 1, budget_s=0.5, graph=False)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t_mm = time_per_call(lambda i: a @ b, 1, budget_s=1.0, graph=False)
    t_launch = time_per_call(stream_read_baseline(0, 1, device), 256, budget_s=0.2)
    return {
        "copy_bytes_per_s": 2 * 2**30 / t_copy,
        "bf16_flops_per_s": 2 * 8192**3 / t_mm,
        "launch_s": t_launch,
    }


def _target_met(case: KernelCase, row: dict[str, Any], ceilings: dict[str, float]) -> bool | None:
    t = case.target
    if t is None:
        return None
    if t.metric == "bandwidth":
        return row["tb_s"] * 1e12 >= t.fraction * ceilings["copy_bytes_per_s"]
    if t.metric == "flops":
        return row["tflop_s"] * 1e12 >= t.fraction * ceilings["bf16_flops_per_s"]
    base = row["baselines_us"][t.metric.removeprefix("baseline:")]
    return None if math.isnan(base) else row["us"] <= base / t.fraction


def run_cases(cases: Sequence[KernelCase], device: torch.device) -> Iterator[dict[str, Any]]:
    """Time each case and its baselines; yields one result row per case (build errors are logged)."""
    ceilings = measure_ceilings(device)
    log.info(
        "ceilings: copy %.2f TB/s, bf16 GEMM %.0f TFLOP/s, an empty launch %.2f us",
        ceilings["copy_bytes_per_s"] / 1e12,
        ceilings["bf16_flops_per_s"] / 1e12,
        ceilings["launch_s"] * 1e6,
    )
    yield {"op": "ceilings", **ceilings}
    for case in cases:
        try:
            yield _run_case(case, device, ceilings)
        except Exception as e:  # one broken case (e.g. a baseline this torch lacks) must not end the run
            log.error("%s %s %s M=%d failed: %s", case.op, case.model, case.shape, case.m, e)
        torch.cuda.empty_cache()


def _time_baseline(case: KernelCase, name: str, fn: Callable[[int], Any], timed: Timed) -> float:
    """Microseconds per call of one baseline; NaN (and a logged error) if it cannot run here."""
    try:
        return time_per_call(fn, timed.n_sets, budget_s=0.05, graph=name not in timed.eager) * 1e6
    except Exception as e:
        log.error("%s %s %s M=%d baseline %s failed: %s", case.op, case.model, case.shape, case.m, name, e)
        torch.cuda.synchronize()
        return math.nan


def _run_case(case: KernelCase, device: torch.device, ceilings: dict[str, float]) -> dict[str, Any]:
    timed = case.build(device)
    sec = time_per_call(timed.run, timed.n_sets, budget_s=0.1)
    row: dict[str, Any] = {
        "op": case.op,
        "model": case.model,
        "shape": case.shape,
        "m": case.m,
        "us": sec * 1e6,
        "tb_s": timed.bytes / sec / 1e12,
        "tflop_s": timed.flops / sec / 1e12,
        "bw_frac": timed.bytes / sec / ceilings["copy_bytes_per_s"],
        "flop_frac": timed.flops / sec / ceilings["bf16_flops_per_s"],
        "baselines_us": {k: _time_baseline(case, k, f, timed) for k, f in timed.baselines.items()},
        "target": None if case.target is None else f"{case.target.metric}>={case.target.fraction:.0%}",
    }
    row["target_met"] = _target_met(case, row, ceilings)
    return row


def environment() -> dict[str, str]:
    """What a result table needs beside it: GPU, versions, commit, date."""
    import triton

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit_id(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown table of result rows (the ceilings row becomes a header line)."""
    lines = []
    for row in rows:
        if row["op"] == "ceilings":
            lines += [
                f"ceilings: copy {row['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
                f"bf16 GEMM {row['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s, "
                f"an empty launch {row['launch_s'] * 1e6:.2f} us",
                "",
                "| op | model | shape | M | us | TB/s | %copy | TFLOP/s | %gemm | baselines (us) | target |",
                "|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            continue
        base = ", ".join(f"{k} {v:.1f}" for k, v in row["baselines_us"].items())
        verdict = {True: "met", False: "NOT met", None: "unknown (baseline failed)"}[row["target_met"]]
        met = "" if row["target"] is None else f"{row['target']}: {verdict}"
        lines.append(
            f"| {row['op']} | {row['model']} | {row['shape']} | {row['m']} | {row['us']:.1f} "
            f"| {row['tb_s']:.2f} | {row['bw_frac']:.0%} | {row['tflop_s']:.1f} | {row['flop_frac']:.0%} "
            f"| {base} | {met} |"
        )
    return "\n".join(lines)
