"""`batchinfer quantize`: turn a BF16 Hugging Face checkpoint into an NVFP4 one."""

from __future__ import annotations

from pathlib import Path

import click

from batchinfer.cli.make_checkpoint import check_device, check_out_dir, describe
from batchinfer.cli.options import output_folder


@click.command("quantize")
@click.argument("src", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("dst", type=click.Path(), callback=output_folder)
@click.option(
    "--scheme",
    required=True,
    type=click.Choice(["nvfp4", "mixed"]),
    help="Which linears get which format (see above).",
)
@click.option(
    "--format",
    "fmt",
    default="modelopt",
    show_default=True,
    type=click.Choice(["modelopt", "compressed-tensors"]),
    help="Layout of DST: NVIDIA ModelOpt, or compressed-tensors nvfp4-pack-quantized (nvfp4 scheme only).",
)
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    type=click.Choice(["cpu", "cuda"]),
    help="Where the weights are loaded and quantized.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace a checkpoint already in DST (its config, weight and tokenizer files are removed first).",
)
def quantize_command(src: Path, dst: Path, scheme: str, fmt: str, device: str, force: bool) -> None:
    """Quantize the BF16 (or FP16/FP32) checkpoint SRC into DST, weight-only.

    \b
    Schemes:
      nvfp4  NVFP4 on all linear layers except the router (mlp.gate) and lm_head; also kept BF16:
             shared_expert_gate and the DeltaNet in_proj_a / in_proj_b (one row per value head).
             hf_quant_config.json: quant_algo W4A16_NVFP4 with those modules in exclude_modules.
      mixed  NVIDIA's Qwen3.6-NVFP4 layout: routed experts, shared expert and lm_head NVFP4
             (W4A16_NVFP4); self_attn q/k/v/o_proj and linear_attn in_proj_qkv/in_proj_z/out_proj
             FP8 per tensor; router, gates, in_proj_a/b, conv1d, norms, embeddings BF16.
             hf_quant_config.json: quant_algo MIXED_PRECISION with quantized_layers.

    NVFP4 follows ModelOpt's scale rules (E2M1 codes, one E4M3 scale per 16 inputs, fp32
    weight_scale_2 = amax / 2688). No activation scales are calibrated or written: the output
    is meant for weight-only (W4A16 / W8A16) inference. Experts are written per expert; a tied
    lm_head stays tied and unquantized. Tokenizer and generation files are copied from SRC.
    """
    from batchinfer.checkpoint.quantize import check_quantize, quantize_checkpoint

    check_device(device)
    check_quantize(src, dst, scheme, fmt)
    check_out_dir(dst, force)
    quantize_checkpoint(src, dst, scheme=scheme, device=device, method=fmt)
    click.echo(f"wrote {dst}: scheme {scheme}, {fmt} layout; {describe(dst)}")
