"""NVFP4 (E2M1 codes, E4M3 block scales, fp32 tensor scale) and FP8 (E4M3, per-tensor) weight formats.

This is the codec every loader, the `quantize` command and the kernels' torch references share.
NVFP4 layout, as in NVIDIA ModelOpt exports and compressed-tensors `nvfp4-pack-quantized`:
- codes: uint8 `[N, K // 2]`, element 2j in the low nibble and 2j+1 in the high nibble; bit 3 is the sign;
- block scales: float8_e4m3fn `[N, K // 16]`, one per 16 consecutive K elements, plain row-major;
- tensor scale: fp32 scalar, ModelOpt's `weight_scale_2` (= amax / (6 * 448)); compressed-tensors
  stores the reciprocal as `weight_global_scale`.
Dequantization: `W[n, k] = E2M1[code[n, k]] * (float(block_scale[n, k // 16]) * tensor_scale)`.
Quantization reproduces ModelOpt's producer math (`NVFP4QTensor` in
modelopt/torch/quantization/qtensor/nvfp4_tensor.py) bit for bit as ModelOpt computes it on CPU,
and gives identical bits on CPU and CUDA (ModelOpt on CUDA may put `weight_scale_2` one ulp away;
see `_divide`). Not here: GEMMs, checkpoint I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9
NVFP4_BLOCK = 16
# code -> value; bit 3 is the sign, so code 8 is negative zero.
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)
# Midpoints between neighbouring E2M1 magnitudes. A value exactly on a midpoint rounds to the even
# neighbour (the one with mantissa bit 0): up at 0.75, 1.75 and 3.5, down at 0.25, 1.25, 2.5 and 5.
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIES_UP = (0.75, 1.75, 3.5)


def _scalar_f32(value: torch.Tensor, field: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{field}: expected a float32 scalar tensor, got {type(value).__name__}")
    if value.dtype != torch.float32 or value.numel() != 1:
        raise ValueError(
            f"{field}: expected a float32 scalar tensor, got {value.dtype} of shape {tuple(value.shape)}"
        )
    return value.reshape(())


@dataclass(slots=True)
class NVFP4Weight:
    """A `[N, K]` linear weight in NVFP4; the formula is in the module docstring."""

    packed: torch.Tensor  # uint8 [N, K // 2]
    block_scale: torch.Tensor  # float8_e4m3fn [N, K // 16]
    tensor_scale: torch.Tensor  # float32 scalar []

    def __post_init__(self) -> None:
        if self.packed.dtype != torch.uint8 or self.packed.ndim != 2:
            raise ValueError(
                f"packed: expected uint8 [N, K // 2], got {self.packed.dtype} "
                f"of shape {tuple(self.packed.shape)}"
            )
        n, half_k = self.packed.shape
        if half_k % (NVFP4_BLOCK // 2):
            raise ValueError(
                f"packed: K = {2 * half_k} ({half_k} bytes a row) is not a multiple of {NVFP4_BLOCK}"
            )
        expected = (n, 2 * half_k // NVFP4_BLOCK)
        if self.block_scale.dtype != torch.float8_e4m3fn or tuple(self.block_scale.shape) != expected:
            raise ValueError(
                f"block_scale: expected float8_e4m3fn {list(expected)}, got {self.block_scale.dtype} "
                f"of shape {list(self.block_scale.shape)}"
            )
        self.tensor_scale = _scalar_f32(self.tensor_scale, "tensor_scale")
        devices = {self.packed.device, self.block_scale.device, self.tensor_scale.device}
        if len(devices) > 1:
            raise ValueError(f"packed, block_scale and tensor_scale are on different devices: {devices}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], 2 * self.packed.shape[1]

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.block_scale.numel() + 4

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_nvfp4(self.packed, self.block_scale, self.tensor_scale, dtype)

    def to(self, device: torch.device | str) -> NVFP4Weight:
        return NVFP4Weight(self.packed.to(device), self.block_scale.to(device), self.tensor_scale.to(device))


@dataclass(slots=True)
class FP8Weight:
    """A `[N, K]` linear weight in per-tensor FP8: `W = float(data) * scale` (ModelOpt `FP8`)."""

    data: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32 scalar []

    def __post_init__(self) -> None:
        if self.data.dtype != torch.float8_e4m3fn or self.data.ndim != 2:
            raise ValueError(
                f"data: expected float8_e4m3fn [N, K], got {self.data.dtype} "
                f"of shape {tuple(self.data.shape)}"
            )
        self.scale = _scalar_f32(self.scale, "scale")
        if self.data.device != self.scale.device:
            raise ValueError(f"data is on {self.data.device} but scale is on {self.scale.device}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.data.shape[1]

    @property
    def nbytes(self) -> int:
        return self.data.numel() + 4

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.float() * self.scale).to(dtype)

    def to(self, device: torch.device | str) -> FP8Weight:
        return FP8Weight(self.data.to(device), self.scale.to(device))


def round_to_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (ties to even) and return its 4-bit code as uint8, same shape.

    Bit-exact with ModelOpt's `_cast_fp4`: magnitudes above 6 saturate to 6, and the sign bit is
    `x < 0`, so -0.0 gives code 0 while a negative value that rounds to zero (e.g. -0.2) gives
    code 8 (negative zero); both decode to zero. NaN has no code; callers reject it first.
    """
    if not x.is_floating_point():
        raise ValueError(f"x: expected a floating-point tensor, got {x.dtype}")
    a = x.float().abs()
    bounds = torch.tensor(_E2M1_BOUNDS, dtype=torch.float32, device=x.device)
    # searchsorted (right=False) counts bounds strictly below a: a value on a bound rounds down ...
    codes = torch.searchsorted(bounds, a.contiguous(), out_int32=True).to(torch.uint8)
    for tie in _E2M1_TIES_UP:  # ... except on the three bounds whose upper neighbour is even
        codes += (a == tie).to(torch.uint8)
    return codes | ((x < 0).to(torch.uint8) << 3)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes `[..., K]` -> bytes `[..., K // 2]`; element 2j in the low nibble, 2j+1 in the high."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes: expected uint8, got {codes.dtype}")
    if codes.ndim == 0 or codes.shape[-1] % 2:
        raise ValueError(f"codes: the last dimension must be even, got shape {tuple(codes.shape)}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"codes: E2M1 codes are 4-bit (0..15), found {int(codes.max())}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Bytes `[..., K // 2]` -> uint8 codes `[..., K]`; inverse of `pack_e2m1`."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed: expected uint8, got {packed.dtype}")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def dequantize_nvfp4(
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    tensor_scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """`[..., K // 2]` codes, `[..., K // 16]` e4m3 scales, fp32 scalar -> `[..., K]` in `dtype`.

    Computes in fp32 in ModelOpt's order (block scale times tensor scale first), then casts.
    """
    values = E2M1_VALUES.to(packed.device)[unpack_e2m1(packed).long()]  # [..., K]
    k = values.shape[-1]
    if block_scale.shape[:-1] != packed.shape[:-1] or block_scale.shape[-1] * NVFP4_BLOCK != k:
        raise ValueError(
            f"block_scale: expected shape {[*packed.shape[:-1], k // NVFP4_BLOCK]} for packed of shape "
            f"{list(packed.shape)}, got {list(block_scale.shape)}"
        )
    scale = block_scale.float() * tensor_scale.float()  # [..., K // 16]
    out = values.unflatten(-1, (k // NVFP4_BLOCK, NVFP4_BLOCK)) * scale.unsqueeze(-1)
    return out.flatten(-2).to(dtype)


def _divide(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """`x / divisor`, correctly rounded on every device.

    CUDA divides a tensor by a Python number by multiplying with its fp32 reciprocal, which can
    land one ulp away from CPU's true division; a tensor divisor gets true division everywhere.
    """
    return x / torch.tensor(divisor, dtype=torch.float32, device=x.device)


def _check_finite(w: torch.Tensor, name: str) -> None:
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        first = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(f"{name}: {int(bad.sum())} non-finite values (first at index {first})")


def quantize_nvfp4(w: torch.Tensor, *, tensor_amax: float | torch.Tensor | None = None) -> NVFP4Weight:
    """Quantize a `[N, K]` float weight to NVFP4 with ModelOpt's scale rules.

    `tensor_scale = amax / (6 * 448)`, where `amax` is `tensor_amax` if given (to share one scale across
    matrices that a kernel fuses) or else `max |w|`; `block_scale = block_amax / (6 * tensor_scale)`,
    1.0 for all-zero blocks, clamped to [2^-9, 448] and rounded to e4m3; codes round
    `w / (block_scale * tensor_scale)` to E2M1. An all-zero weight gets tensor scale 1.0 (ModelOpt
    would divide 0 by 0) and dequantizes to exact zeros.
    """
    if w.ndim != 2 or not w.is_floating_point():
        raise ValueError(f"w: expected a floating-point [N, K] tensor, got {w.dtype} {list(w.shape)}")
    w = w.float()
    _check_finite(w, "w")
    amax = None
    if tensor_amax is not None:
        given = torch.as_tensor(tensor_amax, dtype=torch.float32, device=w.device).reshape(())
        if not bool(torch.isfinite(given)) or float(given) < 0:
            raise ValueError(f"tensor_amax: expected a finite value >= 0, got {float(given)}")
        if float(given) == 0 and w.numel() and float(w.abs().amax()) > 0:
            raise ValueError(f"tensor_amax: 0 cannot scale a weight whose max |w| is {float(w.abs().amax())}")
        amax = given.reshape(1)
    packed, block_scale, tensor_scale = _quantize_nvfp4_stack(w[None], amax)
    return NVFP4Weight(packed[0], block_scale[0], tensor_scale[0])


def quantize_nvfp4_stack(w: torch.Tensor) -> list[NVFP4Weight]:
    """`quantize_nvfp4` of each `[N, K]` matrix of `w [B, N, K]` (each with its own tensor scale), in one
    pass: bit-identical to B separate calls, without B rounds of small kernels and host syncs (a
    real-shape MoE has 30,000 expert matrices)."""
    if w.ndim != 3 or not w.is_floating_point():
        raise ValueError(f"w: expected a floating-point [B, N, K] tensor, got {w.dtype} {list(w.shape)}")
    w = w.float()
    _check_finite(w, "w")
    packed, block_scale, tensor_scale = _quantize_nvfp4_stack(w, None)
    return [NVFP4Weight(packed[b], block_scale[b], tensor_scale[b]) for b in range(w.shape[0])]


def _quantize_nvfp4_stack(
    w: torch.Tensor, amax: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The quantization math of `quantize_nvfp4` over finite fp32 `[B, N, K]`; `amax [B]`, or else each
    matrix's max |w|."""
    b, n, k = w.shape
    if k % NVFP4_BLOCK:
        raise ValueError(f"w: K = {k} (shape {[n, k]}) is not a multiple of the NVFP4 block {NVFP4_BLOCK}")
    if amax is None:
        amax = w.abs().amax(dim=(1, 2)) if n * k else torch.zeros(b, dtype=torch.float32, device=w.device)
    tensor_scale = _divide(amax, E2M1_MAX * E4M3_MAX)
    tensor_scale = torch.where(tensor_scale == 0, torch.ones_like(tensor_scale), tensor_scale)
    ts = tensor_scale[:, None, None]
    blocks = w.unflatten(-1, (k // NVFP4_BLOCK, NVFP4_BLOCK))  # [B, N, K // 16, 16]
    block_scale = blocks.abs().amax(dim=-1) / (E2M1_MAX * ts)  # [B, N, K // 16]
    block_scale[block_scale == 0] = 1.0
    block_scale = block_scale.clamp_(E4M3_MIN_SUBNORMAL, E4M3_MAX).to(torch.float8_e4m3fn)
    scaled = blocks / (block_scale.float() * ts).unsqueeze(-1)
    codes = round_to_e2m1_codes(scaled.flatten(-2))  # [B, N, K]
    return pack_e2m1(codes), block_scale, tensor_scale.float()


def quantize_fp8(w: torch.Tensor) -> FP8Weight:
    """Quantize a `[N, K]` float weight to per-tensor E4M3 as ModelOpt does: `scale = amax / 448`.

    An all-zero weight keeps scale 0 (ModelOpt divides by 1 instead), so it dequantizes to zeros.
    Values are clamped to +-448 before the cast, which saturates on CPU but gives NaN on CUDA.
    """
    if w.ndim != 2 or not w.is_floating_point():
        raise ValueError(f"w: expected a floating-point [N, K] tensor, got {w.dtype} {list(w.shape)}")
    w = w.float()
    _check_finite(w, "w")
    amax = w.abs().amax() if w.numel() else torch.zeros((), dtype=torch.float32, device=w.device)
    scale = _divide(amax, E4M3_MAX)
    divisor = scale if float(scale) > 0 else torch.ones_like(scale)
    data = (w / divisor).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return FP8Weight(data, scale)


def tensor_scale_from_ct_global(weight_global_scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors `weight_global_scale` (a divisor, shape [1] or []) -> our fp32 scalar scale."""
    g = weight_global_scale.float().reshape(())
    if not bool(torch.isfinite(g)) or float(g) <= 0:
        raise ValueError(f"weight_global_scale: expected a finite value > 0, got {float(g)}")
    return 1.0 / g


def ct_global_from_tensor_scale(tensor_scale: torch.Tensor) -> torch.Tensor:
    """Our tensor scale -> compressed-tensors `weight_global_scale`, fp32 of shape [1] as CT stores it."""
    s = tensor_scale.float().reshape(())
    if not bool(torch.isfinite(s)) or float(s) <= 0:
        raise ValueError(f"tensor_scale: expected a finite value > 0, got {float(s)}")
    return (1.0 / s).reshape(1)
