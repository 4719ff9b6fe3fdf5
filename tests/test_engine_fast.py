"""The GPU engine (`engine.kernel_model`, `engine.fast`, `engine.gpu`): exactness against the fp32 reference,
the slot scheduler, stop handling, out-of-memory splitting and the job path.

On the CPU the Triton kernels run under the interpreter (set here), at tiny shapes and short prompts;
CUDA graphs are exercised by the `gpu` tests only.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pyarrow.parquet as pq  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from batchinfer.bench.exactness import engine_exactness  # noqa: E402
from batchinfer.checkpoint.loader import load_checkpoint  # noqa: E402
from batchinfer.checkpoint.presets import build_checkpoint  # noqa: E402
from batchinfer.cli import cli  # noqa: E402
from batchinfer.engine.api import SamplingParams  # noqa: E402
from batchinfer.engine.fast import FastGenerator  # noqa: E402
from batchinfer.engine.kernel_model import KernelModel  # noqa: E402
from batchinfer.engine.loader import load_engine  # noqa: E402
from batchinfer.errors import ConfigError  # noqa: E402
from batchinfer.models.generate import generate  # noqa: E402
from batchinfer.models.qwen_moe import QwenMoeModel  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "models" / "demo-qwen3.5-moe"
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _models(preset: str, quant: str, device: str = "cpu"):
    raw, tensors = build_checkpoint(preset, quant=quant, device=device)
    cfg, w = load_checkpoint(tensors, config=raw, device=device, dtype=torch.bfloat16)
    return cfg, QwenMoeModel(cfg, w, dtype=torch.float32), KernelModel(cfg, w)


def _random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("preset,quant", [("tiny-qwen3.5-moe", "mixed"), ("tiny-qwen3-moe", "nvfp4")])
def test_teacher_forced_logits_match_the_fp32_reference(preset, quant):
    """Both paths (packed prefill, token-by-token decode) against the fp32 reference; the 70-token
    sequence takes the chunked DeltaNet prefill, the 24-token one the recurrent one. The issue's limits
    on rel. L2 and prefill top-1 (94 positions); decode top-1 over only 8 positions is a coin toss on a
    random tiny model's near-ties, so there its rel. L2 stands in (the GPU test checks all at real widths)."""
    cfg, ref, km = _models(preset, quant)
    bf16 = QwenMoeModel(cfg, dict(ref.weights), dtype=torch.bfloat16)
    seqs = _random_prompts(cfg.vocab_size, [24, 70])
    result = engine_exactness(km, ref, seqs, decode_tail=4, bf16_reference=bf16)
    assert max(result.prefill_rel_l2, result.decode_rel_l2) <= 2e-2 and result.prefill_top1 >= 0.95, result
    # No worse than the plain bf16 PyTorch forward by more than half again.
    assert result.prefill_rel_l2 <= 1.5 * result.bf16_reference_rel_l2 + 2e-3, result


def test_slots_refill_and_stop_rules():
    """More requests than slots (refill), exact max_tokens, a stop token, and a stop from on_step."""
    cfg, ref, km = _models("tiny-qwen3.5-moe", "bf16")
    prompts = _random_prompts(cfg.vocab_size, [5, 9, 3, 30, 12])
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (6, 4, 8, 3, 5)]
    gen = FastGenerator(km, max_slots=2)
    outs = gen.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [6, 4, 8, 3, 5]
    assert all(o.finish_reason == "length" for o in outs)
    assert gen.stats["prefill_passes"] >= 3  # two slots for five requests: refilled as rows finished
    # Greedy, alone, gives the same tokens: a row's output does not depend on its batch.
    assert (
        FastGenerator(km, max_slots=1).generate([prompts[3]], [params[3]])[0].token_ids == outs[3].token_ids
    )

    first = outs[0].token_ids
    stop_at = first[2]
    out = gen.generate([prompts[0]], [SamplingParams(max_tokens=6)], stop_token_ids={stop_at})[0]
    assert out.finish_reason == "stop" and out.token_ids == first[: first.index(stop_at) + 1]

    def stop_second_step(tokens: dict[int, int]) -> list[int]:
        stop_second_step.calls += 1
        return list(tokens) if stop_second_step.calls == 2 else []

    stop_second_step.calls = 0
    out = gen.generate(
        [prompts[1]], [SamplingParams(max_tokens=6, ignore_eos=True)], on_step=stop_second_step
    )[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == 2


def test_prefill_out_of_memory_is_split_and_retried(monkeypatch, caplog):
    cfg, ref, km = _models("tiny-qwen3.5-moe", "bf16")
    prompts = _random_prompts(cfg.vocab_size, [5, 7, 9])
    params = [SamplingParams(max_tokens=2, ignore_eos=True)] * 3
    expected = FastGenerator(km).generate(prompts, params)
    gen = FastGenerator(km)
    real = gen._prefill_pass

    def small_only(group):
        if len(group) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(group)

    monkeypatch.setattr(gen, "_prefill_pass", small_only)
    outs = gen.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert "ran out of GPU memory; retrying" in caplog.text


def test_prepare_sizes_the_pools_once_for_a_whole_workload():
    """`prepare` (the benchmark's untimed warm-up) allocates for the whole workload; later calls with
    smaller needs keep the same pools (no reallocation, no graph recapture inside a timed run)."""
    cfg, ref, km = _models("tiny-qwen3-moe", "bf16")
    gen = FastGenerator(km)
    gen.prepare(3, 40)
    state = gen._state
    assert state is not None and gen._slots == 3 and state.max_len == 40
    out = gen.generate(_random_prompts(cfg.vocab_size, [5, 7]), [SamplingParams(max_tokens=2)] * 2)
    assert [len(o.token_ids) for o in out] == [2, 2] and gen._state is state


def test_bad_prompts_are_refused_with_their_index():
    cfg, ref, km = _models("tiny-qwen3-moe", "bf16")
    gen = FastGenerator(km)
    with pytest.raises(ValueError, match="sequence 1 has token ids outside"):
        gen.generate([[5, 6], [5, cfg.vocab_size]], [SamplingParams(max_tokens=2)] * 2)
    with pytest.raises(ValueError, match="sequence 0 is empty"):
        gen.generate([[]], [SamplingParams(max_tokens=2)])


def test_demo_model_through_the_job_path(tmp_path):
    """The trained demo model, `batchinfer run --engine-arg engine=fast` vs `engine=reference` (fp32): shards,
    Parquet, and the same answers (its logits are decisive, so bf16 rounding does not flip them)."""
    table = pq.read_table(ROOT / "examples" / "demo-prompts.parquet").slice(0, 4)
    inputs = tmp_path / "in.parquet"
    pq.write_table(table, inputs)
    texts = {}
    for engine in ("fast", "reference"):
        out = tmp_path / engine
        args = ["run", "--input", str(inputs), "--model", str(DEMO), "--output", str(out),
                "--max-tokens", "16", "--shards", "2", "--engine-arg", f"engine={engine}",
                "--engine-arg", "device=cpu", "--progress", "none"]  # fmt: skip
        result = CliRunner().invoke(cli, args, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        done = [pq.read_table(p).to_pylist() for p in sorted((out / "shards").rglob("*.parquet"))]
        texts[engine] = {r["id"]: r["text"] for part in done for r in part}
    assert len(texts["fast"]) == len(texts["reference"]) == 4
    assert texts["fast"] == texts["reference"]
    answers = dict(zip(table["id"].to_pylist(), table["answer"].to_pylist(), strict=True))
    assert sum(texts["fast"][i].strip() == a for i, a in answers.items()) >= 3


def test_fast_engine_refuses_a_cpu_without_the_interpreter(monkeypatch):
    with pytest.raises(ConfigError, match="the fast engine computes in bfloat16"):
        load_engine(DEMO, device="cpu", engine="fast", dtype="float32")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="engine=fast runs Triton kernels and needs a CUDA device"):
        load_engine(DEMO, device="cpu", engine="fast")


@pytest.mark.gpu
@GPU
def test_cuda_graphs_match_eager_decode():
    cfg, ref, km = _models("tiny-qwen3.5-moe", "mixed", "cuda")
    prompts = _random_prompts(cfg.vocab_size, [5, 90, 17, 33, 64])
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (20, 7, 33, 12, 25)]
    graphed = FastGenerator(km, max_slots=3, cuda_graphs=True)
    eager = FastGenerator(km, max_slots=3, cuda_graphs=False)
    assert [o.token_ids for o in graphed.generate(prompts, params)] == [
        o.token_ids for o in eager.generate(prompts, params)
    ]
    assert graphed.stats["graph_captures"] >= 2


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("preset,quant", [("qwen3.6-35b-a3b", "mixed"), ("qwen3-30b-a3b", "nvfp4")])
def test_real_widths_exactness_on_gpu(preset, quant):
    """Real widths (experts, heads, head dims), first 4 layers, both paths at the issue's limits."""
    import dataclasses

    from batchinfer.checkpoint.loader import model_config_from_hf
    from batchinfer.checkpoint.presets import preset_config, random_weights

    cfg = model_config_from_hf(preset_config(preset))
    cfg = dataclasses.replace(cfg, num_hidden_layers=4, layer_types=cfg.layer_types[:4])
    w = random_weights(cfg, device="cuda", scheme=quant)
    ref = QwenMoeModel(cfg, w, dtype=torch.float32)
    seqs = _random_prompts(cfg.vocab_size, [288, 300, 260, 290])
    result = engine_exactness(KernelModel(cfg, w), ref, seqs)
    assert result.passed, result


def test_generate_contract_matches_the_reference_generate():
    """Same finish reasons and lengths as `models.generate.generate` on the same requests."""
    cfg, ref, km = _models("tiny-qwen3-moe", "bf16")
    prompts = _random_prompts(cfg.vocab_size, [4, 6])
    params = [SamplingParams(max_tokens=3, ignore_eos=True), SamplingParams(max_tokens=5, ignore_eos=True)]
    ours = FastGenerator(km).generate(prompts, params)
    theirs = generate(ref, prompts, params)
    assert [(len(o.token_ids), o.finish_reason) for o in ours] == [
        (len(o.token_ids), o.finish_reason) for o in theirs
    ]
