"""CLIP BPE ids checked by hand against the vocabulary layout (bytes, bytes + </w>, merges, specials)."""

import pytest
import torch

from batchinfer.sam3.tokenizer import ClipTokenizer, bytes_to_unicode, clean_text, pre_tokenize


@pytest.fixture(scope="module")
def tok() -> ClipTokenizer:
    return ClipTokenizer()


def test_vocab_layout(tok):
    assert tok.vocab_size == 49408
    assert (tok.sot_token_id, tok.eot_token_id) == (49406, 49407)
    # The byte alphabet starts at "!" (id 0); "</w>" variants follow at +256; merges start at 512.
    assert tok.encoder["!"] == 0 and tok.encoder["!</w>"] == 256
    assert len(bytes_to_unicode()) == 256


def test_known_clip_ids(tok):
    assert tok(["a photo of a cat"], 32)[0, :8].tolist() == [49406, 320, 1125, 539, 320, 2368, 49407, 0]


def test_single_characters_by_vocab_position(tok):
    # "a" is byte 97 -> position 97 - 33 = 64 in the alphabet; a whole word gets the </w> copy: 64 + 256.
    assert tok.encode("a") == [320]
    # digits never merge across each other (the pre-tokenizer splits \p{N} one by one): "1" = 49 - 33 + 256.
    assert tok.encode("123") == [272, 273, 274]
    assert tok.encode("!") == [256]


def test_merges_and_words(tok):
    # "cat</w>" is a merge result; its id is 512 + its merge rank.
    assert tok.encode("cat") == [tok.encoder["cat</w>"]] == [2368]
    assert tok.encode("person") == [tok.encoder["person</w>"]]
    assert tok.encode("red car") == [tok.encoder["red</w>"], tok.encoder["car</w>"]]


def test_pre_tokenizer_follows_clip_regex():
    assert pre_tokenize("don't stop!!") == ["don", "'t", "stop", "!!"]
    assert pre_tokenize("a1b") == ["a", "1", "b"]
    assert pre_tokenize("x-y_z") == ["x", "-", "y", "_", "z"]
    assert pre_tokenize("<start_of_text>hi") == ["<start_of_text>", "hi"]
    assert pre_tokenize("café 日本") == ["café", "日本"]


def test_cleaning():
    assert clean_text("  Red\t\nCAR  ") == "red car"
    assert clean_text("tom &amp;amp; jerry") == "tom & jerry"  # unescaped twice, like Meta
    assert clean_text("don\u2019t") == "don't"
    assert clean_text("\ufb01sh") == "fish"
    assert clean_text("\uff32\uff25\uff24\u3000car") == "red car"


def test_curly_and_straight_quotes_tokenize_alike(tok):
    assert tok.encode("person\u2019s bike") == tok.encode("person's bike")


def test_padding_and_truncation(tok):
    ids = tok(["cat", "cat " * 40], 32)
    assert ids.dtype == torch.long and ids.shape == (2, 32)
    assert ids[0, :3].tolist() == [49406, 2368, 49407] and ids[0, 3:].eq(0).all()
    assert ids[1, 0] == 49406 and ids[1, 31] == 49407 and ids[1, 1:31].eq(2368).all()


def test_decode_round_trip(tok):
    assert tok.decode(tok.encode("a photo of a red car")) == "a photo of a red car "
    assert tok.decode(tok.encode("日本語 ok")) == "日本語 ok "
