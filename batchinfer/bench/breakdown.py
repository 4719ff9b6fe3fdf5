"""Where the GPU engine's time goes: per-kernel device time of decode steps and one prefill pass.

Runs `KernelModel.decode` for each batch size (eager, the same kernels the CUDA graph replays) and
`KernelModel.prefill` for `prompts` prompts of `prompt_len` tokens under the PyTorch profiler, and sums
device time per kernel name into groups a reader can act on (MoE, attention, DeltaNet, GEMM, norms...),
with the costliest kernels and their launches a call listed by name. Beside the device time of a decode
step it times the step as the engine runs it, a CUDA graph replayed back to back: the difference is the
gaps between kernels. `bench breakdown` runs it alone; `bench run --breakdown` before a workload.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from batchinfer.engine.kernel_model import KernelModel

# Kernel-name patterns -> group, first match wins (Triton kernels keep their Python names). Our own
# projection kernels come before "moe experts" ("dequant") and cuBLAS's "gemm", which their names hold.
# `_nvfp4_dequant_kernel` counts as MoE: the engine dequantizes only experts at run time (its dense
# weights are bf16 copies from load time; `kernel_model.py`).
GROUPS = (
    ("add + rmsnorm + router + route", r"norm_route"),  # one-row decode's fused launch
    ("moe route + align", r"moe_route|moe_align|_align|moe_hist|moe_offsets|moe_scatter"),
    ("projections (ours)", r"fp8_gemv|nvfp4_gemv|fp8_gemm|nvfp4_gemm|fp8_rows_mm|fp8_dequant|nvfp4_rows_tc"),
    ("moe experts", r"moe|dequant|sum_slots|silu_mul|^_combine_kernel"),
    ("attention", r"attn|attention|decode_combine"),
    ("q/k norm + rope", r"qk_norm_rope"),
    ("deltanet conv", r"conv1d"),
    ("deltanet rule", r"delta_rule|_chunk_\w+_kernel"),
    ("gated rmsnorm", r"gated_rmsnorm"),
    ("add + rmsnorm", r"rmsnorm"),
    ("embedding", r"embedding"),
    ("sampling", r"argmax|partial_kernel|init_kernel|_sample|_search_kernel|_draw_kernel|_finish_kernel"),
    ("gemm (cuBLAS)", r"gemm|sm90_xmma|cutlass|nvjet|cublas|matmul"),
    ("kv cache write", r"store_kv|index_put|scatter|indexing"),
)


TOP_KERNELS = 16  # kernels listed by name under each profile's groups


def _group(name: str, groups: Sequence[tuple[str, str]]) -> str:
    for group, pattern in groups:
        if re.search(pattern, name, re.IGNORECASE):
            return group
    return "other"


def profile_kernels(fn, repeats: int, groups: Sequence[tuple[str, str]] = GROUPS) -> dict[str, Any]:
    """Device microseconds a call of `fn` by kernel-name group (`groups`: (group, pattern), first match
    wins), the total, and the costliest kernels with their launches a call."""
    fn()  # compile and warm up outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # us, launches a call
    for evt in prof.key_averages():
        us = evt.self_device_time_total / repeats
        if us > 0:
            per_kernel[evt.key][0] += us
            per_kernel[evt.key][1] += evt.count / repeats
    by_group: dict[str, float] = defaultdict(float)
    for name, (us, _) in per_kernel.items():
        by_group[_group(name, groups)] += us
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    return {
        "total_us": sum(by_group.values()),
        "groups": dict(sorted(by_group.items(), key=lambda kv: -kv[1])),
        "top_kernels": [{"kernel": k[:120], "us": us, "launches": n} for k, (us, n) in top],
    }


def _graph_replay_us(fn, replays: int = 20) -> float:
    """Wall time of one replay of `fn` captured as a CUDA graph, averaged over back-to-back replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up off the capture stream, as torch.cuda.graph asks
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


@torch.inference_mode()
def breakdown(
    model: KernelModel,
    batches: Sequence[int],
    context: int,
    prompts: int,
    prompt_len: int,
    repeats: int = 5,
) -> dict[str, Any]:
    """Per-group (and top per-kernel) device microseconds of one decode step for each batch in `batches`
    (rows at position `context`) and of one prefill pass (`prompts` x `prompt_len` tokens); random ids."""
    if model.device.type != "cuda":
        raise ValueError("the per-kernel breakdown needs a CUDA device (it reads CUDA profiler events)")
    dev, vocab = model.device, model.config.vocab_size
    state = model.new_state(max(*batches, prompts), max(context, prompt_len) + 1)
    g = torch.Generator(device=dev).manual_seed(0)
    steps = []
    for batch in batches:
        ids = torch.randint(10, vocab, (batch,), device=dev, generator=g)
        pos = torch.full((batch,), context, dtype=torch.int32, device=dev)
        rows = torch.arange(batch, dtype=torch.int32, device=dev)
        step = lambda ids=ids, pos=pos, rows=rows: model.decode(state, ids, pos, rows)  # noqa: E731
        steps.append({"batch": batch, "context": context, **profile_kernels(step, repeats)})
        steps[-1]["graph_replay_us"] = _graph_replay_us(step)

    p_ids = torch.randint(10, vocab, (prompts * prompt_len,), device=dev, generator=g)
    p_pos = torch.arange(prompt_len, dtype=torch.int32, device=dev).repeat(prompts)
    p_slots = torch.arange(prompts, dtype=torch.int32, device=dev)
    token_slots = p_slots.long().repeat_interleave(prompt_len)
    cu = torch.arange(0, prompts + 1, dtype=torch.int32, device=dev) * prompt_len
    pass_ = lambda: model.prefill(state, p_ids, p_pos, token_slots, cu, p_slots, prompt_len)  # noqa: E731
    prefill = profile_kernels(pass_, 2)
    return {"decode_steps": steps, "prefill_pass": {"prompts": prompts, "prompt_len": prompt_len, **prefill}}


def format_profile(title: str, d: dict[str, Any]) -> list[str]:
    """One profile of `profile_kernels` as lines: its groups with their shares, then its top kernels."""
    lines = [title]
    for group, us in d["groups"].items():
        lines.append(f"  {group:<20} {us:9.1f} us  {100 * us / d['total_us']:5.1f}%")
    lines.append("  top kernels (us, launches):")
    return lines + [f"    {k['us']:9.1f} us x{k['launches']:4.0f}  {k['kernel']}" for k in d["top_kernels"]]


def format_breakdown(doc: dict[str, Any]) -> list[str]:
    lines = []
    parts = [("decode step", d) for d in doc["decode_steps"]] + [("prefill pass", doc["prefill_pass"])]
    for what, d in parts:
        shape = (
            f"batch {d['batch']} at {d['context']}"
            if what == "decode step"
            else f"{d['prompts']} x {d['prompt_len']} tokens"
        )
        replay = f"; {d['graph_replay_us']:.0f} us a CUDA-graph replay" if "graph_replay_us" in d else ""
        lines += format_profile(f"{what} ({shape}): {d['total_us']:.0f} us of device time{replay}", d)
    return lines
