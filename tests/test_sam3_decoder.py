import math

import pytest
import torch

from batchinfer.sam3.config import Sam3Config
from batchinfer.sam3.decoder import Decoder, box_cxcywh_to_xyxy, box_sine_embed, inverse_sigmoid


def test_inverse_sigmoid_clamps_like_meta():
    x = torch.tensor([0.5, 0.8807970779778823, 0.0, 1.0, -0.3])
    out = inverse_sigmoid(x)
    assert out[:2].tolist() == pytest.approx([0.0, 2.0], abs=1e-5)
    assert out[2].item() == pytest.approx(math.log(1e-3 / 1.0))
    assert out[3].item() == pytest.approx(math.log(1.0 / 1e-3))
    assert out[4].item() == out[2].item()


def test_box_conversion():
    assert box_cxcywh_to_xyxy(torch.tensor([0.5, 0.5, 0.5, 0.25])).tolist() == [0.25, 0.375, 0.75, 0.625]


def test_box_sine_embed_by_hand():
    # d_model 4: two channels per coordinate, dim_t = [1, 1]: (sin, cos)(2 pi v), blocks y, x, w, h.
    emb = box_sine_embed(torch.tensor([[0.25, 0.5, 0.125, 1.0]]), 4)
    s = math.sqrt(0.5)
    assert emb[0].tolist() == pytest.approx([0, -1, 1, 0, s, s, 0, 1], abs=1e-6)


def _probe_rpb_decoder() -> Decoder:
    """boxRPB MLPs wired to pass their two inputs through: head 0 = input 0, head 1 = input 1."""
    cfg = Sam3Config.tiny()
    dec = Decoder(cfg)
    for mlp in (dec.boxRPB_embed_x, dec.boxRPB_embed_y):
        with torch.no_grad():
            w0 = torch.zeros(cfg.d_model, 2)
            w0[0, 0], w0[1, 0], w0[2, 1], w0[3, 1] = 1, -1, 1, -1  # relu(v) - relu(-v) = v
            mlp.layers[0].weight.copy_(w0)
            mlp.layers[0].bias.zero_()
            w1 = torch.zeros(cfg.num_heads, cfg.d_model)
            w1[0, 0], w1[0, 1], w1[1, 2], w1[1, 3] = 1, -1, 1, -1
            mlp.layers[1].weight.copy_(w1)
            mlp.layers[1].bias.zero_()
    return dec


def test_box_relative_position_bias_by_hand():
    dec = _probe_rpb_decoder()
    box = torch.tensor([[[0.5, 0.5, 0.5, 0.5]]])  # xyxy (0.25, 0.25, 0.75, 0.75)
    bias = dec.box_rpb(box, 2, 4)  # [1, heads, 1, 8]

    def ls(d: float) -> float:
        d *= 8
        return math.copysign(math.log2(abs(d) + 1), d) / 3

    for i in range(2):  # rows at y = i / 2
        for j in range(4):  # columns at x = j / 4
            head0 = ls(i / 2 - 0.25) + ls(j / 4 - 0.25)  # distances to y0 and x0
            head1 = ls(i / 2 - 0.75) + ls(j / 4 - 0.75)  # distances to y1 and x1
            assert bias[0, 0, 0, i * 4 + j].item() == pytest.approx(head0, abs=1e-5)
            assert bias[0, 1, 0, i * 4 + j].item() == pytest.approx(head1, abs=1e-5)
    assert bias[0, 2:].abs().max() == 0


def _seeded_decoder(seed: int) -> Decoder:
    dec = Decoder(Sam3Config.tiny())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in dec.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return dec.eval()


def test_decoder_outputs_and_batch_independence():
    dec = _seeded_decoder(0)
    g = torch.Generator().manual_seed(1)
    mem, pos = torch.randn(3, 64, 32, generator=g), torch.randn(3, 64, 32, generator=g)
    prompt = torch.randn(3, 5, 32, generator=g)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    q, boxes, presence = dec(mem, pos, (8, 8), prompt, mask)
    assert q.shape == (3, 10, 32) and boxes.shape == (3, 10, 4) and presence.shape == (3,)
    assert ((boxes > 0) & (boxes < 1)).all()
    q1, boxes1, presence1 = dec(mem[2:], pos[2:], (8, 8), prompt[2:], mask[2:])
    assert torch.allclose(q[2:], q1, atol=1e-5) and torch.allclose(boxes[2:], boxes1, atol=1e-6)
    assert torch.allclose(presence[2:], presence1, atol=1e-5)
    # The image memory matters (through cross-attention and the box bias).
    assert not torch.allclose(dec(mem.flip(1), pos, (8, 8), prompt, mask)[1], boxes)
