"""The sm_90 compile report: every attention / KV-store / DeltaNet / MoE / GEMV / small-op kernel (the
chunked-prefill, FP8-cache, split-K, bf16-tail and conv-epilogue variants too) and the SAM 3 ViT's RoPE and
LayerNorm passes (windowed and global blocks) compile for Hopper at their production configs, without
spilling past the limit, on this CPU (Triton's bundled ptxas). The interpreter cannot catch a kernel that
does not compile (the ViT LayerNorm's global-block form did not, session 14)."""

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_all_kernels_compile_for_sm90_without_spills():
    # without the interpreter, so the launchers pick their production configs
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-W", "ignore", "-m", "batchinfer.bench.sm90_report", "--max-spill", "128"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    header = [c.strip("| ") for c in next(line for line in lines if line.startswith("| kernel")).split(" | ")]
    rows = [[c.strip("| ") for c in line.split(" | ")] for line in lines if line.startswith("| _")]
    assert len(rows) == 78 and not any("FAILED" in line for line in lines)
    by_kernel = {(r[0], r[1]): dict(zip(header, r, strict=True)) for r in rows}

    def column(name: str, key: str, case: str | None = None) -> list[str]:
        return [r[key] for (k, c), r in by_kernel.items() if k == name and case in (None, c)]

    hgmma = column("_prefill_attn_kernel", "HGMMA")
    assert hgmma and all(int(n) > 0 for n in hgmma)  # prefill QK^T and PV run on wgmma
    ldgsts = column("_decode_attn_kernel", "LDGSTS")
    assert ldgsts and all(int(n) > 0 for n in ldgsts)  # the KV stream is software-pipelined (cp.async)
    no_sync = ("_moe_tc_kernel", "_moe_direct_gate_up_kernel", "_moe_direct_down_kernel", "_fp8_gemv_kernel",
               "_fp8_rows_mm_kernel", "_nvfp4_rows_tc_kernel")  # fmt: skip
    for name in no_sync:  # no synchronous loop loads; a K loop whose issue cost the report counts
        assert set(column(name, "loop LDG")) == {"0"}, name
        assert all(int(n) > 0 for n in column(name, "loop instr")), name
    gemv = [r for (name, _), r in by_kernel.items() if name in ("_fp8_gemv_kernel", "_nvfp4_gemv_kernel")]
    assert len(gemv) == 8  # the weight stream is cp.async (split-K too), except on a projection's group-major
    assert all((int(r["LDGSTS"]) > 0) != ("group-major" in r["case"]) for r in gemv)  # NVFP4 rows (loads won)
    # the one-row NVFP4 kernels issue a step's scale loads with its codes, not after decoding them (8-37
    # such loads a kernel until session 27); down's per-slot tensor and routing scales (L2) may trail
    assert column("_moe_decode_gate_up_kernel", "late LDG") == ["0"]
    assert column("_nvfp4_gemv_kernel", "late LDG", "N=8192 K=2048 M=1 group-major") == ["0"]
    assert all(int(n) <= 2 for n in column("_moe_decode_down_kernel", "late LDG"))
    for name in (
        "_moe_tc_kernel",
        "_moe_direct_gate_up_kernel",
        "_moe_direct_down_kernel",
        "_fp8_rows_mm_kernel",
        "_nvfp4_rows_tc_kernel",
    ):  # pipelined (a zero-trip K loop serialized
        assert set(column(name, "wgmma serialized")) == {""}, name  # moe_tc's until session 12)
    # the register cap `max_regs` 80 (session 29; the direct path's config since session 30): 7 programs an
    # SM, where the compiler's own choice (~120 registers) gives 4, and no spill
    for name, free_case, capped_case in (
        ("_moe_tc_kernel", "T=32 gate_up, BLOCK_M 16", "T=32 gate_up, BLOCK_M 16, max_regs 80"),
        ("_moe_direct_gate_up_kernel", "T=1 paired, uncapped", "T=1 paired"),
    ):
        free, capped = by_kernel[(name, free_case)], by_kernel[(name, capped_case)]
        assert int(capped["regs"]) <= 80 and capped["spill B"] == "0", (name, capped)
        assert int(capped["CTAs/SM"]) > int(free["CTAs/SM"]), (name, free, capped)
    rows_mm = by_kernel[("_fp8_rows_mm_kernel", "N=12288+64 bf16 K=2048 M=32")]  # decoded FP8 as wgmma's A
    assert int(rows_mm["HGMMA"]) > 0
    ctas = {name: int(r["CTAs/SM"]) for (name, case), r in by_kernel.items() if case == "prefill"}
    assert ctas["_chunk_inverse_kernel"] >= 8  # small tiles, many programs an SM (one for the fused form)
    scores = by_kernel[("_chunk_scores_kernel", "prefill")]  # a program a k-head, for its v-heads
    assert ctas["_chunk_scores_kernel"] >= 2 and scores["spill B"] == "0"  # two an SM, no spills
    assert ctas["_chunk_wu_kernel"] >= 4
    # every kernel of a decode step is launched with programmatic dependent launch and waits for the one
    # before it ahead of any memory access (the report exits 1 on an access before the wait)
    pdl = [(name, r["PDL"]) for (name, _), r in by_kernel.items()]  # every case of each kernel
    decode = {
        "_embedding_kernel", "_add_rmsnorm_kernel", "_fp8_gemv_kernel", "_nvfp4_gemv_kernel",
        "_conv1d_update_kernel", "_delta_rule_kernel", "_gated_rmsnorm_kernel", "_qk_norm_rope_kernel",
        "_store_kv_kernel", "_decode_attn_kernel", "_decode_combine_kernel", "_moe_tc_kernel",
        "_moe_decode_gate_up_kernel", "_moe_decode_down_kernel", "_moe_route_kernel", "_moe_hist_kernel",
        "_moe_offsets_kernel", "_moe_scatter_kernel", "_sum_slots_kernel", "_nvfp4_rows_tc_kernel",
        "_norm_route_kernel", "_moe_direct_gate_up_kernel", "_moe_direct_down_kernel",
    }  # fmt: skip
    assert {name for name, _ in pdl} >= decode
    assert all(order == "wait first" for name, order in pdl if name in decode)


def test_loop_instructions_counts_the_largest_innermost_loop():
    """An outer loop (0x10-0x80) holding an inner one (0x20-0x40), then a second loop (0x90-0xe0): the
    count is the larger innermost body's, the outer loop's own size never counts."""
    from batchinfer.bench.sm90_report import loop_instructions

    body = {0x00: "MOV R1, R2", 0x10: "IADD3 R1, R1, 0x1, RZ", 0x20: "LOP3.LUT R3, R1, 0xf, RZ, 0xc0, !PT",
            0x30: "SHF.R.W.U32 R4, R3, 0x4, R3", 0x40: "@P0 BRA 0x20", 0x50: "HMUL2 R5, R4, R4",
            0x60: "HMUL2 R5, R5, R4", 0x70: "HMUL2 R5, R5, R4", 0x80: "@P1 BRA 0x10", 0x90: "LOP3.LUT R6, R5",
            0xa0: "SHF.R.W.U32 R6, R6, 0x4, R6", 0xb0: "LOP3.LUT R6, R6", 0xc0: "HMUL2 R6, R6, R6",
            0xd0: "IADD3 R7, R7, 0x1, RZ", 0xe0: "@P2 BRA 0x90", 0xf0: "EXIT"}  # fmt: skip
    sass = "\n".join(f"        /*{a:04x}*/                   {ins} ;" for a, ins in body.items())
    assert loop_instructions(sass) == 6  # 0x90-0xe0; the outer 0x10-0x80 holds 8, the inner 3
    assert loop_instructions("        /*0000*/                   EXIT ;") == 0
