"""Shared test setup: GPU tests skip without CUDA; the Triton interpreter is on for CPU runs."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through the interpreter (small shapes only).
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    import interpreter_patch_once

    interpreter_patch_once.install()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `make test-gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """`tiny_checkpoint(preset, quant="bf16", seed=0)` -> folder of a `make-checkpoint` preset, written once
    per session. Shared between tests: read it, never modify it (copy it first)."""
    from batchinfer.checkpoint.presets import write_preset

    cache = {}

    def make(preset: str, quant: str = "bf16", seed: int = 0):
        key = (preset, quant, seed)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{preset}-{quant}-{seed}")
            cache[key] = write_preset(preset, out, quant=quant, seed=seed)
        return cache[key]

    return make
