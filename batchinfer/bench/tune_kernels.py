"""Offline tuner for the GEMM config tables: times candidate configs per M bucket on the GPU.

Run on the H200 (`python -m batchinfer.bench.tune_kernels --out tune.json --kinds nvfp4,nvfp4_gemv,
nvfp4_rows_tc,fp8,fp8_gemv,fp8_rows_mm,moe,moe_decode,moe_direct,moe_tc,moe_paths`, without the line
break); the winners go by hand into `_nvfp4_gemm_configs` / `gemv_config` / `rows_tc_config` /
`fp8_gemv_config` / `fp8_rows_mm_config` / `_fp8_gemm_configs` /
`_moe_configs` / `moe_direct.direct_config` (and the boundaries `DIRECT_MAX_ENTRIES`, `DECODE_MAX_ENTRIES`,
`TC_GROUPED_MM_MIN_PER_EXPERT`). Logs one line per (kernel, shape, M) with the best
config next to the current table's choice (and, for the linears, cuBLAS bf16 on the same shape; for the MoE
decode path, the grouped GEMMs at the same T; for the direct path, the decode path; for `moe_tc`, whatever
the table runs at that T). `moe_paths` sweeps nothing: it times each MoE path once per T, the crossovers the
boundaries come from.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import logging
from collections.abc import Callable

import torch

from batchinfer.bench.kernel_cases_gemm import _weights, moe_layer
from batchinfer.bench.kernels import bench_models, rotating_sets, time_per_call
from batchinfer.kernels.fp8_gemm import _fp8_gemm_configs, fp8_gemm, fp8_gemv, fp8_gemv_config, stack_fp8
from batchinfer.kernels.fp8_rows_mm import RowsMMConfig, fp8_rows_mm, fp8_rows_mm_config
from batchinfer.kernels.moe import (
    DECODE_MAX_ENTRIES,
    MoEConfig,
    MoEDecodeConfig,
    MoEGroupedMMConfig,
    MoEPath,
    _decode_config,
    _moe_configs,
    moe_experts,
    moe_route,
    tc_config,
)
from batchinfer.kernels.moe_direct import MoEDirectConfig, direct_config
from batchinfer.kernels.moe_tc import MoETCConfig, pair_moe_weights
from batchinfer.kernels.nvfp4_gemm import (
    GemmConfig,
    GemvConfig,
    _nvfp4_gemm_configs,
    gemv_config,
    nvfp4_gemm,
    nvfp4_gemv,
    stack_nvfp4,
)
from batchinfer.kernels.nvfp4_rows_tc import RowsTCConfig, nvfp4_rows_tc, pair_nvfp4_rows, rows_tc_config

log = logging.getLogger(__name__)

SHAPES = [(8192, 2048), (2048, 4096), (512, 2048), (2048, 512), (16384, 2048)]
MS = [1, 16]  # above FUSED_MAX_M the launchers dequantize and call cuBLAS


def candidates(m: int) -> list[GemmConfig]:
    if m <= 16:
        tiles = [(16, 32, 256), (16, 64, 256), (16, 64, 128), (16, 128, 128), (16, 32, 512)]
        return [GemmConfig(*t, 0, 4, s, eo) for t in tiles for s in (3, 5) for eo in (False, True)]
    if m <= 64:
        tiles = [(32, 64, 128), (64, 64, 128), (32, 128, 128), (64, 128, 128), (64, 64, 256), (32, 64, 256)]
        return [GemmConfig(*t, 0, 4, 4) for t in tiles]
    if m <= 256:
        grid = itertools.product((64, 128), (64, 128), (0, 1), (4, 8))
        return [GemmConfig(bm, 128, bk, sk, w, 3) for bm, bk, sk, w in grid]
    tiles = [(128, 128, 64), (128, 256, 64), (128, 128, 128), (64, 128, 64), (128, 64, 128)]
    return [GemmConfig(*t, 1, w, s) for t in tiles for w in (4, 8) for s in (3, 4)]


def tune_point(
    gemm: Callable, table: Callable, ws: list, wb: list, m: int, cands: list | None = None
) -> dict:
    """Time the table's config, every candidate (`candidates(m)` by default) and cuBLAS bf16 for one
    (shape, M)."""
    sets, (n, k) = len(ws), wb[0].shape
    xs = [torch.randn(m, k, device=wb[0].device, dtype=torch.bfloat16) for _ in range(sets)]
    cublas = time_per_call(lambda i: xs[i] @ wb[i].t(), sets, budget_s=0.05)
    timings = {}
    for cfg in dict.fromkeys([table(m, n), *(candidates(m) if cands is None else cands)]):
        try:
            run = lambda i, c=cfg: gemm(xs[i], ws[i], config=c)
            timings[cfg] = time_per_call(run, sets, budget_s=0.05)
        except Exception as e:  # a config that does not fit (shared memory, registers) is skipped
            log.warning("%s: %s", cfg, str(e).splitlines()[0][:120] if str(e) else type(e).__name__)
    best = min(timings, key=timings.get)
    return {
        "best": dataclasses.astuple(best),
        "best_us": timings[best] * 1e6,
        "table_us": timings.get(table(m, n), float("nan")) * 1e6,
        "cublas_us": cublas * 1e6,
        "timings": [[dataclasses.astuple(c), t * 1e6] for c, t in timings.items()],
    }


# The one-row NVFP4 GEMV (`nvfp4_gemv` kind) on the engine's group-major rows: the linears above and both
# models' lm_head, (BLOCK_N, BLOCK_G, num_warps, SPLIT_K 0 (from the CTA count), num_stages). A thread
# holds BLOCK_N * BLOCK_G / (32 * warps) 16-code groups (rows along the threads: an x element serves
# several rows).
GEMV_SHAPES = SHAPES + [(248320, 2048), (151936, 2048)]
GEMV_CANDIDATES = [
    GemvConfig(bn, bg, w, 0, s)
    for bn, bg, w, s in itertools.product((64, 128, 256, 512), (2, 4, 8, 16), (4, 8), (1, 3))
    if 4 <= bn * bg // (32 * w) <= 16
]

# The one-row FP8 GEMV (`fp8_gemv` kind) on stacked rows, Qwen3.6's mixed layout: q|k|v, DeltaNet qkv|z,
# o_proj / out_proj; BLOCK_G 16 columns of K a group. Bytes a thread loads a step: BLOCK_N * 16 * BLOCK_G /
# (32 * warps).
FP8_GEMV_SHAPES = [(9216, 2048), (12288, 2048), (2048, 4096)]
FP8_GEMV_CANDIDATES = [
    GemvConfig(bn, bg, w, 0, s)
    for bn, bg, w, s in itertools.product((8, 16, 32, 64), (8, 16, 32), (2, 4, 8), (1, 3))
    if 16 <= bn * 16 * bg // (32 * w) <= 128
]

# `nvfp4_rows_tc` kind (NVFP4 for 1-64 rows on the tensor cores, the engine's paired rows): both models'
# lm_head, Qwen3-30B's q|k|v and o_proj (all-NVFP4); (BLOCK_N, warps, stages, STEPS, SPLIT (0: from the CTA
# count)), 128 rows on 8 warps being two warpgroups. Beside it cuBLAS on the bf16 weight (the engine's path
# from two rows up before this kernel); the one-row GEMV is in `bench kernels --op nvfp4_rows_tc`.
ROWS_TC_SHAPES = [(248320, 2048), (151936, 2048), (5120, 2048), (2048, 4096)]
ROWS_TC_MS = [1, 8, 32]
ROWS_TC_CANDIDATES = [
    RowsTCConfig(bn, w, stages, steps, split)
    for (bn, w), stages, steps, split in itertools.product(((64, 4), (128, 8)), (3, 4), (2, 4), (0, 1, 2))
]

# `fp8_rows_mm` kind (FP8 for 2-64 rows on the tensor cores, the engine's stacked FP8 rows; untuned since
# session 14, when its one config lost to cuBLAS on the bf16 copies): Qwen3.6's stacked FP8 projections,
# (BLOCK_N, BLOCK_K, SPLIT_K (0: from the CTA count), warps, stages). Its shared memory (weight and x tiles
# a stage) sets the programs an SM: the untuned 64 x 128 on 4 stages fits two.
ROWS_MM_MS = [8, 32]
ROWS_MM_CANDIDATES = [
    RowsMMConfig(bn, bk, split, w, stages)
    for (bn, w), bk, split, stages in itertools.product(((64, 4), (128, 8)), (64, 128), (0, 1), (2, 3, 4))
]

MOE_TOKENS = [1, 8, 32, 128, 512, 4096]
MOE_TILES = [
    (32, 128, 4, 4),
    (64, 128, 4, 4),
    (32, 256, 4, 4),
    (64, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 128, 8, 3),
]


MOE_DECODE_TOKENS = [1, 8, 16, 32, 64]
# (BLOCK_N, BLOCK_G, num_warps, SPLIT) of the decode path's kernels; the first of each is the start.
# Session 10's sweep (docs/PERF.md) found (16, 16, 2, 4) / (32, 32, 2, 9) at 1 token and (32, 16, 2, 4) /
# (64, 16, 2, 3) at 8, still 0.8 TB/s at one token. Session 26 (H100, ncu): the one-token gate_up ran 8 warps
# an SM at 21% of DRAM bandwidth; more K splits of 8-group steps (more programs) gave 8%.
MOE_DECODE_GATE_UP = [
    (16, 16, 2, 4),
    (32, 16, 2, 4),
    (16, 32, 2, 4),
    (16, 32, 4, 4),
    (8, 32, 4, 4),
    (16, 64, 4, 2),
    (8, 64, 4, 2),
    (4, 64, 2, 2),
    (8, 128, 4, 1),
    (4, 128, 4, 1),
    (4, 128, 2, 1),
    (32, 16, 2, 8),
    (64, 16, 2, 8),
    (64, 16, 4, 4),
    (32, 32, 4, 4),
    (32, 8, 2, 8),  # session 26 (H100): the one-token table entry, 8% under (32, 16, 2, 4)
    (64, 8, 4, 8),
    (16, 8, 2, 16),
    (16, 8, 2, 8),  # 72 registers on sm_90 since the step's loads all go first (128 at (32, 8, 2, 8))
    (32, 8, 4, 8),
    (16, 16, 2, 8),
    (16, 16, 4, 8),
]
MOE_DECODE_DOWN = [
    (32, 32, 2, 9),
    (64, 16, 2, 3),
    (32, 32, 4, 3),
    (32, 32, 4, 9),
    (16, 32, 2, 9),
    (16, 32, 4, 9),
    (64, 32, 4, 3),
    (32, 16, 4, 3),
    (8, 32, 2, 9),
]


def _moe_timer(model: str, t: int, dev: torch.device) -> tuple[Callable, int, int, int]:
    """(time of `moe_experts` under a config, entries, experts, intermediate size) on one layer with 8
    rotating inputs; every path but the fused grouped GEMMs (`MoEConfig`, standard layout) runs on the
    same experts in `moe_tc`'s paired layout, as the engine loads them."""
    cfg = bench_models()[model]
    w = moe_layer(cfg, dev)
    paired = functools.cache(lambda: pair_moe_weights(w))  # a second copy of the experts
    hs = [torch.randn(t, cfg.hidden_size, device=dev, dtype=torch.bfloat16) for _ in range(8)]
    shared = cfg.shared_expert_intermediate_size > 0
    routes = [moe_route(h @ w.router.t(), cfg.num_experts, cfg.num_experts_per_tok, True, shared) for h in hs]

    def run(c: MoEPath) -> float:
        ws = w if isinstance(c, MoEConfig) else paired()
        return time_per_call(lambda i: moe_experts(hs[i], *routes[i], ws, config=c), len(hs), budget_s=0.05)

    return run, routes[0][0].numel(), w.w13.shape[0], w.intermediate


def tune_moe(model: str, t: int, dev: torch.device) -> dict:
    """Gate_up tiles with the table's down tiles, then down tiles with the best gate_up, per BLOCK_M; beside
    them the grouped-GEMM path (experts decoded to bf16, `torch._grouped_mm`), for GROUPED_MM_MIN_ENTRIES."""
    run, numel, experts, _ = _moe_timer(model, t, dev)
    table = _moe_configs(numel, experts)
    if not isinstance(table, MoEConfig):  # decode path or grouped_mm's T: tune from the first guess
        table = MoEConfig(16, (64, 128, 4, 4), (64, 128, 4, 4))
    timings = {table: run(table)}
    for bm in (16, 32, 64, 128):
        best = table
        for tiles in MOE_TILES:
            c = MoEConfig(bm, tiles, table.down)
            timings[c] = run(c)
            best = c if timings[c] < timings.get(best, float("inf")) else best
        for tiles in MOE_TILES:
            c = MoEConfig(bm, best.gate_up, tiles)
            timings[c] = run(c)
    best = min(timings, key=timings.get)
    return {
        "kind": "moe",
        "model": model,
        "t": t,
        "best": dataclasses.astuple(best),
        "best_us": timings[best] * 1e6,
        "table_us": timings[table] * 1e6,
        "grouped_mm_us": run(MoEGroupedMMConfig()) * 1e6,
    }


def _skipping_failures(timer: Callable[[MoEPath], float]) -> Callable[[MoEPath], float]:
    """`timer` that logs a config which does not fit (registers, shared memory) and times it as inf."""

    def run(c: MoEPath) -> float:
        try:
            return timer(c)
        except Exception as e:
            log.warning("%s: %s", c, str(e).splitlines()[0][:120] if str(e) else type(e).__name__)
            return float("inf")

    return run


def tune_moe_decode(model: str, t: int, dev: torch.device) -> dict:
    """The decode path: gate_up configs with the first down config, then down configs with the best
    gate_up; beside it the grouped GEMMs under their table config at the same T (where
    DECODE_MAX_ENTRIES goes)."""
    timer, numel, experts, _ = _moe_timer(model, t, dev)
    run = _skipping_failures(timer)

    timings = {}
    for tiles in MOE_DECODE_GATE_UP:
        c = MoEDecodeConfig(tiles, MOE_DECODE_DOWN[0])
        timings[c] = run(c)
    gate_up = min(timings, key=timings.get).gate_up
    for tiles in MOE_DECODE_DOWN:
        c = MoEDecodeConfig(gate_up, tiles)
        timings[c] = timings[c] if c in timings else run(c)
    best = min(timings, key=timings.get)
    grouped = _moe_configs(numel, experts, nvfp4=False)  # the grouped table's choice at this size
    return {
        "kind": "moe_decode",
        "model": model,
        "t": t,
        "entries": numel,
        "best": dataclasses.astuple(best),
        "best_us": timings[best] * 1e6,
        "grouped": dataclasses.astuple(grouped),
        "grouped_us": run(grouped) * 1e6,
        "timings": [[dataclasses.astuple(c), v * 1e6] for c, v in timings.items()],
    }


# Tensor-core MoE (`moe_tc`): BLOCK_M (tokens a tile), then (BLOCK_N, warps, stages, STEPS) per GEMM. BLOCK_N
# 64 a warpgroup (the sm_90 TTGIR keeps the decoded weight in registers for 64 rows on 4 warps, 128 on 8);
# STEPS (1, 2 or 4) 32-code blocks an iteration (session 8, H200: 4 is fastest at BLOCK_M 16 and 32, 2 at 64;
# kernels/moe.py TC_TILES).
# Since 9a67b08 an iteration is one dot (its wgmmas pipelined): 128 rows on 8 warps at STEPS 4 compile
# without spills too (124 registers at BLOCK_M 16, 152 at 32; sm_90).
# fmt: off
MOE_TC_TILES = [(64, 4, 3, 2), (64, 4, 3, 1), (64, 4, 3, 4), (64, 4, 2, 4), (64, 4, 4, 2), (64, 4, 2, 2),
                (128, 8, 3, 2), (128, 8, 3, 1), (128, 8, 3, 4), (128, 8, 2, 4)]
# fmt: on
# BLOCK_M 128 (a wgmma N of 128: each decoded code serves twice the tokens of 64) for prefill sizes, where
# grouped_mm still wins; sm_90 compile: no spills (gate_up 254 registers at 4 warps, 242 at 8).
MOE_TC_BLOCK_M = (16, 32, 64, 128)
MOE_TC_TOKENS = [1, 8, 32, 128, 256, 512, 1024, 2048]


# Register caps a thread (`max_regs`) tried on the best tiles of `moe_tc` and the direct path: uncapped their
# gate_up kernels take ~120 registers, 4 programs an SM; 96 and 80 compile to 80-82 and 70-72 with no spill,
# 5-6 and 7 an SM (sm_90, session 29), where ncu saw `moe_tc`'s gate_up at 32 tokens stall on memory half
# its cycles at 25% occupancy. Session 30 (H100, the table's configs): `moe_tc` no faster capped (1-10%
# slower, BLOCK_M 64 spills at 80); the direct path's Qwen3-30B layer at one token 20% faster at 80, now its
# config.
MOE_MAX_REGS = (96, 80)


def _sweep_max_regs(timings: dict, run: Callable) -> None:
    """Time the fastest config so far under each of MOE_MAX_REGS, into `timings`."""
    best = min(timings, key=timings.get)
    for regs in MOE_MAX_REGS:
        c = dataclasses.replace(best, max_regs=regs)
        timings[c] = run(c)


def tune_moe_tc(model: str, t: int, dev: torch.device) -> dict:
    """`moe_tc`'s kernels: gate_up tiles with the first down tile, then down tiles with the best gate_up,
    per BLOCK_M; beside them the path the table takes at this T (decode path, fused grouped GEMMs or
    grouped_mm)."""
    timer, numel, experts, _ = _moe_timer(model, t, dev)
    run = _skipping_failures(timer)

    timings: dict[MoEPath, float] = {}
    for bm in MOE_TC_BLOCK_M:
        sweep = {MoETCConfig(bm, tiles, MOE_TC_TILES[0]): 0.0 for tiles in MOE_TC_TILES}
        for c in sweep:
            sweep[c] = timings[c] = run(c)
        gate_up = min(sweep, key=sweep.get).gate_up
        for tiles in MOE_TC_TILES:
            c = MoETCConfig(bm, gate_up, tiles)
            timings[c] = timings[c] if c in timings else run(c)
    _sweep_max_regs(timings, run)
    best = min(timings, key=timings.get)
    table = _moe_configs(numel, experts, paired=True)  # the engine's choice (paired experts)
    return {
        "kind": "moe_tc",
        "model": model,
        "t": t,
        "entries": numel,
        "best": dataclasses.astuple(best),
        "best_us": timings[best] * 1e6,
        "table": [type(table).__name__, dataclasses.astuple(table)],
        "table_us": run(table) * 1e6,
        "timings": [[dataclasses.astuple(c), v * 1e6] for c, v in timings.items()],
    }


# The direct path (`moe_direct`): gate_up (BLOCK_N, warps, stages, STEPS) with SPLIT K splits, down's
# tiles (one program a slot). H100, session 28: 64 rows on 4 warps, 3 stages, STEPS 4, 4 splits best or
# within 1 us at 1-4 tokens on both models.
MOE_DIRECT_GATE_UP = [(64, 4, 3, 4), (64, 4, 4, 4), (64, 4, 2, 4), (64, 4, 3, 2), (64, 4, 4, 2),
                      (128, 8, 3, 4)]  # fmt: skip
MOE_DIRECT_SPLITS = [1, 2, 4, 8]
MOE_DIRECT_DOWN = [(64, 4, 3, 4), (64, 4, 2, 4), (64, 4, 3, 2), (128, 8, 3, 4)]
MOE_DIRECT_TOKENS = [1, 2, 4]


def tune_moe_direct(model: str, t: int, dev: torch.device) -> dict:
    """The direct path: gate_up tiles and splits with the first down tile, then down tiles with the best
    gate_up; beside it the decode path under its table config at the same T."""
    timer, numel, _, _ = _moe_timer(model, t, dev)
    run = _skipping_failures(timer)
    timings: dict[MoEPath, float] = {}
    for tiles, split in itertools.product(MOE_DIRECT_GATE_UP, MOE_DIRECT_SPLITS):
        c = MoEDirectConfig((*tiles, split), MOE_DIRECT_DOWN[0])
        timings[c] = run(c)
    gate_up = min(timings, key=timings.get).gate_up
    for tiles in MOE_DIRECT_DOWN[1:]:
        c = MoEDirectConfig(gate_up, tiles)
        timings[c] = run(c)
    _sweep_max_regs(timings, run)
    best = min(timings, key=timings.get)
    table = direct_config()
    return {
        "kind": "moe_direct",
        "model": model,
        "t": t,
        "entries": numel,
        "best": dataclasses.astuple(best),
        "best_us": timings[best] * 1e6,
        "table_us": timings[table] * 1e6 if table in timings else run(table) * 1e6,
        "decode_us": run(_decode_config(numel)) * 1e6,
        "timings": [[dataclasses.astuple(c), v * 1e6] for c, v in timings.items()],
    }


MOE_PATHS_TOKENS = [1, 2, 4, 8, 12, 16, 24, 32, 2048, 3072, 4096, 6144]


def time_moe_paths(model: str, t: int, dev: torch.device) -> dict:
    """Every path the engine's table chooses between at this T, on paired experts, nothing swept: the
    direct and decode paths under their table configs (up to DECODE_MAX_ENTRIES; the engine's table no
    longer takes the decode path for paired experts, timed here to keep that checked), `moe_tc` at each
    BLOCK_M with the table's tiles, grouped_mm; the crossovers behind DIRECT_MAX_ENTRIES and
    TC_GROUPED_MM_MIN_PER_EXPERT."""
    timer, numel, experts, _ = _moe_timer(model, t, dev)
    run = _skipping_failures(timer)
    paths: dict[str, MoEPath] = {}
    if numel <= DECODE_MAX_ENTRIES:
        paths = {"direct": direct_config(), "decode": _decode_config(numel)}
    for bm in MOE_TC_BLOCK_M:
        paths[f"moe_tc{bm}"] = tc_config(bm)
    paths["grouped_mm"] = MoEGroupedMMConfig()
    table = _moe_configs(numel, experts, paired=True)
    return {
        "kind": "moe_paths",
        "model": model,
        "t": t,
        "entries": numel,
        "per_expert": numel / experts,
        "us": {name: run(c) * 1e6 for name, c in paths.items()},
        "table": [type(table).__name__, dataclasses.astuple(table)],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--kinds", default="nvfp4,fp8")
    ap.add_argument("--shapes", type=int, help="only the first N shapes of each kind [default: all]")
    ap.add_argument("--tokens", help="MoE token counts, comma-separated [default: per kind]")
    ap.add_argument("--models", default=",".join(bench_models()), help="MoE models, comma-separated")
    args = ap.parse_args()
    unknown = set(args.models.split(",")) - set(bench_models())
    if unknown:
        ap.error(f"--models: unknown {sorted(unknown)}; expected some of {sorted(bench_models())}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dev = torch.device("cuda")
    results = []
    for kind in args.kinds.split(","):
        if kind in ("moe", "moe_decode", "moe_direct", "moe_tc", "moe_paths"):
            tune, tokens = {
                "moe": (tune_moe, MOE_TOKENS),
                "moe_decode": (tune_moe_decode, MOE_DECODE_TOKENS),
                "moe_direct": (tune_moe_direct, MOE_DIRECT_TOKENS),
                "moe_tc": (tune_moe_tc, MOE_TC_TOKENS),
                "moe_paths": (time_moe_paths, MOE_PATHS_TOKENS),
            }[kind]
            tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else tokens
            for model in args.models.split(","):
                for t in tokens:
                    r = tune(model, t, dev)
                    if kind == "moe_paths":
                        times = ", ".join(f"{name} {us:.1f}" for name, us in r["us"].items())
                        log.info(
                            "moe_paths %s T=%d (%.2f an expert): %s us; table %s",
                            model,
                            t,
                            r["per_expert"],
                            times,
                            r["table"][0],
                        )
                        results.append(r)
                        _dump(args.out, results)
                        continue
                    if kind == "moe_decode":
                        other = f"grouped {r['grouped_us']:.1f} us"
                    elif kind == "moe_direct":
                        other = f"table {r['table_us']:.1f} us; decode path {r['decode_us']:.1f} us"
                    elif kind == "moe":
                        other = f"table {r['table_us']:.1f} us; grouped_mm {r['grouped_mm_us']:.1f} us"
                    else:
                        other = f"table ({r['table'][0]}) {r['table_us']:.1f} us"
                    log.info(
                        "%s %s T=%d: best %s %.1f us; %s", kind, model, t, r["best"], r["best_us"], other
                    )
                    results.append(r)
                    _dump(args.out, results)
            continue
        fp8 = kind in ("fp8", "fp8_gemv", "fp8_rows_mm")
        gemm, table = (fp8_gemm, _fp8_gemm_configs) if fp8 else (nvfp4_gemm, _nvfp4_gemm_configs)
        cands, shapes, stack, ms = None, SHAPES, None, MS
        if kind == "nvfp4_gemv":  # the engine's group-major rows
            table, cands, shapes, ms = (lambda m, n: gemv_config(True, n)), GEMV_CANDIDATES, GEMV_SHAPES, [1]
            gemm, stack = (lambda x, w, config: nvfp4_gemv(x, w, config=config)), stack_nvfp4
        if kind == "fp8_gemv":  # the engine's stacked rows
            table, shapes, ms = (lambda m, n: fp8_gemv_config()), FP8_GEMV_SHAPES, [1]
            cands = FP8_GEMV_CANDIDATES
            gemm, stack = (lambda x, w, config: fp8_gemv(x, w, config=config)), stack_fp8
        if kind == "nvfp4_rows_tc":  # the engine's paired rows, a decode batch on the tensor cores
            table, shapes, ms = (lambda m, n: rows_tc_config()), ROWS_TC_SHAPES, ROWS_TC_MS
            cands = ROWS_TC_CANDIDATES
            gemm, stack = (lambda x, w, config: nvfp4_rows_tc(x, w, config=config)), pair_nvfp4_rows
        if kind == "fp8_rows_mm":  # the engine's stacked FP8 rows, a decode batch on the tensor cores
            table, shapes, ms = (lambda m, n: fp8_rows_mm_config()), FP8_GEMV_SHAPES, ROWS_MM_MS
            cands = ROWS_MM_CANDIDATES
            gemm, stack = (lambda x, w, config: fp8_rows_mm(x, w, config=config)), stack_fp8
        for n, k in shapes[: args.shapes]:
            wbytes = n * k if fp8 else n * k // 2 + n * k // 16
            ws = _weights("fp8" if fp8 else "nvfp4", n, k, rotating_sets(wbytes), dev)
            wb = [w.dequantize(torch.bfloat16) for w in ws]
            if stack is not None:
                ws = [stack([w]) for w in ws]
            for m in ms:
                r = {"kind": kind, "n": n, "k": k, "m": m, **tune_point(gemm, table, ws, wb, m, cands)}
                log.info(
                    "%s N=%d K=%d M=%d: best %s %.1f us (%.2f TB/s weights); table %.1f; cublas %.1f us",
                    kind,
                    n,
                    k,
                    m,
                    r["best"],
                    r["best_us"],
                    wbytes / r["best_us"] / 1e6,
                    r["table_us"],
                    r["cublas_us"],
                )
                results.append(r)
                _dump(args.out, results)
            del ws, wb
            torch.cuda.empty_cache()


def _dump(path: str, results: list[dict]) -> None:
    """Rewritten after every point, so a run cut short keeps what it measured."""
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
