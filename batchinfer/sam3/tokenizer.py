"""OpenAI-CLIP byte-level BPE tokenizer, as SAM 3's text encoder uses it (`sam3/model/tokenizer_ve.py`).

The vocabulary is the MIT-licensed `bpe_simple_vocab_16e6.txt.gz` shipped in this package: 256 byte
symbols, the same with an end-of-word mark `</w>`, 48,894 merges, then `<start_of_text>` (49406) and
`<end_of_text>` (49407). Meta's cleaning ("lower") is ftfy.fix_text, double html.unescape, whitespace
collapse and lower-casing. We do the ftfy fixes that change real prompts (NFC, curly quotes to
straight ones, Latin ligatures, full-width forms, control characters) without ftfy itself; its
mojibake repair is left out. The pre-tokenizer is Meta's regex
`'s|'t|'re|'ve|'m|'ll|'d|[\\p{L}]+|[\\p{N}]|[^\\s\\p{L}\\p{N}]+` written out with `unicodedata`
categories, so neither ftfy nor `regex` is a run-time dependency.
"""

from __future__ import annotations

import gzip
import html
import unicodedata
from functools import lru_cache
from importlib import resources
from pathlib import Path

import torch

SOT_TOKEN = "<start_of_text>"
EOT_TOKEN = "<end_of_text>"
_NUM_MERGES = 49152 - 256 - 2  # open_clip's cut: merges[1 : 49152 - 256 - 2 + 1]
_CONTRACTIONS = ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d")


@lru_cache
def bytes_to_unicode() -> dict[int, str]:
    """CLIP's reversible map from the 256 byte values to printable unicode characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs], strict=True))


# ftfy's fix_latin_ligatures and uncurl_quotes tables (applied in that order, as ftfy does).
_LIGATURES = str.maketrans(
    {
        "\u0132": "IJ", "\u0133": "ij", "\u0149": "\u02bcn", "\u01f1": "DZ", "\u01f2": "Dz", "\u01f3": "dz",
        "\u01c4": "D\u017d", "\u01c5": "D\u017e", "\u01c6": "d\u017e", "\u01c7": "LJ", "\u01c8": "Lj",
        "\u01c9": "lj", "\u01ca": "NJ", "\u01cb": "Nj", "\u01cc": "nj", "\ufb00": "ff", "\ufb01": "fi",
        "\ufb02": "fl", "\ufb03": "ffi", "\ufb04": "ffl", "\ufb05": "\u017ft", "\ufb06": "st",
    }
)  # fmt: skip
_QUOTES = str.maketrans(
    {**dict.fromkeys("\u02bc\u2018\u2019\u201a\u201b", "'"), **dict.fromkeys("\u201c\u201d\u201e\u201f", '"')}
)


def _ftfy_lite(text: str) -> str:
    """The parts of ftfy.fix_text's defaults that matter for prompts (not its mojibake repair)."""
    text = text.translate(_LIGATURES)
    # fix_character_width: full-width ASCII and the ideographic space to their normal forms.
    text = "".join(
        unicodedata.normalize("NFKC", c) if c == "\u3000" or "\uff01" <= c <= "\uffee" else c for c in text
    )
    text = text.translate(_QUOTES)
    # remove_control_chars (whitespace controls survive; the whitespace collapse handles them).
    text = "".join(c for c in text if c.isspace() or unicodedata.category(c) != "Cc")
    return unicodedata.normalize("NFC", text)


def clean_text(text: str) -> str:
    """Meta's "lower" cleaning (see the module docstring for what differs from ftfy)."""
    text = html.unescape(html.unescape(_ftfy_lite(text))).strip()
    return " ".join(text.split()).lower()


def _is_letter(ch: str) -> bool:
    return unicodedata.category(ch).startswith("L")


def _is_number(ch: str) -> bool:
    return unicodedata.category(ch).startswith("N")


def pre_tokenize(text: str) -> list[str]:
    """Split cleaned text into words exactly as CLIP's regex does."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch.isspace():
            i += 1
            continue
        special = next((s for s in (SOT_TOKEN, EOT_TOKEN) if text.startswith(s, i)), None)
        if special is not None:
            out.append(special)
            i += len(special)
            continue
        contraction = next((c for c in _CONTRACTIONS if text[i : i + len(c)].lower() == c), None)
        if contraction is not None:
            out.append(text[i : i + len(contraction)])
            i += len(contraction)
            continue
        if _is_letter(ch):
            j = i + 1
            while j < n and _is_letter(text[j]):
                j += 1
        elif _is_number(ch):
            j = i + 1
        else:
            j = i + 1
            while j < n and not (text[j].isspace() or _is_letter(text[j]) or _is_number(text[j])):
                j += 1
        out.append(text[i:j])
        i = j
    return out


class ClipTokenizer:
    """Text -> CLIP token ids; `__call__` pads/truncates to a fixed context as SAM 3 does."""

    def __init__(self, vocab_path: str | Path | None = None) -> None:
        if vocab_path is None:
            data = resources.files("batchinfer.sam3").joinpath("bpe_simple_vocab_16e6.txt.gz").read_bytes()
        else:
            data = Path(vocab_path).read_bytes()
        lines = gzip.decompress(data).decode("utf-8").split("\n")[1 : _NUM_MERGES + 1]
        merges = [tuple(line.split()) for line in lines]
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        vocab = list(self.byte_encoder.values())
        vocab += [v + "</w>" for v in vocab]
        vocab += ["".join(m) for m in merges]
        vocab += [SOT_TOKEN, EOT_TOKEN]
        self.encoder = {tok: i for i, tok in enumerate(vocab)}
        self.decoder = {i: tok for tok, i in self.encoder.items()}
        self.bpe_ranks = {m: i for i, m in enumerate(merges)}
        self.sot_token_id = self.encoder[SOT_TOKEN]
        self.eot_token_id = self.encoder[EOT_TOKEN]
        self._cache: dict[str, list[str]] = {SOT_TOKEN: [SOT_TOKEN], EOT_TOKEN: [EOT_TOKEN]}

    @property
    def vocab_size(self) -> int:
        return len(self.encoder)

    def bpe(self, word: str) -> list[str]:
        """Merge one pre-token (already byte-mapped) into BPE symbols, lowest merge rank first."""
        if word in self._cache:
            return self._cache[word]
        symbols = list(word[:-1]) + [word[-1] + "</w>"]
        while len(symbols) > 1:
            pairs = {(a, b) for a, b in zip(symbols, symbols[1:], strict=False)}
            best = min(pairs, key=lambda p: self.bpe_ranks.get(p, float("inf")))
            if best not in self.bpe_ranks:
                break
            merged: list[str] = []
            i = 0
            while i < len(symbols):
                if i < len(symbols) - 1 and (symbols[i], symbols[i + 1]) == best:
                    merged.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        self._cache[word] = symbols
        return symbols

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` without start/end tokens."""
        ids: list[int] = []
        for word in pre_tokenize(clean_text(text)):
            mapped = "".join(self.byte_encoder[b] for b in word.encode("utf-8"))
            ids.extend(self.encoder[s] for s in self.bpe(mapped))
        return ids

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`; every end-of-word mark becomes a space (CLIP's decode)."""
        text = "".join(self.decoder[i] for i in ids)
        raw = bytearray(self.byte_decoder[c] for c in text)
        return raw.decode("utf-8", errors="replace").replace("</w>", " ")

    def __call__(self, texts: list[str], context_length: int) -> torch.Tensor:
        """int64 [len(texts), context_length]: start, ids, end, zero padding. Over-long prompts keep
        their first context_length - 1 tokens and end with the end token (Meta's truncation)."""
        out = torch.zeros(len(texts), context_length, dtype=torch.long)
        for row, text in enumerate(texts):
            ids = [self.sot_token_id, *self.encode(text), self.eot_token_id]
            if len(ids) > context_length:
                ids = ids[:context_length]
                ids[-1] = self.eot_token_id
            out[row, : len(ids)] = torch.tensor(ids)
        return out
