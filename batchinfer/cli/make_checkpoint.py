"""`batchinfer make-checkpoint`: write a seeded random checkpoint in real Hugging Face format."""

from __future__ import annotations

from pathlib import Path

import click

from batchinfer.cli.options import output_folder
from batchinfer.errors import CheckpointError

PRESETS = ("qwen3.6-35b-a3b", "qwen3-30b-a3b", "tiny-qwen3.5-moe", "tiny-qwen3-moe", "sam3", "tiny-sam3")
SAM3_PRESETS = ("sam3", "tiny-sam3")


def holds_checkpoint(folder: Path) -> bool:
    """A Hugging Face checkpoint (config.json, safetensors) or Meta's sam3.pt."""
    return (folder / "config.json").exists() or any(
        next(folder.glob(p), None) for p in ("*.safetensors", "*.pt")
    )


def check_out_dir(out: Path, force: bool) -> None:
    """Before any weights are drawn: refuse a folder that cannot be created, a non-empty one that holds no
    checkpoint (nothing is written among a user's files), and one that holds a checkpoint unless --force,
    which removes that checkpoint's files (those at its top level a checkpoint is made of: config, weights,
    tokenizer, chat template) so none is left beside the new one; a README or a training log stays."""
    from batchinfer.jobs.plan import MODEL_FILE_SUFFIXES

    if out.is_file():
        raise CheckpointError(f"{out}: exists and is a file; expected a folder")
    if out.is_dir() and any(out.iterdir()):
        if not holds_checkpoint(out):
            raise CheckpointError(
                f"{out}: is not empty and holds no checkpoint; expected a new or empty folder (or a "
                "checkpoint to replace with --force)"
            )
        if not force:
            raise CheckpointError(f"{out}: already holds a checkpoint; pass --force to replace it")
        for path in out.iterdir():
            if (path.is_file() or path.is_symlink()) and path.suffix in MODEL_FILE_SUFFIXES:
                path.unlink()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{out}: cannot create the folder ({e.strerror or e})") from None


def describe(out: Path) -> str:
    """'5 files, 12.3 MB' (the files at the folder's top level) for the summary line."""
    files = [p for p in out.iterdir() if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    amount = f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.2f} MB"
    return f"{len(files)} file{'s' if len(files) != 1 else ''}, {amount}"


def check_device(device: str) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise CheckpointError("--device cuda: no CUDA GPU is available on this machine; use --device cpu")


@click.command("make-checkpoint")
@click.option(
    "--preset", required=True, type=click.Choice(PRESETS), help="Architecture and size (see above)."
)
@click.option(
    "--out",
    "out",
    required=True,
    type=click.Path(),
    callback=output_folder,
    help="Folder to write (created).",
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
@click.option(
    "--format",
    "fmt",
    default="safetensors",
    show_default=True,
    type=click.Choice(["safetensors", "pt"]),
    help="SAM 3 presets only: sam3.safetensors (detector.* tensors plus the config, so any preset "
    "loads on its own) or Meta's sam3.pt (torch.save of detector.* tensors; read as the real shapes).",
)
@click.option(
    "--random",
    "random_weights",
    is_flag=True,
    help="Seeded random weights: what this command always writes (accepted so commands can say so).",
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace a checkpoint already in --out (its config, weight and tokenizer files are removed first).",
)
def make_checkpoint_command(
    preset: str, out: Path, quant: str, seed: int, device: str, fmt: str, random_weights: bool, force: bool
) -> None:
    """Write a complete checkpoint with seeded random weights: config.json, generation_config.json,
    safetensors (5 GB shards + index when larger), tokenizer.json and tokenizer_config.json, and for
    quantized output hf_quant_config.json.

    \b
    Presets:
      qwen3.6-35b-a3b   Qwen3.6-35B-A3B shapes (qwen3_5_moe, 40 layers, 256 experts): ~70 GB in bf16
      qwen3-30b-a3b     Qwen3-30B-A3B shapes (qwen3_moe, 48 layers, 128 experts): ~61 GB in bf16
      tiny-qwen3.5-moe  hidden 64, 4 layers (3 DeltaNet + 1 attention), 8 experts top-2, vocab 512
      tiny-qwen3-moe    hidden 64, 4 layers, 8 experts top-2, vocab 512
      sam3              SAM 3 image detector at real shapes (840.5M parameters, ~3.4 GB in fp32),
                        in Meta's key layout (detector.*): OUT/sam3.safetensors or OUT/sam3.pt
      tiny-sam3         the same architecture at tiny shapes, for CPU tests and demos

    Qwen3.5 bf16 checkpoints use the official layout (vision-language config with text_config,
    model.language_model. prefix, fused 3-D experts); quantized ones use per-expert tensors, as
    NVIDIA's do. The tokenizer is a small byte-level BPE trained on a built-in corpus, so token
    ids (BOS/EOS) differ from the real models'. Same seed and device give the same weights.
    """
    check_device(device)
    if preset in SAM3_PRESETS and quant != "bf16":
        raise CheckpointError(f"--quant {quant}: the SAM 3 presets are written unquantized (fp32)")
    if preset not in SAM3_PRESETS and fmt != "safetensors":
        raise CheckpointError(f"--format {fmt} is for the SAM 3 presets; {preset} is written as safetensors")
    check_out_dir(out, force)  # after the flags' checks, so a refused command leaves no empty folder
    if preset in SAM3_PRESETS:
        from batchinfer.sam3.checkpoint import write_random_sam3
        from batchinfer.sam3.config import Sam3Config

        config = Sam3Config.real() if preset == "sam3" else Sam3Config.tiny()
        path = write_random_sam3(out / f"sam3.{fmt}", config, seed)
        click.echo(f"wrote {path}: preset {preset}, fp32, seed {seed}; {describe(out)}")
        return
    from batchinfer.checkpoint.presets import write_preset

    write_preset(preset, out, quant=quant, seed=seed, device=device)
    click.echo(f"wrote {out}: preset {preset}, {quant}, seed {seed}; {describe(out)}")
