"""Shared test setup: GPU tests skip without CUDA; the Triton interpreter is on for CPU runs."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through the interpreter (small shapes only).
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `make test-gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
