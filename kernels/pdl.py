"""Programmatic dependent launch (Hopper and later) for the kernels of a decode step.

A kernel launched with it may start while the kernel before it in the stream is still running. Its
programs first wait (`griddepcontrol.wait`) until that kernel has finished and its writes are visible,
then let the next kernel launch in turn. A decode step is hundreds of small launches one after another
(about 12 a layer at batch 1); with this each one's launch and ramp-up overlap the tail of the one before
instead of adding to the step. Every kernel launched with it calls `enter` before its first memory
access, so it reads and writes nothing early; a kernel launched without it (cuBLAS, PyTorch's own) keeps
the stream's plain order.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.lru_cache
def _hopper(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch(device: torch.device) -> dict[str, bool]:
    """The launch's keyword arguments: `PDL` (the kernel's constexpr) and Triton's `launch_pdl`, both on for
    a compiled kernel on a Hopper or later GPU (off under the CPU interpreter and on older GPUs)."""
    # `nvfp4_gemm.interpreting()`, read here directly: nvfp4_gemm imports this module
    on = device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1" and _hopper(device.index)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def enter(PDL: tl.constexpr):
    """A PDL-launched kernel's first step: wait for the kernel before, then let the next one launch (its
    programs become resident and wait in turn; all of this kernel's programs have started by then, so
    they cannot be crowded out)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
