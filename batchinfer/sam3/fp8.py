"""FP8 linears for the SAM 3 ViT: the backbone is compute-bound (docs/PERF_IMAGES.md: ~5.6 TFLOP an image,
4.6 of it in the ViT's linears), and the H200's FP8 tensor cores run twice bf16's rate.

`FP8Linear` keeps the weight in E4M3 with one scale per output row (its max / 448, set at load) and
quantizes its input per row on the fly (`kernels/fp8_quant.py`, one pass), then `torch._scaled_mm` with
row-wise scales (on the GPU cuBLASLt or CUTLASS, as PyTorch picks, with the bias fused, bf16 out only;
PyTorch's CPU kernel elsewhere). Chosen per engine (`--engine-arg vit=fp8`, `bench images --vit fp8`);
the accuracy lock of `bench images` compares it with the fp32 reference like any other fast path. At real
shapes all four linears of every block failed the lock (mean mask IoU 0.875, docs/PERF_IMAGES.md), and
so did `vit=fp8-mlp`, which swaps only the MLP's (fc1, fc2: about two thirds of the ViT's linear FLOPs)
and keeps the attention projections in bf16 (IoU 0.869): E4M3's 3 mantissa bits on every input, not the
attention projections, are what compounds over 32 blocks.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from batchinfer.errors import ConfigError
from batchinfer.kernels.fp8_quant import FP8_MAX, quantize_rows_fp8


class FP8Linear(nn.Module):
    """`nn.Linear` (K and N multiples of 16, as FP8 GEMMs need) on E4M3 weights and activations."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        n, k = linear.weight.shape
        if n % 16 or k % 16:
            raise ValueError(f"FP8Linear: in and out features must be multiples of 16, got {k} -> {n}")
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
        self.register_buffer("weight", (w / scale).to(torch.float8_e4m3fn))  # [N, K]
        self.register_buffer("weight_scale", scale.t().contiguous())  # [1, N]
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        q, scale = quantize_rows_fp8(rows if rows.stride(-1) == 1 else rows.contiguous())
        bias = None if self.bias is None else self.bias.to(x.dtype)
        out = torch._scaled_mm(
            q, self.weight.t(), scale_a=scale, scale_b=self.weight_scale, bias=bias, out_dtype=x.dtype
        )
        return out.view(*x.shape[:-1], -1)


VIT_MODES = ("bf16", "fp8", "fp8-mlp")  # the engine's and `bench images`' choices of ViT linears


def use_fp8_vit(model: nn.Module, mlp_only: bool = False) -> int:
    """Swap the ViT blocks' linears (qkv, proj, fc1, fc2; with `mlp_only` fc1 and fc2) of a `Sam3Model`
    for `FP8Linear`s, in place; linears whose widths are not multiples of 16 (tiny test models) stay as
    they are. Returns how many were swapped. On a GPU the model must be bf16 (PyTorch's row-wise FP8
    GEMM writes bf16 only)."""
    param = next(model.parameters())
    if param.is_cuda and param.dtype != torch.bfloat16:
        raise ConfigError(f"FP8 ViT linears on a GPU need the model in bfloat16, got {param.dtype}")
    swapped = 0
    for block in model.backbone.vision_backbone.trunk.blocks:
        linears = [(block.mlp, "fc1"), (block.mlp, "fc2")]
        if not mlp_only:
            linears += [(block.attn, "qkv"), (block.attn, "proj")]
        for parent, name in linears:
            linear = getattr(parent, name)
            if isinstance(linear, nn.Linear) and linear.in_features % 16 == linear.out_features % 16 == 0:
                setattr(parent, name, FP8Linear(linear))
                swapped += 1
    return swapped
