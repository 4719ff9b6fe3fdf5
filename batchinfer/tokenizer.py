"""Tokenizer of a checkpoint folder: `tokenizer.json`, its chat template, EOS ids and incremental decoding.

Works from the files alone (the `tokenizers` library and jinja2), so run time never needs
transformers; chat templates render the way transformers' `apply_chat_template` renders them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from batchinfer.errors import ConfigError, InputError

log = logging.getLogger(__name__)

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# Prompt tokens kept in front of the output when decoding, so a first output token decodes with
# the spacing it has in context (SentencePiece decoders strip a leading space at the start).
_CONTEXT_TOKENS = 5


class _GenerationTag(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` (assistant-mask markers) and render the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # jinja's own tojson HTML-escapes; chat templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandboxed environment transformers uses (same globals and filters)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


# The roles Qwen's chat templates render; a message with any other role is left out of the prompt without
# a word, so it is refused instead.
CHAT_ROLES = ("system", "user", "assistant", "tool")


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check a chat is a non-empty list of {role: str, content: str} dicts; InputError names the fault."""
    if not isinstance(messages, list) or not messages:
        raise InputError(
            f"messages must be a non-empty list of {{role, content}} dicts, got {_brief(messages)}"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InputError(f"messages[{i}] must be a dict with 'role' and 'content', got {_brief(m)}")
        for key in ("role", "content"):
            if key not in m:
                raise InputError(f"messages[{i}] has no {key!r} key (keys: {sorted(m)})")
            if not isinstance(m[key], str):
                raise InputError(f"messages[{i}].{key} must be a string, got {_brief(m[key])}")
        if m["role"] not in CHAT_ROLES:
            raise InputError(unknown_role(i, m["role"]))
    return messages


def unknown_role(i: int, role: str) -> str:
    return f"messages[{i}].role is {role!r}; expected one of {', '.join(CHAT_ROLES)}"


def _brief(x: Any) -> str:
    text = repr(x)
    return f"{type(x).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a JSON object, found {type(doc).__name__}")
    return doc


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json gives special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _eos_list(value: Any, where: Path) -> list[int] | None:
    if value is None:
        return None
    ids = [value] if isinstance(value, int) else value
    if not isinstance(ids, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in ids):
        raise ConfigError(f"{where}: eos_token_id must be a token id or a list of them, found {value!r}")
    return ids


class Tokenizer:
    """Encode prompts, render chats, know the EOS ids, and make incremental detokenizers."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        special_tokens: dict[str, str],
        chat_template: str | None,
        eos_token_ids: list[int],
        source: str = "<memory>",
    ) -> None:
        self.hf = tokenizer
        self.special_tokens = (
            special_tokens  # bos_token / eos_token / ... -> token text, as the template sees them
        )
        self.chat_template = chat_template
        self.eos_token_ids = eos_token_ids
        self.source = source

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load from a checkpoint folder: tokenizer.json, tokenizer_config.json, chat_template.jinja,
        generation_config.json and config.json (the last three optional)."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ConfigError(
                f"{file}: no tokenizer.json found (is {path} a Hugging Face checkpoint folder?)"
            )
        try:
            hf = _HFTokenizer.from_file(str(file))
        except Exception as e:  # the tokenizers library raises plain Exception on bad files
            raise ConfigError(f"{file}: cannot be read as a tokenizers file ({e})") from None
        cfg = {**_read_json(path / "special_tokens_map.json"), **_read_json(path / "tokenizer_config.json")}
        special = {k: v for k in SPECIAL_TOKEN_KEYS if (v := _token_content(cfg.get(k))) is not None}
        template = cls._find_template(path, cfg.get("chat_template"))
        eos = cls._find_eos(path, hf, special)
        if not eos:
            log.warning(
                "%s: no EOS token id in generation_config.json, config.json or tokenizer_config.json; "
                "generation stops only at max_tokens or stop strings",
                path,
            )
        return cls(hf, special, template, eos, source=str(path))

    @staticmethod
    def _find_template(path: Path, value: Any) -> str | None:
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():  # transformers lets the separate file win over the config entry
            try:
                return jinja_file.read_text()
            except UnicodeDecodeError as e:
                raise ConfigError(f"{jinja_file}: not UTF-8 text ({e})") from None
        if isinstance(value, list):  # named templates: [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
            return named.get("default")
        return value if isinstance(value, str) else None

    @staticmethod
    def _find_eos(path: Path, hf: _HFTokenizer, special: dict[str, str]) -> list[int]:
        gen_file = path / "generation_config.json"
        gen = _eos_list(_read_json(gen_file).get("eos_token_id"), gen_file)
        if gen is not None:
            return gen
        config = _read_json(path / "config.json")
        text = config.get("text_config") or {}
        cfg = _eos_list(config.get("eos_token_id", text.get("eos_token_id")), path / "config.json")
        if cfg is not None:
            return cfg
        eos = special.get("eos_token")
        token_id = hf.token_to_id(eos) if eos is not None else None
        return [] if token_id is None else [token_id]

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a plain prompt; special tokens added as the tokenizer's post-processor says."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise InputError(
                f"{self.source}: the tokenizer has no chat template (no chat_template in "
                "tokenizer_config.json and no chat_template.jinja), so chat messages cannot be rendered; "
                "give plain prompts instead"
            )
        try:
            return compile_chat_template(self.chat_template)
        except jinja2.exceptions.TemplateSyntaxError as e:
            # A broken checkpoint, not a bad row: every chat would fail the same way.
            raise ConfigError(
                f"{self.source}: the chat template does not compile (line {e.lineno}: {e.message})"
            ) from None

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True) -> str:
        """Render validated chat messages to the prompt text the model was trained on."""
        messages = validate_messages(messages)
        try:
            return self._compiled_template.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.exceptions.TemplateError as e:
            raise InputError(f"chat template rejected the messages: {e}") from None

    def encode_chat(self, messages: Any, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a rendered chat (the template writes any special tokens itself)."""
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False
        )

    def detokenizer(self, prompt_ids: Sequence[int] = (), stop: Sequence[str] = ()) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, stop)


class IncrementalDetokenizer:
    """Turns output tokens into text one token at a time.

    Each `add` decodes a short window of ids and returns only text that is final: text ending in an
    incomplete UTF-8 sequence (decoded as U+FFFD) waits for the token that completes it, and text
    that could be the start of a stop string waits until it can no longer be. Once a stop string
    appears, `text` ends just before it and `stopped` is True.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), stop: Sequence[str] = ()
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        if tokenizer.decode(self._ids).endswith("\ufffd"):  # a prompt ending mid-character gives no context
            self._ids = []
        self._prefix = 0  # window start: ids before it are already decoded into _decoded
        self._read = len(self._ids)  # ids before this are decoded
        self._decoded = ""  # all text decoded so far (stop strings not yet applied)
        self.text = ""  # final text handed out so far
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Append one token; return the newly final text (possibly empty)."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        prefix_text = self.tokenizer.decode(self._ids[self._prefix : self._read])
        new_text = self.tokenizer.decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._decoded += new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self._ids)
        return self._release(final=False)

    def finish(self) -> str:
        """End of generation: release held-back text (an incomplete trailing character stays U+FFFD)."""
        if not self.stopped and self._read < len(self._ids):
            prefix_text = self.tokenizer.decode(self._ids[self._prefix : self._read])
            self._decoded += self.tokenizer.decode(self._ids[self._prefix :])[len(prefix_text) :]
            self._read = len(self._ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        # Released text never ends in a stop-string prefix, so a stop string can only start after it.
        hits = [i for s in self.stop if (i := self._decoded.find(s, len(self.text))) >= 0]
        if hits:
            end, self.stopped = min(hits), True
        elif final:
            end = len(self._decoded)
        else:
            end = len(self._decoded) - self._held_back()
        delta = self._decoded[len(self.text) : end]
        self.text += delta
        return delta

    def _held_back(self) -> int:
        """Length of the longest tail of the decoded text that is a proper prefix of some stop string."""
        tail = self._decoded[len(self.text) :]
        for n in range(min(len(tail), max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            if any(s.startswith(tail[-n:]) for s in self.stop):
                return n
        return 0
