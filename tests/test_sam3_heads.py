import math

import pytest
import torch

from batchinfer.sam3.config import Sam3Config
from batchinfer.sam3.heads import DotProductScoring, PixelDecoder, SegmentationHead


def _seeded(module: torch.nn.Module, seed: int, scale: float = 0.2) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return module.eval()


def test_scoring_formula_and_pad_masking():
    scorer = _seeded(DotProductScoring(Sam3Config.tiny()), 0)
    g = torch.Generator().manual_seed(1)
    queries, prompt = torch.randn(1, 4, 32, generator=g), torch.randn(1, 3, 32, generator=g)
    mask = torch.tensor([[False, False, True]])
    p = scorer.prompt_mlp(prompt)[0, :2].mean(0)
    expected = scorer.hs_proj(queries[0]) @ scorer.prompt_proj(p) / math.sqrt(32)
    out = scorer(queries, prompt, mask)
    assert torch.allclose(out[0], expected.clamp(-12, 12), atol=1e-5)
    prompt[0, 2] = 99.0
    assert torch.allclose(scorer(queries, prompt, mask), out)


def test_scores_clamped_at_12():
    scorer = _seeded(DotProductScoring(Sam3Config.tiny()), 2, scale=3.0)
    g = torch.Generator().manual_seed(3)
    out = scorer(
        torch.randn(1, 10, 32, generator=g) * 10,
        torch.randn(1, 3, 32, generator=g),
        torch.zeros(1, 3, dtype=torch.bool),
    )
    assert out.abs().max().item() == pytest.approx(12.0)


def test_pixel_decoder_is_top_down_nearest():
    dec = PixelDecoder(8)
    with torch.no_grad():
        for conv in dec.conv_layers:
            conv.weight.zero_()
            conv.weight[:, :, 1, 1] = torch.eye(8)  # 3x3 conv as identity
            conv.bias.zero_()
        for norm in dec.norms:
            norm.weight.fill_(1.0)
            norm.bias.zero_()
    x1 = torch.zeros(1, 8, 1, 1)
    x1[0, :, 0, 0] = torch.arange(8.0)  # a per-channel constant: GroupNorm(8) removes it
    x2 = torch.tensor([[0.0, 1.0], [2.0, 3.0]]).expand(1, 8, 2, 2)
    x4 = torch.zeros(1, 8, 4, 4)
    out = dec([x4, x2, x1])
    # x2 level: relu(norm([0, 1, 2, 3])) = [0, 0, 0.4472, 1.3416]; nearest x2 upsampling to 4x4 and a
    # second norm over {0, 0, 0.4472, 1.3416} (mean 0.4472, std 0.5477) leaves only the last quadrant.
    expected = torch.zeros(4, 4)
    expected[2:, 2:] = 0.8944 / math.sqrt(0.3)
    assert out.shape == (1, 8, 4, 4)
    assert torch.allclose(out[0], expected.expand(8, 4, 4), atol=1e-3)


def test_mask_logits_are_query_pixel_dot_products():
    head = _seeded(SegmentationHead(Sam3Config.tiny()), 4)
    g = torch.Generator().manual_seed(5)
    fpn = [torch.randn(2, 32, 32, 32, generator=g), torch.randn(2, 32, 16, 16, generator=g)]
    fused, queries = torch.randn(2, 64, 32, generator=g), torch.randn(2, 10, 32, generator=g)
    prompt, mask = torch.randn(2, 4, 32, generator=g), torch.zeros(2, 4, dtype=torch.bool)
    out = head(fpn, fused, queries, prompt, mask)
    assert out.shape == (2, 10, 32, 32)
    # Query embeddings scale mask logits linearly after the MLP's last (linear) layer: swap queries 0 and 1.
    swapped = head(fpn, fused, queries[:, [1, 0, *range(2, 10)]], prompt, mask)
    assert torch.allclose(swapped[:, 0], out[:, 1], atol=1e-5)
    one = head([f[1:] for f in fpn], fused[1:], queries[1:], prompt[1:], mask[1:])
    assert torch.allclose(one, out[1:], atol=1e-5)
