"""Timing one workload through a token-level engine: throughput, TTFT, decode rate, memory, batch sizes.

Benchmarks feed token ids (the workloads are random ids that no tokenizer round-trips), so an engine
joins the benchmark through `TokenEngine`, not the job layer's text interface. All requests are
submitted in one call; the engine reports every step's sampled tokens through `on_step`, which is
where the timestamps come from:

* TTFT of a request: from the submit call to the `on_step` call that first carries its token (the
  engine's own queueing counts, as in a served system).
* decode tok/s: tokens after each request's first, over the time from the first first-token to the
  last token (for `single`, the plain decode rate); tpot_ms: mean per-request time per output token
  after the first.
* batch sizes: how many rows each step sampled for, as a histogram.
* peak memory: `torch.cuda.max_memory_allocated` on a GPU; on the CPU the process's peak RSS (which
  includes building the model).
"""

from __future__ import annotations

import resource
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from batchinfer.engine.api import SamplingParams
from batchinfer.engine.fast import FastGenerator
from batchinfer.models.generate import generate
from batchinfer.models.qwen_moe import QwenMoeModel

StepCallback = Callable[[dict[int, int]], None]


class TokenEngine(Protocol):
    """What the benchmark needs from an engine (the GPU engine implements it beside `TextEngine`)."""

    # True when the engine runs on copies of the weights it made: the benchmark's own (kept for the
    # accuracy lock's reference) then leave the GPU while it runs (`workload_run.weights_off_gpu`)
    owns_weights: bool

    def describe(self) -> dict[str, str]:
        """Engine name, device, dtype, quantization: recorded in the result JSON."""
        ...

    def generate_ids(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], on_step: StepCallback
    ) -> list[list[int]]:
        """Generated token ids per prompt, in order. `on_step({request index: token})` once per step
        with the tokens just sampled (indices into `prompts`)."""
        ...


class ReferenceTokenEngine:
    """The reference model behind `TokenEngine`: length-sorted batches of at most `max_batch_size`,
    one `models.generate.generate` call each, as the reference `TextEngine` runs them."""

    owns_weights = False  # it runs the benchmark's model itself

    def __init__(self, model: QwenMoeModel, max_batch_size: int, name: str = "reference") -> None:
        self.model = model
        self.max_batch_size = max_batch_size
        self.name = name

    def describe(self) -> dict[str, str]:
        return {
            "engine": self.name,
            "device": str(self.model.device),
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "max_batch_size": str(self.max_batch_size),
        }

    def generate_ids(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], on_step: StepCallback
    ) -> list[list[int]]:
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out: list[list[int]] = [[] for _ in prompts]
        for start in range(0, len(order), self.max_batch_size):
            rows = order[start : start + self.max_batch_size]

            def step(tokens: dict[int, int], rows: list[int] = rows) -> None:
                on_step({rows[pos]: tok for pos, tok in tokens.items()})

            outputs = generate(self.model, [prompts[r] for r in rows], [params[r] for r in rows], (), step)
            for r, o in zip(rows, outputs, strict=True):
                out[r] = o.token_ids
        return out


class FastTokenEngine:
    """The GPU engine (`engine.fast.FastGenerator`) behind `TokenEngine`; frees its state pools after each
    run so a peer measured next in the same process gets the memory."""

    owns_weights = True  # the kernel layouts `KernelModel` made at load time

    def __init__(self, generator: FastGenerator) -> None:
        self.generator = generator

    def describe(self) -> dict[str, str]:
        g = self.generator
        return {
            "engine": "fast",
            "device": str(g.device),
            "dtype": "bfloat16",
            "max_slots": str(g.max_slots),
            "slots": str(g.slots),  # as the last run planned them
            "prefill_tokens": str(g.prefill_tokens),
            "prefill_tokens_in_force": str(g.pass_tokens),  # lower after an out-of-memory pass
            "refill_fraction": str(g.refill_fraction),
            "prefill_graph_tokens": str(g.prefill_graph_tokens),
            "deltanet_state": str(g.model.deltanet_state).removeprefix("torch."),
            "kv_cache": "fp8" if g.model.kv_cache == torch.float8_e4m3fn else "bfloat16",
            "bf16_experts": str(any(layer.moe.decoded is not None for layer in g.model.layers)),
            "cuda_graphs": str(g.cuda_graphs),
            **{k: str(v) for k, v in g.stats.items()},
        }

    def warmup(self, prompts: Sequence[Sequence[int]], out_lens: Sequence[int]) -> None:
        """Before the clock starts: size the state pools for the whole workload and capture every decode
        graph (`FastGenerator.prepare`), then compile the kernels for its shapes (Triton specialises on
        sizes; the MoE picks its path by tokens per expert) on its first prompts, 2 tokens each."""
        self.generator.prepare(len(prompts), max(len(p) + n for p, n in zip(prompts, out_lens, strict=True)))
        first = list(prompts[:64])
        self.generator.generate(first, [SamplingParams(max_tokens=2, ignore_eos=True)] * len(first))

    def generate_ids(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], on_step: StepCallback
    ) -> list[list[int]]:
        def step(tokens: dict[int, int]) -> None:
            on_step(tokens)

        try:
            return [o.token_ids for o in self.generator.generate(prompts, params, (), step)]
        finally:
            self.generator.release()


def peak_memory(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        return {
            "peak_memory_bytes": torch.cuda.max_memory_allocated(device),
            "peak_memory_kind": "cuda allocated",
        }
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {"peak_memory_bytes": rss, "peak_memory_kind": "process peak RSS"}


def _quantiles(values_s: list[float]) -> dict[str, float]:
    ms = sorted(v * 1e3 for v in values_s)
    pick = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]
    return {"mean": statistics.fmean(ms), "p50": pick(0.5), "p90": pick(0.9), "max": ms[-1]}


def measure(
    engine: TokenEngine, prompts: list[list[int]], out_lens: list[int], device: torch.device
) -> tuple[list[list[int]], dict[str, Any]]:
    """Run all requests greedily (exactly `out_lens[i]` tokens, EOS ignored) in one submit; the outputs
    and the figures. Raises RuntimeError if the engine returns a different number of tokens."""
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in out_lens]
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    batch_sizes: Counter[int] = Counter()

    def on_step(tokens: dict[int, int]) -> None:
        now = time.perf_counter()
        batch_sizes[len(tokens)] += 1
        for r in tokens:
            first.setdefault(r, now)
            last[r] = now

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    outputs = engine.generate_ids(prompts, params, on_step)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    wrong = [i for i, (o, n) in enumerate(zip(outputs, out_lens, strict=True)) if len(o) != n]
    if wrong or len(first) != len(prompts):
        i = wrong[0] if wrong else min(set(range(len(prompts))) - set(first))
        raise RuntimeError(
            f"engine {engine.describe().get('engine')} returned {len(outputs[i])} tokens for request {i} "
            f"(expected exactly {out_lens[i]}, EOS ignored) or reported none of them through on_step"
        )
    out_tokens = sum(out_lens)
    in_tokens = sum(len(p) for p in prompts)
    decode_tokens = out_tokens - len(prompts)
    decode_span = max(last.values()) - min(first.values())
    per_token = [(last[r] - first[r]) / (out_lens[r] - 1) for r in first if out_lens[r] > 1]
    figures = {
        "requests": len(prompts),
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "wall_s": wall,
        "out_tok_per_s": out_tokens / wall,
        "total_tok_per_s": (in_tokens + out_tokens) / wall,
        "ttft_ms": _quantiles([first[r] - t0 for r in range(len(prompts))]),
        "decode_tok_per_s": decode_tokens / decode_span if decode_tokens and decode_span > 0 else None,
        "tpot_ms": statistics.fmean(per_token) * 1e3 if per_token else None,
        "batch_sizes": {
            "max": max(batch_sizes),
            "mean": sum(k * v for k, v in batch_sizes.items()) / sum(batch_sizes.values()),
            "steps": dict(sorted(batch_sizes.items())),
        },
        **peak_memory(device),
    }
    return outputs, figures
