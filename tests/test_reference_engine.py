"""End to end on tiny random checkpoints: ReferenceEngine, load_engine and `batchinfer generate`."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from batchinfer.checkpoint.presets import write_preset
from batchinfer.cli import cli
from batchinfer.engine.api import SamplingParams, TextRequest, TextResult
from batchinfer.engine.loader import load_engine
from batchinfer.errors import ConfigError

PROMPTS = ["The quick brown fox", "Hello! How can I help you today?", "def add(a, b):", "Numbers 0 1 2"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 30?"}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_preset("tiny-qwen3.5-moe", tmp_path_factory.mktemp("q35") / "ckpt", seed=1)


@pytest.fixture(scope="module")
def engine(ckpt):
    return load_engine(ckpt, device="cpu")


def run(engine, requests) -> dict[int, TextResult]:
    results = list(engine.generate(requests))
    assert sorted(r.index for r in results) == sorted(r.index for r in requests)  # one result per request
    return {r.index: r for r in results}


def greedy(engine, prompt: str, max_tokens: int = 24) -> TextResult:
    return run(engine, [TextRequest(0, prompt=prompt, sampling=SamplingParams(max_tokens=max_tokens))])[0]


def test_describe_and_defaults(engine, ckpt):
    assert engine.describe() == {
        "model": str(ckpt),
        "model_type": "qwen3_5_moe",
        "quantization": "bf16",
        "engine": "reference",
        "device": "cpu",
        "dtype": "float32",
    }
    assert engine.max_model_len == 4096
    assert engine.stop_token_ids == {
        json.loads((ckpt / "generation_config.json").read_text())["eos_token_id"]
    }


def test_length_and_natural_eos(engine):
    eos = set(engine.tokenizer.eos_token_ids)
    res = run(
        engine,
        [TextRequest(i, prompt=p, sampling=SamplingParams(max_tokens=24)) for i, p in enumerate(PROMPTS)],
    )
    for i, r in res.items():
        assert r.prompt_tokens == len(engine.tokenizer.encode(PROMPTS[i])) and r.error is None
        assert r.output_tokens == len(r.token_ids) and r.text == engine.tokenizer.decode(r.token_ids)
        if r.finish_reason == "length":
            assert r.output_tokens == 24 and not eos & set(r.token_ids)
        else:
            assert r.finish_reason == "stop" and r.token_ids[-1] in eos and not eos & set(r.token_ids[:-1])
    assert "length" in {r.finish_reason for r in res.values()}


def test_eos_from_generation_config_stops(engine, ckpt, tmp_path):
    ref = greedy(engine, PROMPTS[1], max_tokens=24)
    k = 6
    eos = ref.token_ids[k]
    k = ref.token_ids.index(eos)  # its first occurrence
    folder = shutil.copytree(ckpt, tmp_path / "eos")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 999_999]}))
    eng = load_engine(folder, device="cpu")
    r = greedy(eng, PROMPTS[1], max_tokens=24)
    assert (r.finish_reason, r.token_ids, r.output_tokens) == ("stop", ref.token_ids[: k + 1], k + 1)
    assert r.text == engine.tokenizer.decode(ref.token_ids[:k])  # the EOS token is not text
    ignore = SamplingParams(max_tokens=24, ignore_eos=True)
    r = run(eng, [TextRequest(5, prompt=PROMPTS[1], sampling=ignore)])[5]
    assert (r.finish_reason, r.token_ids) == ("length", ref.token_ids)


def test_stop_strings(engine):
    ref = greedy(engine, PROMPTS[2], max_tokens=24)
    stop = ref.text[8:11]
    assert len(stop) == 3 and ref.finish_reason == "length"
    cut = ref.text.find(stop)
    params = SamplingParams(max_tokens=24, stop=["never appears \u2603", stop])
    r = run(engine, [TextRequest(0, prompt=PROMPTS[2], sampling=params)])[0]
    assert (r.finish_reason, r.text) == ("stop", ref.text[:cut])
    assert r.output_tokens < 24 and r.token_ids == ref.token_ids[: r.output_tokens]
    assert stop in engine.tokenizer.decode(r.token_ids)  # the last token completed the stop string
    assert stop not in engine.tokenizer.decode(r.token_ids[:-1])


def test_bad_rows_are_results(engine):
    long_prompt = "Numbers 0 1 2 3 4 5 6 7 8 9 " * 200
    n_long = len(engine.tokenizer.encode(long_prompt))
    requests = [
        TextRequest(0, prompt=""),
        TextRequest(1, messages=[]),
        TextRequest(2, messages=[{"role": "user", "content": ["not", "a", "string"]}]),
        TextRequest(3, prompt="hi", messages=CHAT),
        TextRequest(4, messages=[{"role": "user", "content": "hi"}, "oops"]),
        TextRequest(5, prompt=long_prompt, sampling=SamplingParams(max_tokens=1)),
        TextRequest(6, prompt=PROMPTS[1], sampling=SamplingParams(max_tokens=3)),
        TextRequest(7, prompt=None),
    ]
    res = run(engine, requests)
    assert {i: r.finish_reason for i, r in res.items()} == {
        0: "skipped",
        1: "skipped",
        2: "error",
        3: "error",
        4: "error",
        5: "skipped",
        6: "length",
        7: "skipped",
    }
    assert res[0].error == "empty prompt" and res[7].error == "empty prompt"
    assert res[1].error == "empty messages list"
    assert res[2].error == "messages[0].content must be a string, got list ['not', 'a', 'string']"
    assert res[3].error == "request has both a prompt and messages; give exactly one"
    assert res[4].error == "messages[1] must be a dict with 'role' and 'content', got str 'oops'"
    assert res[5].error == (
        f"prompt of {n_long} tokens + max_tokens 1 = {n_long + 1} exceeds the context limit 4096 "
        "(max_position_embeddings)"
    )
    assert res[5].prompt_tokens == n_long > 4096
    for i, r in res.items():
        if i != 6:
            assert (r.text, r.output_tokens, r.token_ids) == ("", 0, [])


def test_max_model_len_boundary(ckpt):
    eng = load_engine(
        ckpt, device="cpu", max_model_len="32", max_batch_size="1"
    )  # as --engine-arg gives them
    assert (eng.max_model_len, eng.max_batch_size) == (32, 1)
    n = len(eng.tokenizer.encode(PROMPTS[3]))
    over = SamplingParams(max_tokens=33 - n, ignore_eos=True)
    fits = SamplingParams(max_tokens=32 - n, ignore_eos=True)
    res = run(
        eng,
        [TextRequest(0, prompt=PROMPTS[3], sampling=over), TextRequest(1, prompt=PROMPTS[3], sampling=fits)],
    )
    assert res[0].finish_reason == "skipped"
    assert (
        res[0].error
        == f"prompt of {n} tokens + max_tokens {33 - n} = 33 exceeds the context limit 32 (max_model_len)"
    )
    assert (res[1].finish_reason, res[1].prompt_tokens + res[1].output_tokens) == ("length", 32)
    with pytest.raises(ConfigError, match="max_model_len 5000 must be in 1..4096"):
        load_engine(ckpt, device="cpu", max_model_len=5000)


def test_bad_max_model_len_is_refused_before_the_weights_load(ckpt, tmp_path):
    no_weights = shutil.copytree(
        ckpt, tmp_path / "no_weights", ignore=shutil.ignore_patterns("*.safetensors*")
    )
    with pytest.raises(ConfigError, match="max_model_len 5000 must be in 1..4096"):
        load_engine(no_weights, device="cpu", max_model_len=5000)


def test_chat_matches_rendered_prompt(engine):
    rendered = engine.tokenizer.apply_chat_template(CHAT)
    res = run(
        engine,
        [
            TextRequest(0, messages=CHAT, sampling=SamplingParams(max_tokens=8)),
            TextRequest(1, prompt=rendered, sampling=SamplingParams(max_tokens=8)),
        ],
    )
    assert res[0].prompt_tokens == res[1].prompt_tokens == len(engine.tokenizer.encode_chat(CHAT))
    assert res[0].token_ids == res[1].token_ids and res[0].text == res[1].text


def test_seeded_sampling_independent_of_batch(ckpt, engine):
    def req(i: int, prompt: str, seed: int) -> TextRequest:
        return TextRequest(
            i, prompt=prompt, sampling=SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=seed)
        )

    alone = {i: run(engine, [req(i, p, 100 + i)])[i] for i, p in enumerate(PROMPTS)}
    # Other rows, other order, odd indices, smaller batches: each row's tokens stay the same.
    small = load_engine(ckpt, device="cpu", max_batch_size=3)
    mixed = [req(40 + i, p, 100 + i) for i, p in reversed(list(enumerate(PROMPTS)))]
    mixed += [TextRequest(99, prompt="A mixture-of-experts layer", sampling=SamplingParams(max_tokens=5))]
    for eng in (engine, small):
        res = run(eng, mixed)
        for i in range(len(PROMPTS)):
            assert res[40 + i].token_ids == alone[i].token_ids and res[40 + i].text == alone[i].text
    other_seed = run(engine, [req(0, PROMPTS[0], 7)])[0]
    assert other_seed.token_ids != alone[0].token_ids


def test_on_tokens_counts_generated(engine):
    counted = []
    requests = [
        TextRequest(i, prompt=p, sampling=SamplingParams(max_tokens=5 + i)) for i, p in enumerate(PROMPTS)
    ]
    results = list(engine.generate(requests, on_tokens=counted.append))
    assert sum(counted) == sum(r.output_tokens for r in results) == sum(5 + i for i in range(len(PROMPTS)))


def test_quantized_checkpoints_describe(tmp_path):
    for quant, expected in (("nvfp4", "nvfp4"), ("mixed", "mixed")):
        folder = write_preset("tiny-qwen3-moe", tmp_path / quant, quant=quant)
        eng = load_engine(folder, device="cpu")
        assert eng.describe()["quantization"] == expected
        assert eng.describe()["model_type"] == "qwen3_moe"
        r = greedy(eng, PROMPTS[0], max_tokens=6)
        assert r.finish_reason in ("length", "stop") and r.output_tokens >= 1


def test_load_errors(ckpt):
    with pytest.raises(ConfigError, match="dtype 'float8' is not supported"):
        load_engine(ckpt, device="cpu", dtype="float8")
    with pytest.raises(ConfigError, match="engine argument max_batch_size='many' is not an integer"):
        load_engine(ckpt, device="cpu", max_batch_size="many")
    with pytest.raises(ConfigError, match="engine argument max_batch_size=0 must be >= 1"):
        load_engine(ckpt, device="cpu", max_batch_size=0)
    with pytest.raises(ConfigError, match="device 'tpu' is not a device"):
        load_engine(ckpt, device="tpu")


def test_cli_generate(ckpt, engine, tmp_path):
    ref = run(
        engine,
        [
            TextRequest(0, prompt=PROMPTS[0], sampling=SamplingParams(max_tokens=6, seed=5)),
            TextRequest(1, messages=CHAT, sampling=SamplingParams(max_tokens=6, seed=6)),
        ],
    )
    chat_file = tmp_path / "chat.json"
    chat_file.write_text(json.dumps(CHAT))
    args = ["generate", "--model", str(ckpt), "--prompt", PROMPTS[0], "--messages-json", str(chat_file)]
    result = CliRunner().invoke(cli, [*args, "--max-tokens", "6", "--seed", "5", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    lines = result.stdout
    expected = "".join(
        f"=== [{i}] {r.finish_reason}: {r.prompt_tokens} prompt + {r.output_tokens} output tokens\n{r.text}\n"
        for i, r in sorted(ref.items())
    )
    assert lines == expected


def test_cli_generate_errors(ckpt, tmp_path):
    runner = CliRunner()
    result = runner.invoke(cli, ["generate", "--model", str(ckpt)])
    assert result.exit_code == 2 and "give at least one --prompt or a --messages-json file" in result.output
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([[{"role": "user", "content": 3}], [{"role": "user", "content": "hi"}]]))
    result = runner.invoke(
        cli, ["generate", "--model", str(ckpt), "--messages-json", str(bad), "--max-tokens", "2"]
    )
    assert result.exit_code == 1
    assert (
        "=== [0] error: 0 prompt + 0 output tokens\nerror: messages[0].content must be a string, got int 3\n"
        in (result.stdout)
    )
    assert "=== [1] " in result.stdout
    bad.write_text('{"role": "user"}')
    result = runner.invoke(cli, ["generate", "--model", str(ckpt), "--messages-json", str(bad)])
    assert result.exit_code != 0
    assert "expected one chat" in str(result.exception)


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--temperature", "nan", "temperature must be a finite number >= 0, got nan"),
        ("--temperature", "inf", "temperature must be a finite number >= 0, got inf"),
        ("--top-p", "nan", r"top_p must be in (0, 1], got nan"),
    ],
)
def test_cli_generate_refuses_sampling_values_click_lets_through(ckpt, flag, value, message):
    args = ["generate", "--model", str(ckpt), "--prompt", "hi", "--device", "cpu", flag, value]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and f"Error: sampling parameters: {message}\n" in result.output


def test_cli_generate_chat_file_not_utf8(ckpt, tmp_path):
    bad = tmp_path / "chat.json"
    bad.write_bytes(b"\xff\xfe[]")
    result = CliRunner().invoke(cli, ["generate", "--model", str(ckpt), "--messages-json", str(bad)])
    assert result.exit_code != 0
    assert str(result.exception).startswith(f"{bad}: not UTF-8 text ('utf-8' codec can't decode byte 0xff")


def test_cli_generate_interrupted_prints_what_finished(ckpt, engine, monkeypatch):
    """Ctrl-C after one completion finished: it is printed, the unfinished ones are counted, exit 130."""
    from batchinfer.engine import loader

    class StoppedAfterOne:
        def describe(self):
            return engine.describe()

        def generate(self, requests, on_tokens=None):
            yield from engine.generate(requests[1:2], on_tokens)
            raise KeyboardInterrupt

    monkeypatch.setattr(loader, "load_engine", lambda *a, **k: StoppedAfterOne())
    sampling = SamplingParams(max_tokens=4, seed=1)
    ref = run(engine, [TextRequest(1, prompt=PROMPTS[1], sampling=sampling)])[1]
    args = [
        "generate",
        "--model",
        str(ckpt),
        "--max-tokens",
        "4",
        *(a for p in PROMPTS[:3] for a in ("--prompt", p)),
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 130
    header = f"=== [1] {ref.finish_reason}: {ref.prompt_tokens} prompt + {ref.output_tokens} output tokens"
    assert result.stdout == f"{header}\n{ref.text}\n"
    assert result.stderr.endswith("interrupted: 2 of 3 completions unfinished\n")


@pytest.mark.gpu
def test_gpu_engine_matches_cpu(ckpt, engine):
    """On CUDA the default is bf16; in fp32 the GPU engine reproduces the CPU engine's greedy tokens."""
    requests = [
        TextRequest(i, prompt=p, sampling=SamplingParams(max_tokens=16)) for i, p in enumerate(PROMPTS)
    ]
    cpu = run(engine, requests)
    bf16 = load_engine(ckpt, device="cuda", engine="reference")
    assert (bf16.describe()["device"], bf16.describe()["dtype"]) == ("cuda:0", "bfloat16")
    assert all(
        r.finish_reason in ("length", "stop") and r.output_tokens for r in run(bf16, requests).values()
    )
    gpu = run(load_engine(ckpt, device="cuda", dtype="float32", engine="reference"), requests)
    assert {i: r.token_ids for i, r in gpu.items()} == {i: r.token_ids for i, r in cpu.items()}


def test_cli_generate_chats_from_stdin(ckpt, engine):
    ref = run(engine, [TextRequest(0, messages=CHAT, sampling=SamplingParams(max_tokens=4))])[0]
    args = ["generate", "--model", str(ckpt), "--messages-json", "-", "--max-tokens", "4", "--device", "cpu"]
    result = CliRunner().invoke(cli, args, input=json.dumps([CHAT, CHAT]))
    assert result.exit_code == 0, result.output
    header = (
        f"{ref.finish_reason}: {ref.prompt_tokens} prompt + {ref.output_tokens} output tokens\n{ref.text}\n"
    )
    assert result.stdout == f"=== [0] {header}=== [1] {header}"
    result = CliRunner().invoke(cli, args, input="[]")
    assert result.exit_code != 0 and "stdin: expected one chat" in str(result.exception)
