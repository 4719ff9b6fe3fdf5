"""build_tokenizer: deterministic byte-level BPE files with Qwen-style special tokens and ChatML template."""

from __future__ import annotations

import json

import jinja2
import pytest
from tokenizers import Tokenizer

from batchinfer.checkpoint.tokenizer_files import (
    BUILTIN_CORPUS,
    SPECIAL_TOKENS,
    build_tokenizer,
    builtin_special_ids,
)
from batchinfer.errors import ConfigError

CORPUS = ["hello world, hello there", "the world is round", "naïve café 世界 🙂"] * 5


def test_same_corpus_same_bytes(tmp_path):
    build_tokenizer(CORPUS, 400, tmp_path / "a")
    build_tokenizer(iter(CORPUS), 400, tmp_path / "b")  # any iterable
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()


def test_ids_bytes_then_merges_then_specials_inside_vocab(tmp_path):
    build_tokenizer(BUILTIN_CORPUS, 512, tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    n = tok.get_vocab_size()
    assert 256 + 3 < n <= 512  # some merges were learned
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [n - 3, n - 2, n - 1]
    assert builtin_special_ids(512) == {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    vocab = tok.get_vocab()
    assert all(vocab[t] < 256 for t in ("a", "Ġ", "Ċ", "Ã"))  # the byte alphabet comes first
    text = "Hello <|im_start|>user\nnaïve 🚀 — ok<|im_end|>"
    enc = tok.encode(text)
    assert tok.decode(enc.ids, skip_special_tokens=False) == text
    assert tok.token_to_id("<|im_start|>") in enc.ids and tok.token_to_id("<|im_end|>") in enc.ids
    assert len(enc.ids) < len(text.encode())  # merges compress
    # a large model vocabulary still gets ids from the small trained vocabulary
    assert max(builtin_special_ids(248320).values()) < 1000


def test_config_has_chatml_template_and_eos(tmp_path):
    build_tokenizer(CORPUS, 300, tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (
        cfg["eos_token"] == "<|im_end|>" and cfg["pad_token"] == "<|endoftext|>" and cfg["bos_token"] is None
    )
    assert {v["content"] for v in cfg["added_tokens_decoder"].values()} == set(SPECIAL_TOKENS)
    template = jinja2.Environment().from_string(cfg["chat_template"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert template.render(messages=messages, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (
        template.render(messages=messages[1:], add_generation_prompt=False)
        == "<|im_start|>user\nHi!<|im_end|>\n"
    )


def test_transformers_reads_the_files(tmp_path):
    from transformers import AutoTokenizer

    build_tokenizer(BUILTIN_CORPUS, 512, tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    ours = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert hf.eos_token_id == ours.token_to_id("<|im_end|>")
    chat = hf.apply_chat_template(
        [{"role": "user", "content": "2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert hf.encode("Hello world") == ours.encode("Hello world").ids


@pytest.mark.parametrize(
    "corpus, size, message",
    [
        (CORPUS, 200, "vocab_size 200 is too small for a byte-level tokenizer: need at least 259"),
        (["", ""], 400, "the corpus is empty"),
    ],
)
def test_bad_arguments(tmp_path, corpus, size, message):
    with pytest.raises(ConfigError, match=message):
        build_tokenizer(corpus, size, tmp_path)
