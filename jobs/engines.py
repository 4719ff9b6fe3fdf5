"""Finding the engine a plan names (`module:factory`) and loading it only when work needs it.

The default factory is `batchinfer.engine.loader:load_engine`; `--engine module:factory` plugs in any
other object with `describe()` and `generate()` (engine/api.py's TextEngine), e.g. the model-free
`batchinfer.jobs.echo:EchoEngine` for dry runs. The factory is called as `factory(model_path, **args)`
with the plan's string arguments (`--engine-arg KEY=VALUE`). A factory may carry `check_args(**args)`,
which checks their values without a model or a GPU, and `check_model(model_path)`, which checks the
checkpoint's files without loading its weights; both run before a plan records them.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from batchinfer.engine.api import TextEngine, TextRequest, TextResult
from batchinfer.errors import ConfigError

log = logging.getLogger(__name__)


def resolve_factory(spec: str) -> Callable[..., TextEngine]:
    """Import `module:attribute`."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"--engine {spec!r}: expected MODULE:FACTORY, e.g. batchinfer.jobs.echo:EchoEngine")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"--engine {spec!r}: cannot import module {module!r} ({e})") from None
    try:
        return getattr(mod, attr)
    except AttributeError:
        raise ConfigError(f"--engine {spec!r}: module {module!r} has no attribute {attr!r}") from None


def check_args(spec: str, args: dict[str, Any]) -> Callable[..., TextEngine]:
    """The factory `spec` names, after checking it accepts `factory(model_path, **args)` and, where it has
    its own `check_args`, their values: a mistyped `--engine-arg` name or value is refused before a plan
    records it (correcting it later would change the plan), not at load."""
    factory = resolve_factory(spec)
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # builtins and C callables: nothing to check against
        return factory
    try:
        signature.bind("model_path", **args)
    except TypeError as e:
        known = [
            p.name
            for p in list(signature.parameters.values())[1:]  # the first one takes the model path
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        raise ConfigError(
            f"--engine-arg for {spec}: {e}; it accepts {', '.join(known) or 'no arguments'}"
        ) from None
    check_values = getattr(factory, "check_args", None)
    if callable(check_values):
        check_values(**args)
    return factory


def check_model(spec: str, model_path: str) -> None:
    """The factory's own `check_model(model_path)`, where it has one: a checkpoint it could never load
    (no tokenizer, no weights) is refused before a plan records its files (adding them later changes them,
    and with them the plan)."""
    check = getattr(resolve_factory(spec), "check_model", None)
    if callable(check):
        check(model_path)


def check_args_here(spec: str, args: dict[str, Any]) -> None:
    """`check_args` for a run that starts on this machine now. Where the factory's check takes `device` and
    this machine has no CUDA GPU, a CUDA device is refused and a device left to the engine is checked as
    the CPU it would pick, so that an argument this machine's engine would refuse at load stops before a
    plan records it. A plan made for another machine (`--plan-only`, `--gpus`, Slurm) gets `check_args`."""
    check = getattr(check_args(spec, args), "check_args", None)
    if not callable(check) or "device" not in inspect.signature(check).parameters:
        return
    import torch

    if torch.cuda.is_available():
        return
    device = str(args.get("device") or "auto")
    if device.startswith("cuda"):
        raise ConfigError(f"--engine-arg device={device}: this machine has no CUDA GPU")
    if device != "auto":
        return
    try:
        check(**{**args, "device": "cpu"})
    except ConfigError as e:
        raise ConfigError(
            f"{e}; this machine has no CUDA GPU, so device=auto is its CPU and engine=auto the reference "
            "engine (make the plan with --plan-only and run it on a GPU machine, or drop the argument)"
        ) from None


def parse_args(pairs: Sequence[str]) -> dict[str, str]:
    """`KEY=VALUE` strings into a dict."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--engine-arg {pair!r}: expected KEY=VALUE")
        out[key] = value
    return out


class LazyEngine:
    """A TextEngine that builds the real one on first use, so a runner that finds every shard done or
    locked (a cron rerun) never loads the model."""

    def __init__(self, factory: str, model_path: str, args: dict[str, Any] | None = None) -> None:
        self.factory = factory
        self.model_path = model_path
        self.args = dict(args or {})
        self._engine: TextEngine | None = None

    @property
    def loaded(self) -> bool:
        return self._engine is not None

    def get(self) -> TextEngine:
        if self._engine is None:
            t0 = time.monotonic()
            self._engine = check_args(self.factory, self.args)(self.model_path, **self.args)
            log.info(
                "loaded engine %s for %s in %.1f s", self.factory, self.model_path, time.monotonic() - t0
            )
        return self._engine

    def describe(self) -> dict[str, str]:
        return self.get().describe()

    def generate(
        self, requests: Sequence[TextRequest], on_tokens: Callable[[int], None] | None = None
    ) -> Iterator[TextResult]:
        return self.get().generate(requests, on_tokens)
