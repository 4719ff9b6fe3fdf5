"""The transformers peer of `bench run`: same weights, same greedy tokens as our reference."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from click.testing import CliRunner

from batchinfer.bench.e2e import ReferenceTokenEngine
from batchinfer.bench.hf_peer import HfPeer
from batchinfer.bench.workload_run import build_model
from batchinfer.bench.workloads import workload_requests
from batchinfer.cli import cli
from batchinfer.engine.api import SamplingParams
from batchinfer.errors import ConfigError

CPU = torch.device("cpu")


@pytest.mark.parametrize(("preset", "quant"), [("tiny-qwen3.5-moe", "mixed"), ("tiny-qwen3-moe", "nvfp4")])
def test_peer_generates_the_reference_tokens(preset, quant):
    bm = build_model(model_path=None, preset=preset, quant=quant, device=CPU, dtype=torch.float32)
    req = workload_requests("offline", vocab_size=512, max_requests=4, max_in=12, max_out=10)
    req.prompts[2] = req.prompts[2][:7]  # two prompt lengths: two generate calls
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in req.out_lens]
    steps: list[dict[int, int]] = []
    peer = HfPeer(bm.config, bm.raw, bm.weights, CPU, torch.float32)
    peer.warmup(req.prompts, req.out_lens)  # untimed, before the run: changes nothing after it
    ours = ReferenceTokenEngine(bm.model, 8).generate_ids(req.prompts, params, lambda t: None)
    theirs = peer.generate_ids(req.prompts, params, steps.append)
    assert theirs == ours and [len(t) for t in theirs] == req.out_lens
    assert sum(len(s) for s in steps) == sum(req.out_lens)  # every token reported once, by request index
    assert [s[2] for s in steps if 2 in s] == theirs[2]
    assert peer.describe()["engine"].startswith("transformers ")


def test_cli_reports_the_peer_beside(tmp_path):
    out = tmp_path / "conc32.json"
    args = ["bench", "run", "--workload", "conc32", "--preset", "tiny-qwen3.5-moe", "--random"]
    args += ["--max-requests", "3", "--max-in", "16", "--max-out", "8", "--peer", "hf"]
    args += ["--peer-max-requests", "2", "--json", str(out)]
    res = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    peer = doc["peer"]
    assert peer["capped"] and peer["deviations"]["max_requests"] == 2
    assert peer["results"]["requests"] == 2 and peer["results"]["output_tokens"] == 16
    assert peer["results"]["batch_sizes"] == {"max": 2, "mean": 2.0, "steps": {"2": 8}}
    assert peer["accuracy_lock"]["passed"] and peer["accuracy_lock"]["top1_agreement"] == 1.0
    assert doc["results"]["requests"] == 3 and doc["capped"]
    assert "eager generate on cpu (capped): 2 requests" in res.output


def test_missing_transformers_is_a_clear_error(monkeypatch):
    bm = build_model(model_path=None, preset="tiny-qwen3-moe", quant="bf16", device=CPU, dtype=torch.float32)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ConfigError, match=r"--peer hf needs Hugging Face transformers.*batchinfer\[test\]"):
        HfPeer(bm.config, bm.raw, bm.weights, CPU, torch.float32)
