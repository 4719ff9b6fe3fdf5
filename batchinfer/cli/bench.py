"""`batchinfer bench`: benchmarks. `bench kernels` times our Triton kernels on this GPU; `bench breakdown`
profiles the engine's decode steps and a prefill pass per kernel; `bench run` runs a fixed workload of
workloads.json end to end, with the accuracy lock (docs/PERF.md)."""

from __future__ import annotations

import itertools
import json
import os

import click

from batchinfer.cli.options import make_parent
from batchinfer.errors import ConfigError


def _llm_weights(f):
    """--model PATH | --preset NAME --random [--quant]: the LLM weights a benchmark runs."""
    f = click.option(
        "--quant",
        type=click.Choice(["bf16", "nvfp4", "mixed"]),
        default="bf16",
        show_default=True,
        help="Weight format of the --preset --random weights.",
    )(f)
    f = click.option(
        "--random", "random_weights", is_flag=True, help="Random weights for --preset, drawn in memory."
    )(f)
    f = click.option("--preset", help="Real-shape (or tiny) preset of make-checkpoint, with --random.")(f)
    return click.option(
        "--model", "model_path", type=click.Path(exists=True, file_okay=False), help="Checkpoint folder."
    )(f)


def _check_weights(
    model_path: str | None, preset: str | None, random_weights: bool, quant: str = "bf16"
) -> None:
    if (model_path is None) == (preset is None):
        raise click.UsageError("give exactly one of --model PATH or --preset NAME --random")
    if preset is not None and not random_weights:
        raise click.UsageError("--preset draws random weights; say so with --random")
    if model_path is not None and (random_weights or quant != "bf16"):
        raise click.UsageError("--random and --quant apply to --preset; a --model checkpoint has its own")


@click.group()
def bench() -> None:
    """Benchmarks: kernel microbenchmarks (CUDA GPU) and end-to-end workloads with the accuracy lock."""


@bench.command("kernels")
@click.option(
    "--model",
    type=click.Choice(["qwen3.6", "qwen3-30b", "all"]),
    default="all",
    show_default=True,
    help="Which model's shapes to time.",
)
@click.option("--op", "ops", multiple=True, help="Only these kernels (repeatable), e.g. --op nvfp4_gemm.")
@click.option(
    "--m",
    "ms",
    multiple=True,
    type=click.IntRange(min=1),
    help="Token counts (repeatable) [default: 1 8 32 128 512 4096].",
)
@click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False, writable=True),
    callback=make_parent,
    help="Also write the environment and every result row to this JSON file.",
)
def kernels(model: str, ops: tuple[str, ...], ms: tuple[int, ...], json_out: str | None) -> None:
    """Time every kernel at the real shapes of the model(s) against PyTorch baselines and measured
    ceilings (copy bandwidth, cuBLAS bf16 GEMM, one empty launch) on this machine's CUDA GPU; at decode
    sizes the linears and the MoE also against a launch that only reads their weight bytes
    (stream_read). Prints a markdown table."""
    import torch

    from batchinfer.bench.kernels import M_VALUES, collect_cases, environment, format_table, run_cases

    if not torch.cuda.is_available():
        raise ConfigError("bench kernels needs a CUDA GPU; torch sees none on this machine")
    models = ["qwen3.6", "qwen3-30b"] if model == "all" else [model]
    cases = [c for c in collect_cases(models, ms or M_VALUES) if not ops or c.op in ops]
    if not cases:
        raise click.ClickException(f"no benchmark case matches --op {' '.join(ops)}")
    env = environment()
    click.echo(" ".join(f"{k}={v}" for k, v in env.items()), err=True)
    rows = []
    for row in run_cases(cases, torch.device("cuda")):
        rows.append(row)
        if row["op"] != "ceilings":
            click.echo(format_table([row]).splitlines()[-1], err=True)
        if json_out:  # rewritten after every case, so an interrupted run keeps what it measured
            with open(json_out, "w") as f:
                json.dump({"environment": env, "rows": rows}, f, indent=1)
    click.echo(format_table(rows))


@bench.command("breakdown")
@_llm_weights
@click.option(
    "--batch",
    "batches",
    multiple=True,
    type=click.IntRange(min=1),
    help="Decode batch sizes (repeatable) [default: 1 32].",
)
@click.option(
    "--context", default=512, show_default=True, type=click.IntRange(min=1), help="Decode position."
)
@click.option("--prompts", default=1, show_default=True, type=click.IntRange(min=1), help="Prompts a pass.")
@click.option(
    "--prompt-len", default=512, show_default=True, type=click.IntRange(min=1), help="Tokens a prompt."
)
@click.option("--device", default="cuda", show_default=True, help="cuda or cuda:N.")
@click.option(
    "--bf16-experts", is_flag=True, help="Keep the NVFP4 experts decoded to bf16 (as `bench run` does)."
)
@click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False, writable=True),
    callback=make_parent,
    help="Write the profiles here.",
)
def breakdown_cmd(
    model_path: str | None,
    preset: str | None,
    random_weights: bool,
    quant: str,
    batches: tuple[int, ...],
    context: int,
    prompts: int,
    prompt_len: int,
    device: str,
    bf16_experts: bool,
    json_out: str | None,
) -> None:
    """Where the GPU engine's time goes: per-kernel device time of one decode step at each --batch (and the
    step as a CUDA-graph replay) and of one prefill pass of --prompts x --prompt-len tokens, with no
    workload and no accuracy checks (`bench run --breakdown` profiles inside a checked run)."""
    _check_weights(model_path, preset, random_weights, quant)
    import torch

    from batchinfer.bench.breakdown import breakdown, format_breakdown
    from batchinfer.bench.workload_run import environment
    from batchinfer.checkpoint.loader import load_checkpoint
    from batchinfer.checkpoint.presets import build_checkpoint
    from batchinfer.engine.kernel_model import KernelModel
    from batchinfer.engine.loader import resolve_device

    dev = resolve_device(device)
    if dev.type != "cuda":
        raise ConfigError(f"bench breakdown profiles CUDA kernels; --device {device} is not a CUDA GPU")
    if model_path is not None:
        config, weights = load_checkpoint(model_path, device=dev, dtype=torch.bfloat16)
    else:
        raw, tensors = build_checkpoint(preset, quant=quant, device=str(dev))
        config, weights = load_checkpoint(tensors, config=raw, device=dev, dtype=torch.bfloat16)
        del tensors
    model = KernelModel(config, weights, bf16_experts=bf16_experts)
    doc = breakdown(model, batches or (1, 32), context, prompts, prompt_len)
    for line in format_breakdown(doc):
        click.echo(line)
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"environment": environment(dev), **doc}, f, indent=1)


@bench.command("run")
@click.option(
    "--workload",
    required=True,
    help="LLM workload(s) of workloads.json, comma-separated: single, conc32, offline, extract.",
)
@_llm_weights
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option(
    "--dtype", type=click.Choice(["bf16", "fp32"]), help="Activations [default: fp32 on CPU, bf16 on GPU]."
)
@click.option(
    "--engine",
    "engine_name",
    type=click.Choice(["fast", "reference"]),
    help="fast: our kernels, slots and CUDA graphs (bf16) [default on CUDA]; reference: plain PyTorch.",
)
@click.option(
    "--max-batch-size",
    default=16,
    show_default=True,
    type=click.IntRange(min=1),
    help="Reference engine batch rows.",
)
@click.option(
    "--max-slots",
    default=(1024,),  # engine.fast.MAX_SLOTS (not imported: --help stays free of torch)
    multiple=True,
    show_default=True,
    type=click.IntRange(min=1),
    help="Fast engine: most sequences at once (free memory caps them too). Repeatable, as are "
    "--prefill-tokens and --refill-fraction: each workload runs once per combination, on one model load.",
)
@click.option(
    "--deltanet-state",
    type=click.Choice(["float32", "bfloat16", "float16"]),
    default="float32",
    show_default=True,
    help="Fast engine: dtype of the DeltaNet recurrent state (16 bits halve its bytes, cost accuracy; "
    "float16 keeps 3 more mantissa bits than bfloat16 and saturates at 65504).",
)
@click.option(
    "--kv-cache",
    type=click.Choice(["bfloat16", "fp8"]),
    default="bfloat16",
    show_default=True,
    help="Fast engine: KV cache of the full-attention layers (fp8: E4M3 with a scale per token and head, "
    "half the bytes, costs accuracy).",
)
@click.option(
    "--bf16-experts",
    is_flag=True,
    help="Fast engine: keep the NVFP4 experts decoded to bf16 from load time, so large prefill passes "
    "(~8k+ tokens at Qwen3.6's shape) skip their decode (same outputs; ~65 GB more at that shape, so fewer "
    "slots: for prefill-bound work).",
)
@click.option(
    "--prefill-tokens",
    default=(65536,),  # engine.fast.PREFILL_TOKENS (not imported: --help stays free of torch)
    multiple=True,
    show_default=True,
    type=click.IntRange(min=1),
    help="Fast engine: prompt tokens a prefill pass; after a pass of more than half that runs out of "
    "memory, later passes hold at most half its tokens (on the H200 65536 beat 16384 and 32768 on "
    "`offline`, and 32768 on `extract` with --bf16-experts, docs/PERF.md session 21).",
)
@click.option(
    "--refill-fraction",
    default=(0.125,),  # engine.fast.REFILL_FRACTION
    multiple=True,
    show_default=True,
    type=click.FloatRange(min=0, max=1, min_open=True),
    help="Fast engine: waiting prompts are prefilled once this fraction of the slots is free; with "
    "--prefill-tokens it sets the split between prefill passes and decode steps.",
)
@click.option(
    "--prefill-graph-tokens",
    default=2048,  # engine.fast.PREFILL_GRAPH_TOKENS
    show_default=True,
    type=click.IntRange(min=0),
    help="Fast engine: a pass that is one fresh prompt whose length rounded up to a power of two (at least "
    "64) is at most N replays a CUDA graph of that length; 0 never. Cuts the launch overhead of a lone "
    "prompt's prefill (the time to first token).",
)
@click.option("--max-requests", type=int, help="Run only the first N requests (recorded as 'capped').")
@click.option("--max-in", type=int, help="Cut prompts to their first N tokens (recorded deviation).")
@click.option("--max-out", type=int, help="Generate at most N tokens per request (recorded deviation).")
@click.option(
    "--lock-sample",
    default=16,
    show_default=True,
    type=int,
    help="Sequences the accuracy lock checks (>= 16).",
)
@click.option("--peer", type=click.Choice(["hf"]), help="Also run Hugging Face transformers on the workload.")
@click.option(
    "--peer-max-requests",
    default=32,
    show_default=True,
    type=click.IntRange(min=1),
    help="Cap of the peer's requests.",
)
@click.option(
    "--workloads",
    "workloads_file",
    type=click.Path(exists=True, dir_okay=False),
    help="Workloads file [default: the copy shipped with batchinfer].",
)
@click.option(
    "--breakdown",
    "breakdown_batch",
    type=click.IntRange(min=1),
    help="Fast engine: profile one decode step at this batch and the first workload's first prefill pass "
    "(its prompt length, as many prompts as one pass of --prefill-tokens holds), per kernel, before the "
    "runs.",
)
@click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False, writable=True),
    callback=make_parent,
    help="Write the result here.",
)
def run(
    workload: str,
    model_path: str | None,
    preset: str | None,
    random_weights: bool,
    quant: str,
    device: str,
    dtype: str | None,
    engine_name: str | None,
    max_batch_size: int,
    max_slots: tuple[int, ...],
    deltanet_state: str,
    kv_cache: str,
    bf16_experts: bool,
    prefill_tokens: tuple[int, ...],
    refill_fraction: tuple[float, ...],
    prefill_graph_tokens: int,
    max_requests: int | None,
    max_in: int | None,
    max_out: int | None,
    lock_sample: int,
    peer: str | None,
    peer_max_requests: int,
    workloads_file: str | None,
    breakdown_batch: int | None,
    json_out: str | None,
) -> None:
    """Run fixed workloads end to end (greedy, exact output lengths, all requests at once) and report
    output/total tok/s, TTFT, decode tok/s, wall time, peak memory and batch sizes; `--workload
    single,conc32` runs several on one model load. Every run teacher-forces a sample of its outputs
    through the fp32 reference (the accuracy lock), and the fast engine first checks its teacher-forced
    logits against it (kernel exactness); a run that fails either exits non-zero and records no figure.
    While the fast engine (or the peer) runs, the reference's weights wait in host memory, so the engine
    plans its slots in the memory a `batchinfer run` job would have."""
    _check_weights(model_path, preset, random_weights, quant)
    if lock_sample < 16:
        raise click.UsageError(f"--lock-sample must be >= 16, got {lock_sample}")
    import torch

    from batchinfer.bench.accuracy_lock import AccuracyLockError
    from batchinfer.bench.e2e import FastTokenEngine, ReferenceTokenEngine
    from batchinfer.bench.workload_run import build_model, run_benchmark
    from batchinfer.bench.workloads import load_workloads, workload_requests
    from batchinfer.engine.loader import DTYPES, resolve_device

    doc = load_workloads(workloads_file)
    names = [w.strip() for w in workload.split(",") if w.strip()]
    unknown = [w for w in names if w not in doc["llm"]]
    if unknown or not names:
        raise click.BadParameter(
            f"{workload!r}; the workloads file has {', '.join(doc['llm'])}", param_hint="--workload"
        )
    dev = resolve_device(device)
    engine_name = engine_name or ("fast" if dev.type == "cuda" else "reference")
    if engine_name == "fast" and dtype == "fp32":
        raise click.UsageError("the fast engine computes in bf16; --dtype fp32 needs --engine reference")
    if deltanet_state != "float32" and engine_name != "fast":
        raise click.UsageError("--deltanet-state applies to the fast engine (--engine fast)")
    if kv_cache != "bfloat16" and engine_name != "fast":
        raise click.UsageError("--kv-cache applies to the fast engine (--engine fast)")
    if bf16_experts and engine_name != "fast":
        raise click.UsageError("--bf16-experts applies to the fast engine (--engine fast)")
    if breakdown_batch and engine_name != "fast":
        raise click.UsageError("--breakdown profiles the fast engine's kernels (--engine fast)")
    if max_batch_size != 16 and engine_name != "reference":
        raise click.UsageError("--max-batch-size applies to the reference engine (--engine reference)")
    if engine_name == "fast" and dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise click.UsageError(
            f"--engine fast runs Triton kernels and needs a CUDA device; --device {device} is {dev} "
            "(--engine reference runs anywhere; TRITON_INTERPRET=1 interprets the kernels on a CPU: tests)"
        )
    schedule = (max_slots, prefill_tokens, refill_fraction, prefill_graph_tokens)
    if schedule != ((1024,), (65536,), (0.125,), 2048) and engine_name != "fast":
        raise click.UsageError(
            "--max-slots, --prefill-tokens, --refill-fraction and --prefill-graph-tokens apply to the fast "
            "engine (--engine fast)"
        )
    torch_dtype = DTYPES[dtype] if dtype else (torch.float32 if dev.type == "cpu" else torch.bfloat16)
    if engine_name == "fast":
        torch_dtype = torch.bfloat16
    bm = build_model(model_path=model_path, preset=preset, quant=quant, device=dev, dtype=torch_dtype)
    shrink = dict(vocab_size=bm.config.vocab_size, max_in=max_in, max_out=max_out, workloads=doc)
    exactness = breakdown_doc = None
    if engine_name == "fast":
        from batchinfer.bench.exactness import engine_exactness, exactness_sequences
        from batchinfer.engine.fast import FastGenerator
        from batchinfer.engine.kernel_model import STATE_DTYPES, KernelModel
        from batchinfer.kernels.kv_cache import KV_DTYPES

        kernel_model = KernelModel(
            bm.config,
            bm.weights,
            deltanet_state=STATE_DTYPES[deltanet_state],
            kv_cache=KV_DTYPES[kv_cache],
            bf16_experts=bf16_experts,
        )
        exactness = engine_exactness(
            kernel_model,
            bm.reference,
            exactness_sequences(bm.config.vocab_size),
            bf16_reference=bm.model if bm.model is not bm.reference else None,
        )
        click.echo(format_exactness(exactness.as_dict()))
        if breakdown_batch:  # kernel timings, independent of the lock: measured even when it fails
            from batchinfer.bench.breakdown import breakdown, format_breakdown

            first = workload_requests(names[0], max_requests=max_requests, **shrink).prompts
            prompt_len = len(first[0])
            prompts = min(len(first), max(1, prefill_tokens[0] // prompt_len))  # `single`: its 1 x 512 pass
            breakdown_doc = breakdown(kernel_model, [breakdown_batch], prompt_len, prompts, prompt_len)
            for line in format_breakdown(breakdown_doc):
                click.echo(line)
            if json_out:
                with open(json_out, "w") as f:
                    json.dump(
                        {"kernel_exactness": exactness.as_dict(), "breakdown": breakdown_doc}, f, indent=1
                    )
        if not exactness.passed:
            raise AccuracyLockError(
                "kernel exactness failed (limits in batchinfer/bench/exactness.py); no figure recorded"
            )
        engines = [
            FastTokenEngine(
                FastGenerator(
                    kernel_model,
                    max_slots=slots,
                    prefill_tokens=tokens,
                    refill_fraction=fraction,
                    prefill_graph_tokens=prefill_graph_tokens,
                )
            )
            for slots, tokens, fraction in itertools.product(max_slots, prefill_tokens, refill_fraction)
        ]
    else:
        engines = [ReferenceTokenEngine(bm.model, max_batch_size)]
    results = []
    for engine, name in itertools.product(engines, names):
        requests = workload_requests(name, max_requests=max_requests, **shrink)
        peer_engine = peer_requests = None
        if peer == "hf" and engine is engines[0]:  # the peer once, beside the first schedule
            from batchinfer.bench.hf_peer import HfPeer

            peer_requests = workload_requests(
                name, max_requests=min(peer_max_requests, max_requests or 1 << 62), **shrink
            )

            def peer_engine() -> HfPeer:
                return HfPeer(bm.config, bm.raw, bm.weights, dev, torch_dtype)

        result = run_benchmark(
            engine, bm, requests, dev, lock_sample=lock_sample, peer=peer_engine, peer_requests=peer_requests
        )
        if exactness is not None:
            result["kernel_exactness"] = exactness.as_dict()
        if len(engines) > 1:
            e = result["engine"]
            click.echo(
                f"schedule: max_slots {e['max_slots']} ({e['slots']} planned), prefill_tokens "
                f"{e['prefill_tokens']}, refill_fraction {e['refill_fraction']}"
            )
        for line in format_result(result):
            click.echo(line)
        results.append(result)
        if json_out:  # rewritten after every workload, so a later failure loses nothing
            with open(json_out, "w") as f:
                out = results[0] if len(engines) * len(names) == 1 else results
                json.dump(
                    {"runs": results, "breakdown": breakdown_doc} if breakdown_doc else out, f, indent=1
                )


def format_exactness(e: dict) -> str:
    return (
        f"kernel exactness ({e['sequences']} sequences, {e['tokens']} tokens): prefill rel L2 "
        f"{e['prefill_rel_l2']:.2e}, top-1 {e['prefill_top1']:.4f}; decode ({e['decode_positions']} steps) "
        f"rel L2 {e['decode_rel_l2']:.2e}, top-1 {e['decode_top1']:.4f} (prefill there "
        f"{e['prefill_top1_at_decode']:.4f}); {'PASS' if e['passed'] else 'FAIL'}"
        + (
            f" (bf16 PyTorch forward: rel L2 {e['bf16_reference_rel_l2']:.2e}, "
            f"top-1 {e['bf16_reference_top1']:.4f})"
            if e.get("bf16_reference_rel_l2") is not None
            else ""
        )
    )


def format_result(result: dict) -> list[str]:
    """Human lines of a `bench run` result: one per engine, then the locks and any deviation."""
    head = f"workload {result['workload']}"
    if result["deviations"]:
        dev = ", ".join(f"{k}={v}" for k, v in result["deviations"].items())
        head += f" ({'capped, ' if result['capped'] else ''}deviations: {dev})"
    lines = [head]
    runs = [(result["engine"], result["results"], result["accuracy_lock"], result["capped"])]
    if result["peer"]:
        p = result["peer"]
        runs.append((p["engine"], p["results"], p["accuracy_lock"], p["capped"]))
    for eng, r, lock, capped in runs:
        decode = r["decode_tok_per_s"]
        lines.append(
            f"{eng['engine']} on {eng['device']}{' (capped)' if capped else ''}: {r['requests']} requests, "
            f"out {r['out_tok_per_s']:.1f} tok/s, total {r['total_tok_per_s']:.1f} tok/s, "
            f"TTFT mean {r['ttft_ms']['mean']:.1f} ms (p90 {r['ttft_ms']['p90']:.1f}), "
            f"decode {'n/a' if decode is None else f'{decode:.1f}'} tok/s, wall {r['wall_s']:.2f} s, "
            f"peak mem {r['peak_memory_bytes'] / 2**30:.2f} GiB ({r['peak_memory_kind']}), "
            f"batch max {r['batch_sizes']['max']} mean {r['batch_sizes']['mean']:.1f}"
        )
        lines.append(
            f"  accuracy lock passed: {len(lock['sequences'])} sequences, {lock['positions']} tokens, "
            f"top-1 {lock['top1_agreement']:.4f}, "
            f"worst gap {lock['max_gap_std']:.3f} std (tol {lock['tol_std']})"
        )
    return lines


@bench.command("images")
@click.option("--workload", required=True, help="Image workload of workloads.json: images-1p, images-4p.")
@click.option(
    "--model", "model_path", type=click.Path(exists=True, dir_okay=False), help="sam3.pt or .safetensors."
)
@click.option("--preset", type=click.Choice(["sam3", "tiny-sam3"]), help="Random weights at these shapes.")
@click.option("--random", "random_weights", is_flag=True, help="Draw --preset's weights in memory.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the --random weights.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option(
    "--dtype", type=click.Choice(["bf16", "fp32"]), help="Our fast path [default: bf16 on GPU, fp32 on CPU]."
)
@click.option(
    "--vit",
    type=click.Choice(["bf16", "fp8", "fp8-mlp"]),
    default="bf16",
    show_default=True,
    help="The ViT's linears in --dtype, or on FP8 weights and activations (batchinfer/sam3/fp8.py): all "
    "four a block or the MLP's only (at real shapes both fail the accuracy lock, docs/PERF_IMAGES.md).",
)
@click.option("--batch-size", default=16, show_default=True, type=int, help="Images per model call.")
@click.option(
    "--score-threshold", default=0.5, show_default=True, type=float, help="Instances kept (job default)."
)
@click.option("--max-images", type=int, help="Run only the first N images (recorded deviation).")
@click.option(
    "--lock-images", default=4, show_default=True, type=int, help="Images the accuracy lock and parity check."
)
@click.option(
    "--breakdown",
    is_flag=True,
    help="Also profile one batch (CUDA only): device time per kernel group, the backbone alone and the "
    "whole model.",
)
@click.option("--peer", type=click.Choice(["meta"]), help="Also run Meta's SAM 3 on the same images.")
@click.option(
    "--peer-path",
    default=".peer",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Folder holding a copy of Meta's sam3/ package (never part of batchinfer).",
)
@click.option("--peer-images", type=int, help="Cap of the images the peer runs [default: all].")
@click.option(
    "--workloads",
    "workloads_file",
    type=click.Path(exists=True, dir_okay=False),
    help="Workloads file [default: the copy shipped with batchinfer].",
)
@click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False, writable=True),
    callback=make_parent,
    help="Write the result here.",
)
def images(
    workload: str,
    model_path: str | None,
    preset: str | None,
    random_weights: bool,
    seed: int,
    device: str,
    dtype: str | None,
    vit: str,
    batch_size: int,
    score_threshold: float,
    max_images: int | None,
    lock_images: int,
    breakdown: bool,
    peer: str | None,
    peer_path: str,
    peer_images: int | None,
    workloads_file: str | None,
    json_out: str | None,
) -> None:
    """Run a SAM 3 image workload end to end (PNG bytes decoded, model, masks to COCO RLE, Parquet) and
    report images/s, pairs/s, wall time and peak memory, after checking the fast path against the fp32
    reference on a sample of the images (the accuracy lock: a failing lock exits non-zero and records
    no figure). With --peer meta, Meta's implementation runs the same images with the same weights."""
    _check_weights(model_path, preset, random_weights)
    if batch_size < 1:
        raise click.UsageError(f"--batch-size must be >= 1, got {batch_size}")
    if not 0 <= score_threshold < 1:
        raise click.UsageError(f"--score-threshold must be in [0, 1), got {score_threshold}")
    if lock_images < 2:
        raise click.UsageError(f"--lock-images must be >= 2, got {lock_images}")
    if peer_images is not None and peer_images < 1:
        raise click.UsageError(f"--peer-images must be >= 1, got {peer_images}")
    import torch

    from batchinfer.bench.images import build_models, format_result, image_workload, run_images_benchmark
    from batchinfer.bench.workloads import load_workloads
    from batchinfer.engine.loader import resolve_device
    from batchinfer.sam3.checkpoint import load_sam3_state_dict, random_sam3_state_dict
    from batchinfer.sam3.config import Sam3Config

    work = image_workload(workload, max_images=max_images, workloads=load_workloads(workloads_file))
    dev = resolve_device(device)
    if breakdown and dev.type != "cuda":
        raise click.UsageError(
            f"--breakdown profiles CUDA kernels; --device {device} is {dev}, not a CUDA GPU"
        )
    run_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[
        dtype or ("fp32" if dev.type == "cpu" else "bf16")
    ]
    if model_path is not None:
        state, config = load_sam3_state_dict(model_path)
        info = {"model": model_path}
    else:
        config = Sam3Config.real() if preset == "sam3" else Sam3Config.tiny()
        state = {k.removeprefix("detector."): v for k, v in random_sam3_state_dict(config, seed).items()}
        info = {"model": f"preset {preset} (random weights, seed {seed})"}
    model, reference = build_models(state, config, dev, run_dtype)
    if vit != "bf16":
        from batchinfer.sam3.fp8 import use_fp8_vit

        use_fp8_vit(model, mlp_only=vit == "fp8-mlp")
    meta = None
    if peer == "meta":
        from batchinfer.bench.meta_sam3_peer import MetaSam3Peer

        def meta() -> MetaSam3Peer:
            return MetaSam3Peer(peer_path, state, dev)

    result = run_images_benchmark(
        model, reference, work, dev, threshold=score_threshold, batch_size=batch_size,
        lock_images=lock_images, peer=meta, peer_images=peer_images, info=info, breakdown=breakdown,
    )  # fmt: skip
    for line in format_result(result):
        click.echo(line)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(result, f, indent=1)
    if result.get("peer_error"):
        raise click.ClickException(f"the Meta peer failed (our figures above stand): {result['peer_error']}")
