"""Programmatic dependent launch (`kernels/pdl.py`): on only for compiled kernels on a Hopper GPU. That
every decode kernel waits before touching memory is checked on its sm_90 compile
(test_bench_sm90_report.py); the GPU tests run the kernels with it on."""

import torch
from batchinfer.kernels import pdl


def test_pdl_is_off_on_the_cpu_and_under_the_interpreter(monkeypatch):
    off = {"PDL": False, "launch_pdl": False}
    assert pdl.launch(torch.device("cpu")) == off
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # interpreted kernels never launch on a GPU
    assert pdl.launch(torch.device("cuda", 0)) == off
