"""`batchinfer make-checkpoint`: write a seeded random checkpoint in real Hugging Face format."""

from __future__ import annotations

from pathlib import Path

import click

from batchinfer.errors import CheckpointError

PRESETS = ("qwen3.6-35b-a3b", "qwen3-30b-a3b", "tiny-qwen3.5-moe", "tiny-qwen3-moe")


def check_out_dir(out: Path, force: bool) -> None:
    """Refuse to write into a folder that already holds a checkpoint (unless --force) or that cannot be
    created, before any weights are drawn or quantized."""
    if out.is_file():
        raise CheckpointError(f"{out}: exists and is a file; expected a folder")
    if not force and out.is_dir() and any(out.glob("*.safetensors")) | (out / "config.json").exists():
        raise CheckpointError(f"{out}: already holds a checkpoint; pass --force to overwrite it")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{out}: cannot create the folder ({e.strerror or e})") from None


def describe(out: Path) -> str:
    """'5 files, 12.3 MB' for the summary line."""
    files = [p for p in out.iterdir() if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    return (
        f"{len(files)} files, {size / 1e9:.2f} GB"
        if size >= 1e9
        else f"{len(files)} files, {size / 1e6:.2f} MB"
    )


def check_device(device: str) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise CheckpointError("--device cuda: no CUDA GPU is available on this machine; use --device cpu")


@click.command("make-checkpoint")
@click.option(
    "--preset", required=True, type=click.Choice(PRESETS), help="Architecture and size (see above)."
)
@click.option(
    "--out", "out", required=True, type=click.Path(path_type=Path), help="Folder to write (created)."
)
@click.option(
    "--quant",
    default="bf16",
    show_default=True,
    type=click.Choice(["bf16", "nvfp4", "mixed"]),
    help="bf16: unquantized. nvfp4 / mixed: ModelOpt layout, same schemes as `batchinfer quantize`.",
)
@click.option("--seed", default=0, show_default=True, type=int, help="Random seed of the weights.")
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    type=click.Choice(["cpu", "cuda"]),
    help="Where the weights are drawn and quantized; use cuda for the real-shape presets.",
)
@click.option("--force", is_flag=True, help="Overwrite a checkpoint already in --out.")
def make_checkpoint_command(preset: str, out: Path, quant: str, seed: int, device: str, force: bool) -> None:
    """Write a complete checkpoint with seeded random weights: config.json, generation_config.json,
    safetensors (5 GB shards + index when larger), tokenizer.json and tokenizer_config.json, and for
    quantized output hf_quant_config.json.

    \b
    Presets:
      qwen3.6-35b-a3b   Qwen3.6-35B-A3B shapes (qwen3_5_moe, 40 layers, 256 experts): ~70 GB in bf16
      qwen3-30b-a3b     Qwen3-30B-A3B shapes (qwen3_moe, 48 layers, 128 experts): ~61 GB in bf16
      tiny-qwen3.5-moe  hidden 64, 4 layers (3 DeltaNet + 1 attention), 8 experts top-2, vocab 512
      tiny-qwen3-moe    hidden 64, 4 layers, 8 experts top-2, vocab 512

    Qwen3.5 bf16 checkpoints use the official layout (vision-language config with text_config,
    model.language_model. prefix, fused 3-D experts); quantized ones use per-expert tensors, as
    NVIDIA's do. The tokenizer is a small byte-level BPE trained on a built-in corpus, so token
    ids (BOS/EOS) differ from the real models'. Same seed and device give the same weights.
    """
    from batchinfer.checkpoint.presets import write_preset

    check_out_dir(out, force)
    check_device(device)
    write_preset(preset, out, quant=quant, seed=seed, device=device)
    click.echo(f"wrote {out}: preset {preset}, {quant}, seed {seed}; {describe(out)}")
