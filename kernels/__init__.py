"""Triton kernels for Hopper and the formats they read (installed as batchinfer.kernels)."""
