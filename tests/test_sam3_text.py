import torch

from batchinfer.sam3.config import Sam3Config
from batchinfer.sam3.text import TextEncoder


def _encoder() -> TextEncoder:
    enc = TextEncoder(Sam3Config.tiny())
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in enc.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return enc.eval()


def test_shapes_and_padding_mask():
    enc = _encoder()
    tokens = torch.zeros(2, 32, dtype=torch.long)
    tokens[0, :3] = torch.tensor([49406, 2368, 49407])
    tokens[1, :4] = torch.tensor([49406, 736, 1615, 49407])
    feats, mask = enc(tokens)
    assert feats.shape == (2, 32, 32)
    assert mask[0].tolist() == [False] * 3 + [True] * 29
    assert mask[1].tolist() == [False] * 4 + [True] * 28


def test_causal_later_tokens_do_not_change_earlier_states():
    enc = _encoder()
    a = torch.tensor([[49406, 320, 2368, 49407] + [0] * 28])
    b = a.clone()
    b[0, 2:4] = torch.tensor([1929, 49407])
    fa, _ = enc(a)
    fb, _ = enc(b)
    assert torch.allclose(fa[0, :2], fb[0, :2], atol=1e-6)
    assert not torch.allclose(fa[0, 2], fb[0, 2])


def test_rows_are_independent():
    enc = _encoder()
    a = torch.tensor([[49406, 320, 2368, 49407] + [0] * 28])
    b = torch.tensor([[49406, 736, 1615, 49407] + [0] * 28])
    both, _ = enc(torch.cat([a, b]))
    alone, _ = enc(b)
    assert torch.allclose(both[1], alone[0], atol=1e-6)
