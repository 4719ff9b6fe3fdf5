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
    assert out.dtype == dtype and out.shape == qkv[:2].shape
    assert out.transpose(2, 3).is_contiguous()  # token-major: [2, B, L, H, Dh] in memory
    for x, got in zip(qkv[:2], out, strict=True):
        ref = apply_rope(x, cos, sin)
        err = float((got.float() - ref.float()).norm() / ref.float().norm())
        assert err < tol, err


def test_rejects_mismatched_tables_and_layouts():
    qk = torch.randn(1, 16, 2 * 2 * 8, device=DEV).view(1, 16, 2, 2, 8).permute(2, 0, 3, 1, 4)  # [2,1,2,16,8]
    cos, sin = axial_rope(8, 4, 1.0, torch.device(DEV))
    with pytest.raises(ValueError, match="tables"):
        apply_rope_triton(qk, cos[:8], sin[:8])
    with pytest.raises(ValueError, match="stacked as"):
        apply_rope_triton(qk[0], cos, sin)
    heads_apart = qk.contiguous()  # each head's rows contiguous, a token's heads 128 elements apart
    with pytest.raises(ValueError, match=r"strides \(256, 256, 128, 8, 1\)"):
        apply_rope_triton(heads_apart, cos, sin)
    with pytest.raises(ValueError, match="strides"):  # a strided last dim
        apply_rope_triton(torch.randn(2, 1, 16, 2, 16, device=DEV).transpose(2, 3)[..., ::2], cos, sin)
