"""A model-free engine for dry runs: checks a job's inputs, sharding and outputs without a GPU.

`batchinfer run ... --engine batchinfer.jobs.echo:EchoEngine` runs the whole job layer with this engine in
place of the model: it "generates" the prompt's words in reverse order (shuffled by the row's seed when
temperature > 0), cut at max_tokens words, and judges rows like a real engine does (empty prompt and
over-long prompt -> skipped). Options (`--engine-arg KEY=VALUE`) let a user or a test rehearse failures:
`delay` seconds per row, `fail_marker` (rows containing it come back as error rows), `crash_marker`
(a row containing it makes the engine raise, as a dead engine would), `max_context` words.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence

from batchinfer.engine.api import TextRequest, TextResult
from batchinfer.errors import ConfigError


class EchoEngine:
    def __init__(
        self,
        model_path: str,
        delay: str = "0",
        fail_marker: str = "",
        crash_marker: str = "",
        max_context: str = "2048",
    ) -> None:
        self.model_path = str(model_path)
        self.delay, self.max_context = self.check_args(delay=delay, max_context=max_context)
        self.fail_marker = fail_marker
        self.crash_marker = crash_marker

    @staticmethod
    def check_args(delay: str = "0", max_context: str = "2048", **_markers: str) -> tuple[float, int]:
        """The numeric options parsed, or a ConfigError naming the bad one (run by jobs.engines.check_args
        before a plan records them)."""
        try:
            seconds = float(delay)
        except ValueError:
            seconds = -1.0
        if not seconds >= 0:  # also refuses nan
            raise ConfigError(f"--engine-arg delay={delay}: expected seconds >= 0")
        try:
            words = int(max_context)
        except ValueError:  # also "²", which isdigit() takes for a digit
            words = 0
        if words < 1:
            raise ConfigError(f"--engine-arg max_context={max_context}: expected a whole number >= 1")
        return seconds, words

    def describe(self) -> dict[str, str]:
        return {"engine": "echo", "model": self.model_path, "quantization": "none", "device": "cpu"}

    def generate(
        self, requests: Sequence[TextRequest], on_tokens: Callable[[int], None] | None = None
    ) -> Iterator[TextResult]:
        for req in requests:
            if self.delay:
                time.sleep(self.delay)
            result = self._one(req)
            if on_tokens and result.output_tokens:
                on_tokens(result.output_tokens)
            yield result

    def _one(self, req: TextRequest) -> TextResult:
        text = req.prompt if req.prompt is not None else "\n".join(m["content"] for m in req.messages or [])
        words = text.split()
        if self.crash_marker and self.crash_marker in text:
            raise RuntimeError(
                f"echo engine crashed on request {req.index} (crash_marker {self.crash_marker!r})"
            )
        if not words:
            return TextResult(req.index, "", "skipped", 0, 0, error="empty prompt")
        if len(words) > self.max_context:
            return TextResult(
                req.index,
                "",
                "skipped",
                len(words),
                0,
                error=f"prompt has {len(words)} tokens, beyond the context length {self.max_context}",
            )
        if self.fail_marker and self.fail_marker in text:
            return TextResult(
                req.index, "", "error", len(words), 0, error="echo engine failed the row (fail_marker)"
            )
        out = words[::-1]
        if req.sampling.temperature > 0:
            random.Random(req.sampling.seed).shuffle(out)
        finish = "length" if len(out) > req.sampling.max_tokens else "stop"
        out = out[: req.sampling.max_tokens]
        return TextResult(req.index, " ".join(out), finish, len(words), len(out))
