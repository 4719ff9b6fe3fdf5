"""`batchinfer generate`: try a model on a few prompts or chats and print the completions."""

from __future__ import annotations

import json
from typing import Any

import click

from batchinfer.errors import InputError


def _read_chats(file: str) -> list[list[dict[str, Any]]]:
    """One chat (a list of messages) or a list of chats, from a JSON file or `-` for stdin."""
    name = "stdin" if file == "-" else file
    try:
        with click.open_file(file, encoding="utf-8") as f:  # "-" is stdin
            text = f.read()
    except UnicodeDecodeError as e:
        raise InputError(f"{name}: not UTF-8 text ({e})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{name}: not valid JSON ({e})") from None
    if isinstance(data, list) and data and all(isinstance(m, dict) for m in data):
        return [data]
    if isinstance(data, list) and data and all(isinstance(c, list) for c in data):
        return data
    raise InputError(
        f"{name}: expected one chat [{{'role': ..., 'content': ...}}, ...] or a list of chats, "
        f"got {type(data).__name__}{' (empty)' if data == [] else ''}"
    )


@click.command()
@click.option(
    "--model",
    "model_path",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="Checkpoint folder (config.json, safetensors, tokenizer.json).",
)
@click.option("--prompt", "prompts", multiple=True, help="A plain prompt; repeat for several.")
@click.option(
    "--messages-json",
    type=click.Path(exists=True, allow_dash=True, dir_okay=False),
    help="JSON file with one chat (list of {role, content}) or a list of chats; - for stdin.",
)
@click.option(
    "--max-tokens",
    default=128,
    show_default=True,
    type=click.IntRange(min=1),
    help="Most tokens to generate per completion.",
)
@click.option(
    "--temperature",
    default=0.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Sampling temperature; 0 is greedy.",
)
@click.option(
    "--top-p",
    default=1.0,
    show_default=True,
    type=click.FloatRange(0, 1, min_open=True),
    help="Nucleus sampling: keep the smallest set of tokens with this much probability.",
)
@click.option(
    "--top-k",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="Keep only the k most likely tokens; 0 keeps all.",
)
@click.option(
    "--seed",
    default=0,
    show_default=True,
    type=int,
    help="Sampling seed; completion i uses seed+i, so each is reproducible on its own.",
)
@click.option("--stop", multiple=True, help="Stop string (cut from the output); repeat for several.")
@click.option(
    "--device",
    default="auto",
    show_default=True,
    help="auto (CUDA if available, else CPU), cpu, cuda or cuda:N.",
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16"]),
    help="Activation dtype; default float32 on CPU, bfloat16 on GPU.",
)
@click.option(
    "--max-model-len",
    type=click.IntRange(min=1),
    help="Context limit (prompt + max tokens); default the model's max_position_embeddings.",
)
def generate(
    model_path: str,
    prompts: tuple[str, ...],
    messages_json: str | None,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int,
    stop: tuple[str, ...],
    device: str,
    dtype: str | None,
    max_model_len: int | None,
) -> None:
    """Generate completions for prompts or chat messages and print them.

    A quick way to try a checkpoint: each completion is printed under a header with its finish
    reason and token counts. Rows that cannot run (too long for the context, malformed chat) are
    printed with the reason and the command exits 1. Ctrl-C prints the completions the engine had
    returned and exits 130 (engines return a batch's completions when its last row ends, so one batch
    of prompts interrupted prints none).

    \b
    Examples:
      batchinfer generate --model ckpt --prompt "The capital of France is" --max-tokens 16
      batchinfer generate --model ckpt --messages-json chat.json --temperature 0.7 --seed 3
    """
    if not prompts and not messages_json:
        raise click.UsageError("give at least one --prompt or a --messages-json file")
    from batchinfer.engine.api import SamplingParams, TextRequest, TextResult
    from batchinfer.engine.loader import load_engine

    chats = _read_chats(messages_json) if messages_json else []
    inputs: list[dict[str, Any]] = [{"prompt": p} for p in prompts] + [{"messages": c} for c in chats]
    try:
        requests = [
            TextRequest(
                index=i,
                sampling=SamplingParams(
                    max_tokens=max_tokens,
                    temperature=temperature,
                    top_p=top_p,
                    top_k=top_k,
                    seed=seed + i,
                    stop=list(stop),
                ),
                **inp,
            )
            for i, inp in enumerate(inputs)
        ]
    except ValueError as e:  # nan and inf, which click's ranges let through
        raise click.UsageError(f"sampling parameters: {e}") from None
    engine = load_engine(model_path, device=device, dtype=dtype, max_model_len=max_model_len)
    facts = engine.describe()
    click.echo(
        f"# {facts['model']} ({facts['quantization']}, {facts['engine']} engine, {facts['device']}, "
        f"{facts['dtype']})",
        err=True,
    )
    from tqdm import tqdm

    failed = 0
    done: list[TextResult] = []
    interrupted = False
    with tqdm(
        total=max_tokens * len(requests), unit="tok", desc="generating", leave=False, disable=None
    ) as bar:
        try:
            for r in engine.generate(requests, on_tokens=bar.update):
                done.append(r)
        except KeyboardInterrupt:  # Ctrl-C: the completions returned so far are still printed
            interrupted = True
    for r in sorted(done, key=lambda r: r.index):
        click.echo(
            f"=== [{r.index}] {r.finish_reason}: {r.prompt_tokens} prompt + {r.output_tokens} output tokens"
        )
        if r.error:
            failed += 1
            click.echo(f"{r.finish_reason}: {r.error}")
        else:
            click.echo(r.text)
    if interrupted:
        click.echo(
            f"interrupted: {len(requests) - len(done)} of {len(requests)} completions unfinished", err=True
        )
        raise SystemExit(130)
    if failed:
        raise SystemExit(1)
