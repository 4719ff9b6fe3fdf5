"""The Hugging Face transformers peer of `bench run --peer hf`, on the same weights in the same process.

transformers runs dense weights only, so quantized linears are dequantized into its bf16 (GPU) or
fp32 (CPU) parameters: the peer runs what HF eager can run of the same model. Requests of equal prompt
and output length go through one `generate` call (no padding, so no padding semantics to argue about);
`single` and `conc32` are one call each, after an untimed warm-up call as our engine gets one.
transformers is a test extra, imported only here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import groupby
from typing import Any

import torch

from batchinfer.bench.e2e import StepCallback
from batchinfer.checkpoint.loader import Weight
from batchinfer.engine.api import SamplingParams
from batchinfer.errors import ConfigError
from batchinfer.models.config import ModelConfig


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "--peer hf needs Hugging Face transformers, which is not installed; "
            "install the test extra: pip install 'batchinfer[test]'"
        ) from None
    return transformers


def hf_config(raw: dict[str, Any]) -> Any:
    """The transformers text config of a raw `config.json` dict (a preset's or a checkpoint's)."""
    tf = _import_transformers()
    if raw.get("model_type") == "qwen3_moe":
        return tf.Qwen3MoeConfig(**raw)
    text = raw.get("text_config", raw)
    return tf.Qwen3_5MoeTextConfig(**{k: v for k, v in text.items() if k != "model_type"})


def _dense(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    return w.to(dtype) if isinstance(w, torch.Tensor) else w.dequantize(dtype)


def _source(name: str, weights: dict[str, Weight], dtype: torch.dtype, experts: int) -> torch.Tensor:
    """The canonical weight(s) behind one transformers parameter name, dense in `dtype`."""
    canon = name.removeprefix("model.").removesuffix(".weight")
    if canon.endswith("mlp.experts.gate_up_proj"):
        layer = canon.removesuffix(".gate_up_proj")
        return torch.stack(
            [
                torch.cat([_dense(weights[f"{layer}.{e}.{p}"], dtype) for p in ("gate_proj", "up_proj")])
                for e in range(experts)
            ]
        )
    if canon.endswith("mlp.experts.down_proj"):
        layer = canon.removesuffix(".down_proj")
        return torch.stack([_dense(weights[f"{layer}.{e}.down_proj"], dtype) for e in range(experts)])
    return _dense(weights[canon], dtype)


class HfPeer:
    """transformers' CausalLM over our canonical weights, behind `TokenEngine`."""

    owns_weights = True  # copied into transformers' own modules

    def __init__(
        self,
        config: ModelConfig,
        raw: dict[str, Any],
        weights: dict[str, Weight],
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        tf = _import_transformers()
        cls = tf.Qwen3MoeForCausalLM if config.model_type == "qwen3_moe" else tf.Qwen3_5MoeForCausalLM
        with torch.device(device):  # built in `dtype` on `device`: no fp32 or CPU copy of a 35B model
            self.model = cls._from_config(hf_config(raw), dtype=dtype).eval()
        with torch.no_grad():
            for name, param in self.model.state_dict().items():
                param.copy_(_source(name, weights, dtype, config.num_experts))
        self.device, self.dtype, self._tf = device, dtype, tf

    def describe(self) -> dict[str, str]:
        return {
            "engine": f"transformers {self._tf.__version__} eager generate",
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
        }

    def warmup(self, prompts: Sequence[Sequence[int]], out_lens: Sequence[int]) -> None:
        """Untimed, as the fast engine's (`bench/e2e.py`): 2 tokens for the prompts of the first prompt's
        length, batched as the timed call batches them, so that one-time work (fla-core's Triton kernels
        compile and autotune on first use; without a warm-up the peer's Qwen3.6 `single` TTFT was 38.6 s
        on the H200, session 7, where Qwen3-30B's, with no fla, was 1.1 s) is not counted as its speed."""
        rows = [p for p in prompts if len(p) == len(prompts[0])]
        self.generate_ids(rows, [SamplingParams(max_tokens=2, ignore_eos=True)] * len(rows), lambda t: None)

    def generate_ids(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], on_step: StepCallback
    ) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in prompts]
        key = lambda i: (len(prompts[i]), params[i].max_tokens)
        for (_, new), group in groupby(sorted(range(len(prompts)), key=key), key=key):
            rows = list(group)
            gen = self._tf.GenerationConfig(
                max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0
            )
            ids = torch.tensor([list(prompts[r]) for r in rows], dtype=torch.int64, device=self.device)
            with torch.no_grad():
                seqs = self.model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    generation_config=gen,
                    streamer=_StepStreamer(lambda t, rows=rows: on_step(dict(zip(rows, t, strict=True)))),
                )
            for r, s in zip(rows, seqs[:, ids.shape[1] :].tolist(), strict=True):
                out[r] = s
        return out


class _StepStreamer:
    """transformers streamer protocol (`put`, `end`): the first `put` is the prompt, every later one a
    step's tokens `[B]`, handed on as a list."""

    def __init__(self, on_tokens: Callable[[list[int]], None]) -> None:
        self.on_tokens = on_tokens
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.on_tokens(value.reshape(-1).tolist())

    def end(self) -> None:
        pass
