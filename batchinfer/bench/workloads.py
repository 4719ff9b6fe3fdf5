"""The fixed LLM benchmark workloads of `workloads.json` (a copy of shared/bench/workloads.json) as token ids.

Token ids are drawn exactly as the file's "generation" text says, so any program (ours, a peer) can
rebuild them bit for bit. Shrinking a workload for a quick run (fewer requests, shorter prompts or
outputs) happens *after* the full draw, so the requests kept are prefixes of the real ones, and every
shrink is recorded in `deviations`: a shrunk run is never mistaken for the workload itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from batchinfer.errors import ConfigError


def load_workloads(path: str | Path | None = None) -> dict[str, Any]:
    """The parsed workloads file: `path`, or the copy shipped inside the package."""
    if path is None:
        return json.loads(resources.files("batchinfer.bench").joinpath("workloads.json").read_text())
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the workloads file ({e})") from None


@dataclass(slots=True)
class WorkloadRequests:
    """The requests of one workload run: prompt token ids and the exact number of tokens to generate."""

    name: str
    spec: dict[str, Any]  # the workload's entry in the file, unchanged
    seed: int
    prompts: list[list[int]]
    out_lens: list[int]
    deviations: dict[str, int] = field(default_factory=dict)  # every shrink or clamp applied

    @property
    def capped(self) -> bool:
        return "max_requests" in self.deviations

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def draw_tokens(
    spec: dict[str, Any], seed: int, token_lo: int, token_hi: int
) -> tuple[list[np.ndarray], list[int]]:
    """Prompts and output lengths of a workload in the file's draw order (all lengths first, then prompts)."""
    rng = np.random.default_rng(seed)
    n = int(spec["n"])
    in_lens = rng.integers(spec["in_lo"], spec["in_hi"] + 1, size=n)
    out_lens = rng.integers(spec["out_lo"], spec["out_hi"] + 1, size=n)
    prompts = [rng.integers(token_lo, token_hi, size=int(in_lens[i])) for i in range(n)]
    return prompts, [int(x) for x in out_lens]


def workload_requests(
    name: str,
    *,
    vocab_size: int,
    max_requests: int | None = None,
    max_in: int | None = None,
    max_out: int | None = None,
    workloads: dict[str, Any] | None = None,
) -> WorkloadRequests:
    """The requests of LLM workload `name`, optionally shrunk, with ids valid for a `vocab_size` model.

    `max_requests` keeps the first N requests; `max_in`/`max_out` cut prompts to their first tokens
    and outputs to at most that many. Ids >= `vocab_size` (only tiny test models have a vocab below
    the file's `token_hi`) become `id % vocab_size`, recorded as deviation `token_ids_mod_vocab`.
    """
    doc = workloads if workloads is not None else load_workloads()
    llm = doc["llm"]
    if name not in llm:
        raise ConfigError(f"unknown workload {name!r}; the workloads file has {', '.join(llm)}")
    spec = llm[name]
    deviations: dict[str, int] = {}
    for opt, value in (("max_requests", max_requests), ("max_in", max_in), ("max_out", max_out)):
        if value is not None and value < 1:
            raise ConfigError(f"--{opt.replace('_', '-')} must be >= 1, got {value}")
    prompts, out_lens = draw_tokens(spec, int(doc["seed"]), int(doc["token_lo"]), int(doc["token_hi"]))
    if max_requests is not None and max_requests < len(prompts):
        prompts, out_lens = prompts[:max_requests], out_lens[:max_requests]
        deviations["max_requests"] = max_requests
    if max_in is not None and max_in < spec["in_hi"]:
        prompts = [p[:max_in] for p in prompts]
        deviations["max_in"] = max_in
    if max_out is not None and max_out < spec["out_hi"]:
        out_lens = [min(n, max_out) for n in out_lens]
        deviations["max_out"] = max_out
    if int(doc["token_hi"]) > vocab_size:
        prompts = [p % vocab_size for p in prompts]
        deviations["token_ids_mod_vocab"] = vocab_size
    return WorkloadRequests(
        name=name,
        spec=spec,
        seed=int(doc["seed"]),
        prompts=[p.tolist() for p in prompts],
        out_lens=out_lens,
        deviations=deviations,
    )
