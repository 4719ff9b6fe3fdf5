import torch
from torch import nn

from batchinfer.sam3.layers import MLP, EncoderLayer, MultiheadAttention


def _init(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def test_attention_matches_torch_multihead_attention_with_the_same_weights():
    ours = MultiheadAttention(16, 4)
    _init(ours, 0)
    ref = nn.MultiheadAttention(16, 4, batch_first=True)
    ref.load_state_dict(ours.state_dict())  # same parameter names: Meta's checkpoints rely on it
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 5, 16, generator=g), torch.randn(2, 7, 16, generator=g)
    v = torch.randn(2, 7, 16, generator=g)
    pad = torch.tensor([[False] * 7, [False] * 4 + [True] * 3])
    bias = torch.randn(2, 4, 5, 7, generator=g)
    pad_bias = torch.zeros(2, 7).masked_fill(pad, float("-inf"))
    expected = ref(q, k, v, key_padding_mask=pad_bias, attn_mask=bias.flatten(0, 1), need_weights=False)[0]
    assert torch.allclose(ours(q, k, v, key_padding_mask=pad, attn_bias=bias), expected, atol=1e-5)
    causal = torch.triu(torch.full((5, 5), float("-inf")), 1)
    expected = ref(q, q, q, attn_mask=causal, need_weights=False)[0]
    assert torch.allclose(ours(q, q, q, is_causal=True), expected, atol=1e-5)


def test_padded_keys_have_no_influence():
    attn = MultiheadAttention(8, 2)
    _init(attn, 2)
    g = torch.Generator().manual_seed(3)
    q, kv = torch.randn(1, 3, 8, generator=g), torch.randn(1, 4, 8, generator=g)
    kv2 = kv.clone()
    kv2[0, 3] = 100.0
    pad = torch.tensor([[False, False, False, True]])
    assert torch.allclose(attn(q, kv, kv, key_padding_mask=pad), attn(q, kv2, kv2, key_padding_mask=pad))


def test_mlp_by_hand():
    mlp = MLP(2, 3, 2, 2, residual=True)
    with torch.no_grad():
        mlp.layers[0].weight.copy_(torch.tensor([[1.0, 0], [0, 1], [-1, 0]]))
        mlp.layers[0].bias.zero_()
        mlp.layers[1].weight.copy_(torch.tensor([[1.0, 0, 0], [0, 0, 1]]))
        mlp.layers[1].bias.copy_(torch.tensor([0.5, 0.0]))
    # relu([1, -2, -1]) = [1, 0, 0] -> [1.5, 0] + residual [1, -2]
    assert mlp(torch.tensor([[1.0, -2.0]])).tolist() == [[2.5, -2.0]]


def test_encoder_layer_positions_go_where_configured():
    torch.manual_seed(0)
    x, mem = torch.randn(1, 3, 8), torch.randn(1, 4, 8)
    pos, mem_pos = torch.randn(1, 3, 8), torch.randn(1, 4, 8)
    fusion = EncoderLayer(8, 2, 16, pos_at_self_attn=True, pos_at_cross_keys=False)
    geometry = EncoderLayer(8, 2, 16, pos_at_self_attn=False, pos_at_cross_keys=True)
    geometry.load_state_dict(fusion.state_dict())
    assert torch.equal(fusion(x, mem, pos=pos, memory_pos=mem_pos), fusion(x, mem, pos=pos))
    assert torch.equal(geometry(x, mem, pos=pos, memory_pos=mem_pos), geometry(x, mem, memory_pos=mem_pos))
    assert not torch.allclose(fusion(x, mem, pos=pos), fusion(x, mem, pos=torch.zeros_like(pos)))
