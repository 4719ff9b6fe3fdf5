"""Writes a small Qwen-style byte-level BPE tokenizer (`tokenizer.json` + `tokenizer_config.json`).

Generated checkpoints need real tokenizer files so every code path that reads a Hugging Face
folder works without downloads. This trains a deterministic BPE on a given corpus (or a small
built-in one); it is not a copy of Qwen's 151k/248k vocabulary.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from batchinfer.errors import ConfigError

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
# Qwen2/3's pre-tokenizer split (contractions, letters, single digits, punctuation, newlines, spaces).
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
BUILTIN_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "Batch inference runs many prompts through one model and writes every answer to Parquet.",
    "A mixture-of-experts layer routes each token to a few experts and adds their weighted outputs.",
    "Hello! How can I help you today? Please summarise the following text in one sentence.",
    "Question: what is 12 + 30? Answer: 42. Question: what is the capital of France? Answer: Paris.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, i * 2))\n",
    '{"id": 17, "prompt": "Translate to German: good morning", "answer": "Guten Morgen"}',
    "Die Katze schläft auf dem Sofa. Le chat dort sur le canapé. El gato duerme en el sofá.",
    "日本語のテキストも少し含めます。中文文本也包括在内。한국어 문장도 있습니다.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2026-11-30 12:00 UTC",
    "<think>Let me think step by step about the problem before answering.</think>",
    "Emoji and symbols: 🙂 🚀 ✓ € £ ¥ © ® ± × ÷ → ← ∑ ∞",
)


def train_tokenizer(corpus: Iterable[str], vocab_size: int) -> Tokenizer:
    """The tokenizer `build_tokenizer` writes, in memory (see there for the id layout)."""
    texts = [t for t in corpus if t]
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ConfigError(
            f"vocab_size {vocab_size} is too small for a byte-level tokenizer: need at least "
            f"{256 + len(SPECIAL_TOKENS)} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)"
        )
    if not texts:
        raise ConfigError("build_tokenizer: the corpus is empty; give at least one non-empty text")
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def build_tokenizer(corpus: Iterable[str], vocab_size: int, out_dir: str | Path) -> None:
    """Train a byte-level BPE on `corpus` and write `tokenizer.json` and `tokenizer_config.json`.

    Ids: 256 byte tokens first, then merges, then `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`.
    The total never exceeds `vocab_size` (the model's embedding rows); a small corpus yields
    fewer merges, and the special tokens then sit right after the last merge. Same corpus and
    size -> byte-identical files.
    """
    tok = train_tokenizer(corpus, vocab_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


@functools.cache
def builtin_special_ids(vocab_size: int) -> dict[str, int]:
    """Special-token ids of the built-in-corpus tokenizer of a given size (generated checkpoints' EOS)."""
    tok = train_tokenizer(BUILTIN_CORPUS, vocab_size)
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
