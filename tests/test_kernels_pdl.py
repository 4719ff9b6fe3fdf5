"""Programmatic dependent launch (`kernels/pdl.py`): on only for compiled kernels on a Hopper GPU. That
every decode kernel waits before touching memory is checked on its sm_90 compile
(test_bench_sm90_report.py); the GPU tests run the kernels with it on."""

import torch
from batchinfer.kernels import pdl

from batchinfer.bench.sm90_report import pdl_order


def test_pdl_is_off_on_the_cpu_and_under_the_interpreter(monkeypatch):
    off = {"PDL": False, "launch_pdl": False}
    assert pdl.launch(torch.device("cpu")) == off
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # interpreted kernels never launch on a GPU
    assert pdl.launch(torch.device("cuda", 0)) == off


def test_the_compile_report_finds_a_memory_access_before_the_wait():
    sass = lambda *ops: "\n".join(f"        /*{16 * i:04x}*/   {op} ;" for i, op in enumerate(ops))
    assert pdl_order(sass("ACQBULK", "PREEXIT", "S2R R0, SR_TID.X", "LDG.E R2, desc[UR4][R2.64]"), True) == (
        "wait first"
    )
    assert pdl_order(sass("LDG.E R2, desc[UR4][R2.64]", "ACQBULK", "PREEXIT"), True) == "LATE"
    assert pdl_order(sass("ACQBULK", "LDGSTS.E [R1], desc[UR4][R2.64]"), True) == "LATE"  # never triggers
    assert pdl_order(sass("LDG.E R2, desc[UR4][R2.64]"), True) == "NO WAIT"
    assert pdl_order(sass("LDG.E R2, desc[UR4][R2.64]"), False) == ""  # a plain launch
    assert pdl_order(sass("ACQBULK", "PREEXIT", "LDS R1, [R2]", "STG.E desc[UR4][R2.64], R1"), True) == (
        "wait first"  # shared memory is not global
    )
