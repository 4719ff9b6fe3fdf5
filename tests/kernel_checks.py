"""Shared by the kernel tests: the device they run on and the relative-error check that also rejects NaN."""

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp32; fails on NaN (outputs are poisoned with NaN before each run)."""
    out, ref = out.float().cpu(), ref.float().cpu()
    assert not torch.isnan(out).any(), "output has NaN (unwritten or broken)"
    return float((out - ref).norm() / ref.norm())
