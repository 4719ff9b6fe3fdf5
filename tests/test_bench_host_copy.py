"""`bench run` takes its own weights off the GPU while an engine that copied them runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from batchinfer.kernels.nvfp4 import FP8Weight, NVFP4Weight, quantize_fp8, quantize_nvfp4

from batchinfer.bench import host_copy
from batchinfer.bench.e2e import FastTokenEngine, ReferenceTokenEngine
from batchinfer.bench.hf_peer import HfPeer
from batchinfer.bench.host_copy import HostCopy
from batchinfer.bench.workload_run import build_model, weights_off_gpu


def _weights(device: str = "cpu") -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(5, 7, generator=g).bfloat16().to(device),  # odd sizes: every part re-aligned
        "norm": torch.randn(3, generator=g).to(device),
        "ids": torch.arange(11, dtype=torch.int64).to(device),
        "q4": quantize_nvfp4(torch.randn(4, 32, generator=g).to(device)),
        "q8": quantize_fp8(torch.randn(6, 16, generator=g).to(device)),
    }


def _tensors(w) -> list[torch.Tensor]:
    return [w] if isinstance(w, torch.Tensor) else [getattr(w, f.name) for f in dataclasses.fields(w)]


def _same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for name in a:
        assert type(a[name]) is type(b[name]), name
        for s, t in zip(_tensors(a[name]), _tensors(b[name]), strict=True):
            assert s.dtype == t.dtype and s.shape == t.shape and torch.equal(s.cpu(), t.cpu()), name


def test_host_copy_gives_every_weight_back_bit_for_bit():
    weights = _weights()
    host = HostCopy(weights)
    back = host.to(torch.device("cpu"))
    _same(weights, back)
    assert isinstance(back["q4"], NVFP4Weight) and isinstance(back["q8"], FP8Weight)
    assert back["q4"].tensor_scale.shape == () and host.nbytes % 256 == 0
    # views of one buffer, each on its own aligned start
    ptrs = [t.data_ptr() for w in back.values() for t in _tensors(w)]
    assert len(set(ptrs)) == len(ptrs) and all(p % 256 == back["embed"].data_ptr() % 256 for p in ptrs)
    weights["embed"].zero_()  # a copy: later changes to the source do not reach it
    assert host.to(torch.device("cpu"))["embed"].abs().sum() > 0


def test_a_tensor_under_two_names_is_copied_once_and_comes_back_shared():
    weights = _weights()
    weights["lm_head"] = weights["embed"]  # tied, as the loader ties them
    host = HostCopy(weights)
    assert host.nbytes == HostCopy({n: w for n, w in weights.items() if n != "lm_head"}).nbytes
    back = host.to(torch.device("cpu"))
    assert back["lm_head"] is back["embed"] and torch.equal(back["lm_head"], weights["embed"])


def test_the_size_is_known_before_the_copy_and_host_memory_is_read():
    weights = _weights()
    weights["lm_head"] = weights["embed"]
    assert host_copy.nbytes(weights) == HostCopy(weights).nbytes
    room = host_copy.host_available()
    assert room is None or room > 0


def test_engines_say_whether_they_run_on_their_own_copies():
    assert FastTokenEngine.owns_weights and HfPeer.owns_weights and not ReferenceTokenEngine.owns_weights


def _tiny(device: str, dtype: torch.dtype, preset: str = "tiny-qwen3-moe", quant: str = "nvfp4"):
    return build_model(model_path=None, preset=preset, quant=quant, device=torch.device(device), dtype=dtype)


def test_weights_stay_put_on_the_cpu():
    bm = _tiny("cpu", torch.float32)
    weights, model = bm.weights, bm.model
    with weights_off_gpu(bm) as where:
        assert where == "cpu" and bm.weights is weights and bm.model is model
    assert bm.host is None and bm.reference is model  # an fp32 model is its own reference


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_weights_stay_on_the_gpu_without_host_room(monkeypatch):
    bm = _tiny("cuda", torch.bfloat16)
    monkeypatch.setattr(host_copy, "host_available", lambda: host_copy.nbytes(bm.weights))
    model = bm.model
    with weights_off_gpu(bm) as where:
        assert where == "cuda" and bm.model is model and bm.host is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_weights_leave_the_gpu_and_come_back():
    dev = torch.device("cuda", torch.cuda.current_device())  # as the model reports it (with its index)
    bm = _tiny("cuda", torch.bfloat16, "tiny-qwen3.5-moe", "mixed")
    ids = torch.randint(0, bm.config.vocab_size, (1, 12), device=dev)
    logits = bm.reference.forward(ids, bm.reference.new_cache(1, 12))
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated(dev)
    with weights_off_gpu(bm) as where:
        assert where == "host memory" and bm.models is None
        assert bm.weights["embed_tokens"].device.type == "cpu"
        with pytest.raises(RuntimeError, match="in host memory"):
            bm.reference  # noqa: B018
        assert torch.cuda.memory_allocated(dev) < held - bm.host.nbytes // 2
    assert bm.model.device == dev and bm.reference.dtype == torch.float32
    again = bm.reference.forward(ids, bm.reference.new_cache(1, 12))
    assert torch.equal(logits, again)
