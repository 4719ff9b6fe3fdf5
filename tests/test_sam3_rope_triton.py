import pytest
import torch

from batchinfer.sam3.rope_triton import apply_rope_triton
from batchinfer.sam3.vit import apply_rope, axial_rope

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU runs the kernel under TRITON_INTERPRET=1


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize(("heads", "side", "head_dim"), [(2, 4, 16), (3, 9, 12)])
def test_matches_the_pytorch_rope_on_the_qkv_view(dtype, tol, heads, side, head_dim):
    b, n = 2, side * side
    qkv = torch.randn(b, n, 3 * heads * head_dim, device=DEV).to(dtype)
    qkv = qkv.view(b, n, 3, heads, head_dim).permute(2, 0, 3, 1, 4)  # strided, as in vit.Attention
    cos, sin = axial_rope(head_dim, side, 0.5, torch.device(DEV))
    out = apply_rope_triton(qkv[:2], cos, sin)
    assert out.is_contiguous() and out.dtype == dtype and out.shape == qkv[:2].shape
    for x, got in zip(qkv[:2], out, strict=True):
        ref = apply_rope(x, cos, sin)
        err = float((got.float() - ref.float()).norm() / ref.float().norm())
        assert err < tol, err


def test_rejects_mismatched_tables():
    x = torch.randn(2, 1, 2, 16, 8, device=DEV)
    cos, sin = axial_rope(8, 4, 1.0, torch.device(DEV))
    with pytest.raises(ValueError, match="rope: qk"):
        apply_rope_triton(x[..., ::2], cos, sin)
    with pytest.raises(ValueError, match="rope: qk"):
        apply_rope_triton(x[0], cos, sin)
    with pytest.raises(ValueError, match="tables"):
        apply_rope_triton(x, cos[:8], sin[:8])
