"""batchinfer.tokenizer against transformers on the same files; hand-made partial-UTF-8 and stop cases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from batchinfer.errors import ConfigError, InputError
from batchinfer.tokenizer import Tokenizer, validate_messages

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Hello world! How are you today? I am fine, thank you.",
    "Batch inference runs many prompts at once on one GPU.",
    "naïve café résumé über straße",
    "def main():\n    return 42\n",
] * 20
TEXTS = [
    "Hello world!",
    "  leading spaces and trailing  ",
    "naïve café 世界 🎉 ok",
    "line one\nline two\n\n\ttabbed",
    "<|im_start|>user\nhi<|im_end|>",
    "<think>reasoning</think> answer",
    "",
]
# A ChatML template in the style of Qwen's: default system prompt, role check, tojson, a namespace set
# in a reversed loop with `break` (loopcontrols), whitespace control under trim_blocks/lstrip_blocks.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}\n"
    "{%- for message in messages[::-1] %}\n"
    "    {%- if message.role == 'user' and message.content is string %}"
    "{% set ns.last_user = messages|length - 1 - loop.index0 %}{% break %}{% endif %}\n"
    "{%- endfor %}\n"
    "{%- if messages[0].role != 'system' %}"
    "{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
    "{%- for message in messages %}\n"
    "  {%- if message.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message.role) }}{% endif %}\n"
    "  {{- '<|im_start|>' + message.role + '\\n' + message.content | trim }}"
    "{% if message.meta is defined %} {{ message.meta | tojson }}{% endif %}"
    "{% if loop.index0 == ns.last_user %} (last){% endif %}"
    "{{ '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}"
    "{{ eos_token if false }}"
)
CHATS = [
    [{"role": "user", "content": "Hello world!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  naïve café 世界  "}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "meta": {"ok": "ünï <&>"}},
        {"role": "user", "content": "and 3+3?"},
    ],
]


def write_bytelevel(out: Path, vocab_size: int = 300, template: str | None = CHAT_TEMPLATE) -> Path:
    """A small byte-level BPE (Qwen's kind): with few merges, non-ASCII characters span several tokens."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens(["<think>", "</think>"])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "model_max_length": 4096,
    }
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    if template is not None:
        cfg["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


def write_metaspace(out: Path) -> Path:
    """A SentencePiece-style BPE with byte fallback (Llama's kind): leading-space stripping on decode."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "▁w", "el", "ll", "llo", "▁hello", "▁world"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "h"), ("▁", "w"), ("e", "l"), ("l", "l"), ("ll", "o"), ("▁h", "e"), ("▁he", "llo")]
    vocab["▁he"] = len(vocab)
    merges += [("▁w", "o"), ("▁wo", "r"), ("▁wor", "l"), ("▁worl", "d")]
    for piece in ["▁wo", "▁wor", "▁worl"]:
        vocab[piece] = len(vocab)
    tok = HFTokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    return out


@pytest.fixture(scope="module")
def bl_dir(tmp_path_factory) -> Path:
    return write_bytelevel(tmp_path_factory.mktemp("bytelevel"))


@pytest.fixture(scope="module")
def tok(bl_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(bl_dir)


@pytest.fixture(scope="module")
def hf_tok(bl_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(bl_dir))


def test_encode_decode_parity_with_transformers(tok, hf_tok):
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tok(text)["input_ids"], text
        assert (
            tok.decode(ids)
            == hf_tok.decode(ids, skip_special_tokens=True)
            == text.replace("<|im_start|>", "").replace("<|im_end|>", "")
        )
        assert tok.decode(ids, skip_special_tokens=False) == text


def test_chat_template_parity_with_transformers(tok, hf_tok):
    for chat in CHATS:
        for gen in (True, False):
            ours = tok.apply_chat_template(chat, add_generation_prompt=gen)
            assert ours == hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            ids = hf_tok.apply_chat_template(
                chat, tokenize=True, add_generation_prompt=gen, return_dict=False
            )
            assert tok.encode_chat(chat, add_generation_prompt=gen) == list(ids)
    rendered = tok.apply_chat_template(CHATS[2])
    assert rendered.endswith(
        '<|im_start|>assistant\n4 {"ok": "ünï <&>"}<|im_end|>\n'
        "<|im_start|>user\nand 3+3? (last)<|im_end|>\n<|im_start|>assistant\n"
    )
    assert rendered.startswith("<|im_start|>system\nYou are helpful.<|im_end|>\n")


def test_chat_template_file_wins_and_generation_tag(tmp_path):
    d = write_bytelevel(tmp_path / "t", template="from config")
    (d / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}]{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    t = Tokenizer.from_pretrained(d)
    assert t.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user]hi[assistant]"
    hf = pytest.importorskip("transformers").PreTrainedTokenizerFast.from_pretrained(str(d))
    assert hf.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    ) == ("[user]hi[assistant]")


def test_template_exception_and_missing_template(tok, tmp_path):
    with pytest.raises(InputError, match="chat template rejected the messages: Unknown role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "beep"}])  # a role this template lacks
    with pytest.raises(InputError, match=r"messages\[0\].role is 'robot'; expected one of system"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])  # no Qwen template renders it
    bare = Tokenizer.from_pretrained(write_bytelevel(tmp_path / "bare", template=None))
    with pytest.raises(InputError, match="has no chat template"):
        bare.encode_chat([{"role": "user", "content": "hi"}])
    assert bare.encode("hi") == tok.encode("hi")


def test_broken_chat_template_is_a_checkpoint_error_not_a_row_error(tmp_path):
    d = write_bytelevel(
        tmp_path / "broken", template="{% for m in messages %}{{ m.content | nofilter }}{% endfor %}"
    )
    broken = Tokenizer.from_pretrained(d)
    with pytest.raises(ConfigError, match=r"broken: the chat template does not compile \(line 1: .*nofilter"):
        broken.encode_chat([{"role": "user", "content": "hi"}])
    assert broken.encode("hi") == Tokenizer.from_pretrained(write_bytelevel(tmp_path / "ok")).encode("hi")


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], r"messages must be a non-empty list .* got list \[\]"),
        ("hello", "messages must be a non-empty list .* got str 'hello'"),
        ([{"role": "user", "content": "a"}, "b"], r"messages\[1\] must be a dict .* got str 'b'"),
        ([{"content": "a"}], r"messages\[0\] has no 'role' key \(keys: \['content'\]\)"),
        ([{"role": "user"}], r"messages\[0\] has no 'content' key"),
        ([{"role": "user", "content": ["a"]}], r"messages\[0\].content must be a string, got list \['a'\]"),
        ([{"role": 3, "content": "a"}], r"messages\[0\].role must be a string, got int 3"),
        ([{"role": "", "content": "a"}], r"messages\[0\].role is ''; expected one of system, user"),
        ([{"role": "usr", "content": "a"}], r"messages\[0\].role is 'usr'; expected one of system, user"),
    ],
)
def test_malformed_messages(messages, match):
    with pytest.raises(InputError, match=match):
        validate_messages(messages)


def test_eos_ids_sources(tmp_path, tok):
    d = write_bytelevel(tmp_path / "e")
    im_end = tok.hf.token_to_id("<|im_end|>")
    assert Tokenizer.from_pretrained(d).eos_token_ids == [im_end]  # tokenizer's eos token
    (d / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": 7}}))
    assert Tokenizer.from_pretrained(d).eos_token_ids == [7]
    (d / "config.json").write_text(json.dumps({"eos_token_id": [5, 6], "text_config": {"eos_token_id": 7}}))
    assert Tokenizer.from_pretrained(d).eos_token_ids == [5, 6]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [11, 12]}))
    assert Tokenizer.from_pretrained(d).eos_token_ids == [11, 12]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 13}))
    assert Tokenizer.from_pretrained(d).eos_token_ids == [13]


@pytest.mark.parametrize(
    ("file", "content", "match"),
    [
        ("generation_config.json", [], "generation_config.json: expected a JSON object, found list"),
        ("tokenizer_config.json", "hi", "tokenizer_config.json: expected a JSON object, found str"),
        (
            "generation_config.json",
            {"eos_token_id": "x"},
            "eos_token_id must be a token id or a list of them",
        ),
        (
            "config.json",
            {"eos_token_id": [1, None]},
            r"config.json: eos_token_id must be .*found \[1, None\]",
        ),
    ],
)
def test_malformed_side_files_are_config_errors(tmp_path, file, content, match):
    d = write_bytelevel(tmp_path / "m")
    (d / file).write_text(json.dumps(content))
    with pytest.raises(ConfigError, match=match):
        Tokenizer.from_pretrained(d)


@pytest.mark.parametrize("file", ["generation_config.json", "tokenizer_config.json", "chat_template.jinja"])
def test_side_files_that_are_not_utf8_are_config_errors(tmp_path, file):
    d = write_bytelevel(tmp_path / "m")
    (d / file).write_bytes(b"\xff\xfe{}")
    message = rf"{file}: not (valid JSON|UTF-8 text) \('utf-8' codec can't decode"
    with pytest.raises(ConfigError, match=message):
        Tokenizer.from_pretrained(d)


def test_load_errors(tmp_path):
    with pytest.raises(ConfigError, match="no tokenizer.json found"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="tokenizer.json: cannot be read as a tokenizers file"):
        Tokenizer.from_pretrained(tmp_path)


def _stream(tok: Tokenizer, ids: list[int], prompt_ids=(), stop=()) -> tuple[list[str], str, bool]:
    detok = tok.detokenizer(prompt_ids, stop)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.finish())
    assert "".join(deltas) == detok.text
    return deltas, detok.text, detok.stopped


def test_partial_utf8_never_emits_replacement(tok):
    text = "naïve café 世界 🎉 ok 👍🏽!"
    ids = tok.encode(text)
    # The test means something only if single tokens are incomplete UTF-8.
    assert sum("\ufffd" in tok.decode([i]) for i in ids) >= 4
    deltas, out, stopped = _stream(tok, ids)
    assert out == text and not stopped
    assert not any("\ufffd" in d for d in deltas)
    assert "🎉" in deltas  # the emoji's bytes come out as one delta once the last byte lands


def test_incomplete_tail_and_invalid_bytes(tok):
    emoji = tok.encode("🎉")
    assert len(emoji) >= 2
    deltas, out, _ = _stream(tok, tok.encode("ok ") + emoji[:-1])  # generation ended mid-character
    assert out == "ok " + tok.decode(emoji[:-1]) and out.endswith("\ufffd")
    assert deltas[-1].endswith("\ufffd") and "\ufffd" not in "".join(deltas[:-1])
    # A stray continuation byte followed by text is not held back forever.
    stray = emoji[-1:]
    deltas, out, _ = _stream(tok, stray + tok.encode(" hello world"))
    assert out == "\ufffd hello world"
    assert "".join(deltas[:-1]) == out


def test_prompt_context_keeps_leading_space(tmp_path):
    t = Tokenizer.from_pretrained(write_metaspace(tmp_path / "m"))
    prompt = t.encode("hello")
    out = [t.hf.token_to_id("▁world")]
    assert t.decode(out) == "world"  # decoding alone strips the leading space
    _, text, _ = _stream(t, out, prompt_ids=prompt)
    assert text == " world"
    ids = t.encode("hello 世界")  # byte-fallback pieces <0xE4><0xB8><0x96>
    assert sum(t.hf.id_to_token(i).startswith("<0x") for i in ids) == 6
    deltas, text, _ = _stream(t, ids)
    assert text == "hello 世界" and not any("\ufffd" in d for d in deltas)


def test_stop_strings(tok):
    ids = tok.encode("The quick brown fox jumps over the lazy dog.")
    _, text, stopped = _stream(tok, ids, stop=["fox", "lazy"])
    assert (text, stopped) == ("The quick brown ", True)
    _, text, stopped = _stream(tok, ids, stop=["lazy", "quick"])  # the earliest occurrence wins
    assert (text, stopped) == ("The ", True)
    _, text, stopped = _stream(tok, ids, stop=["s over t"])  # spans several tokens
    assert (text, stopped) == ("The quick brown fox jump", True)
    _, text, stopped = _stream(tok, ids, stop=["dog!", ""])  # a prefix is held back, then released
    assert (text, stopped) == ("The quick brown fox jumps over the lazy dog.", False)
    detok = tok.detokenizer(stop=["dog!"])
    deltas = [detok.add(i) for i in tok.encode("over the lazy dog")]
    assert "".join(deltas) == "over the lazy "  # "dog" might be the start of "dog!"
    assert detok.finish() == "dog"


def test_stop_then_more_tokens_are_ignored(tok):
    detok = tok.detokenizer(stop=["\n"])
    for i in tok.encode("one\ntwo"):
        detok.add(i)
    assert detok.stopped and detok.text == "one"
    assert detok.add(tok.encode("x")[0]) == "" and detok.finish() == "" and detok.text == "one"


def test_stop_string_with_multibyte(tok):
    ids = tok.encode("café 世界 ok")
    _, text, stopped = _stream(tok, ids, stop=["世"])
    assert (text, stopped) == ("café ", True)


def test_parity_on_generated_checkpoint_tokenizer(tmp_path):
    """The tokenizer files `make-checkpoint` writes (Qwen2Tokenizer class) read the same in transformers."""
    from batchinfer.checkpoint.tokenizer_files import BUILTIN_CORPUS, build_tokenizer

    transformers = pytest.importorskip("transformers")
    build_tokenizer(BUILTIN_CORPUS, 600, tmp_path)
    ours = Tokenizer.from_pretrained(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.eos_token_ids == [hf.convert_tokens_to_ids("<|im_end|>")]
    for text in [*TEXTS, *BUILTIN_CORPUS]:
        assert ours.encode(text) == hf(text)["input_ids"], text
        assert ours.decode(ours.encode(text)) == hf.decode(hf(text)["input_ids"], skip_special_tokens=True)
    for chat in CHATS:
        ids = hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert ours.encode_chat(chat) == list(ids)
