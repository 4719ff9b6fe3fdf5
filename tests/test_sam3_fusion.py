import torch

from batchinfer.sam3.config import Sam3Config
from batchinfer.sam3.fusion import FusionEncoder, GeometryEncoder


def _seeded(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return module.eval()


def test_geometry_cls_token_depends_on_its_own_image_only():
    geo = _seeded(GeometryEncoder(Sam3Config.tiny()), 0)
    g = torch.Generator().manual_seed(1)
    img, pos = torch.randn(2, 64, 32, generator=g), torch.randn(2, 64, 32, generator=g)
    out = geo(img, pos)
    assert out.shape == (2, 1, 32)
    assert torch.allclose(out[1:], geo(img[1:], pos[1:]), atol=1e-6)
    assert not torch.allclose(out[0], out[1])


def test_fusion_ignores_padded_prompt_tokens():
    enc = _seeded(FusionEncoder(Sam3Config.tiny()), 2)
    g = torch.Generator().manual_seed(3)
    img, pos = torch.randn(1, 64, 32, generator=g), torch.randn(1, 64, 32, generator=g)
    prompt = torch.randn(1, 5, 32, generator=g)
    mask = torch.tensor([[False, False, True, True, False]])
    changed = prompt.clone()
    changed[0, 2:4] = 50.0
    out = enc(img, pos, prompt, mask)
    assert out.shape == (1, 64, 32)
    assert torch.allclose(out, enc(img, pos, changed, mask), atol=1e-6)
    changed[0, 0] = 1.0
    assert not torch.allclose(out, enc(img, pos, changed, mask))
