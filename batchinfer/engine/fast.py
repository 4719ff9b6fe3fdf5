"""The GPU engine's generation loop: static slots, continuous refill, CUDA-graphed decode steps.

All requests are known up front (offline). Each running sequence owns a slot of the state pools
(`KernelModel.new_state`), sized from free GPU memory and the longest prompt + max_tokens. Requests wait
longest-output-first; whenever `refill_fraction` of the slots are free (or every waiting prompt fits),
waiting prompts are prefilled together (packed, up to `prefill_tokens` tokens a pass; after a pass of more
than half that runs out of memory, at most half its tokens: `pass_tokens`) and join the decode batch, which
then runs one token per running sequence per step. The two set the split between prefill passes and decode
steps (`bench run --prefill-tokens/--refill-fraction` measures it). A prompt longer than a pass is prefilled
in pieces (chunked prefill: each piece continues the slot's KV cache and DeltaNet state), one pass between
decode steps, so a long prompt does not stall the running batch.
A decode step is a CUDA graph replay for the smallest captured batch-size bucket >= the running count
(padding rows have slot and position -1: no state traffic, nothing attended), then greedy argmax or the
fused sampler on the GPU; the sampled ids stay on the device as the next step's input. Their copy to
the host (pinned, one small copy a step) is read one step late, while the next step runs, so the host
never waits on the step it launched: a row whose token limit the step in flight reaches leaves the batch
on the device (a gather of the static buffers, no read-back), and a row stopped by a stop token or a
callback computes one extra token, which is dropped. The host waits on the GPU only before a prefill
pass, whose new rows are loaded from its view of every row.
With `prefill_graph_tokens`, a pass that is one fresh prompt (the latency case: about a thousand kernel
launches for little device work) replays the CUDA graph of its length bucket, a power of two from 64 up to
`prefill_graph_tokens`: the prompt, then a filler sequence up to the bucket in the scratch slot.
`generate` has the contract of `models.generate.generate`, so the text engine and the benchmark use
either interchangeably.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch

from batchinfer.engine.api import SamplingParams
from batchinfer.engine.kernel_model import KernelModel, SlotState, pack_prompts
from batchinfer.kernels.sampling import sample
from batchinfer.models.generate import GenerationOutput, StepCallback

log = logging.getLogger(__name__)

# Decode batch cap (free memory caps it too). Qwen3.6 `offline`, whole workload, fp16 DeltaNet state on
# the H200 (session 16): 512 -> 1024 (918 fitted, mean batch 415.6 -> 667.5) took 9,828 to 10,715 output
# tok/s: longer steps, each reading the weights once for more tokens. On the fp32 state free memory caps it
# first (804 slots on the H200, session 21); not measured on `extract`.
MAX_SLOTS = 1024
# Prompt tokens a prefill pass (`FastGenerator.pass_tokens` goes lower after a large pass runs out of
# memory). On the H200 (session 21, whole workloads, Qwen3.6): `offline` on the fp32 state 9,187 / 9,478 /
# 9,619 output tok/s at 16,384 / 32,768 / 65,536; `extract` with `bf16_experts` 69,313 / 71,365 total at
# 32,768 / 65,536. Longer passes read each layer's experts once for more tokens.
PREFILL_TOKENS = 65536
REFILL_FRACTION = 0.125  # waiting prompts are prefilled once this fraction of the slots is free
MEMORY_RESERVE = 0.1  # of total GPU memory kept free for activations and the graphs' pool
# A lone fresh prompt up to this long is prefilled by a CUDA graph: `single`'s time to first token on the
# H200 went from 44.2 to 26.5 ms (Qwen3.6, 512 tokens, session 10), the same output tokens.
PREFILL_GRAPH_TOKENS = 2048
# A padded decode row's slot and position: the kernels read and write no state for a negative slot
# (its DeltaNet state would otherwise be read and written in full, 126 MB a step on Qwen3.6's fp32
# state) and a position of -1 gives it nothing to attend to.
PAD = -1


@dataclass(slots=True, eq=False)  # identity: `in` tests find the very sequence
class _Seq:
    index: int  # request index
    prompt: list[int]
    params: SamplingParams
    slot: int = -1
    prefilled: int = 0  # prompt tokens already in the slot (chunked prefill)
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None


@dataclass(slots=True, eq=False)
class _Step:
    """A launched decode step whose tokens the host has not recorded yet: its rows and, on CUDA, their
    tokens on the way to a pinned host buffer, with the event that says they are there."""

    rows: list[_Seq]
    tokens: torch.Tensor
    arrived: torch.cuda.Event | None = None

    def wait(self) -> list[int]:
        if self.arrived is not None:
            self.arrived.synchronize()
        return self.tokens[: len(self.rows)].tolist()


def _buckets(slots: int) -> list[int]:
    """Decode batch sizes captured as graphs: powers of two, then multiples of 64, up to `slots`."""
    sizes = {min(2**i, slots) for i in range(7)} | set(range(64, slots, 64)) | {slots}
    return sorted(sizes)


_PrefillGraph = tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...], torch.Tensor]  # graph, inputs, logits


def prefill_bucket(tokens: int) -> int:
    """The padded length of a graphed prefill: a power of two, at least 64."""
    return max(64, 1 << (tokens - 1).bit_length())


def padded_prompt(prompt: Sequence[int], slot: int, scratch: int, bucket: int) -> tuple[torch.Tensor, ...]:
    """`KernelModel.prefill`'s packed inputs (`pack_prompts`, without `past`) for `prompt` in `slot`
    followed by a filler sequence of token 0 in the `scratch` slot up to `bucket` tokens: the filler has
    its own KV cache and DeltaNet state, so the prompt's are exactly its own."""
    return pack_prompts([prompt, [0] * (bucket - len(prompt))], [slot, scratch], [0, 0])[:5]


class FastGenerator:
    """Runs `KernelModel` over many requests; see the module docstring. One generator per GPU."""

    def __init__(
        self,
        model: KernelModel,
        max_slots: int = MAX_SLOTS,
        prefill_tokens: int = PREFILL_TOKENS,
        refill_fraction: float = REFILL_FRACTION,
        cuda_graphs: bool | None = None,
        prefill_graph_tokens: int = PREFILL_GRAPH_TOKENS,
    ) -> None:
        if prefill_tokens < 1 or not 0 < refill_fraction <= 1 or prefill_graph_tokens < 0:
            raise ValueError(
                f"prefill_tokens={prefill_tokens} (>= 1), refill_fraction={refill_fraction} (in (0, 1]) "
                f"or prefill_graph_tokens={prefill_graph_tokens} (>= 0) out of range"
            )
        self.model = model
        self.max_slots = max_slots
        self.prefill_tokens = prefill_tokens
        self.pass_tokens = prefill_tokens  # the budget in force: lowered after an out-of-memory pass
        self.refill_fraction = refill_fraction
        self.cuda_graphs = model.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.prefill_graph_tokens = prefill_graph_tokens
        self.device = model.device
        if self.device.type == "cuda":  # Triton launches and graph captures go to the current device
            torch.cuda.set_device(self.device)
        self._state: SlotState | None = None
        self._slots = 0  # of the last plan; `release` keeps it (the run's record), `_state` says if live
        self._max_len = 0
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._prefill_graphs: dict[int, _PrefillGraph] = {}
        self._pool = None
        self.stats: dict[str, int] = {
            "prefill_passes": 0,
            "decode_steps": 0,
            "graph_captures": 0,
            "prefill_out_of_memory": 0,
        }
        self.batch_sizes: list[int] = []

    @property
    def slots(self) -> int:
        """Slots the last call planned: `max_slots`, or fewer where free memory or the requests capped them
        (0 before the first call; kept after `release`)."""
        return self._slots

    def release(self) -> None:
        """Free the state pools and captured graphs (the next `generate` allocates them again)."""
        self._state = None
        self._graphs.clear()
        self._prefill_graphs.clear()
        self._pool = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def prepare(self, n: int, max_len: int) -> None:
        """Allocate the pools for `n` requests of up to `max_len` tokens and capture the decode graph of
        every batch bucket (and with `prefill_graph_tokens` the prefill graph of every length bucket) now,
        so a timed run that follows (same or smaller needs) does neither."""
        slots = self._ensure_state(n, max_len)
        if self.cuda_graphs:
            self._slot_ids.fill_(PAD)  # a pool kept from an earlier run may hold its last rows
            self._pos.fill_(PAD)
            with torch.inference_mode():
                for bucket in _buckets(slots):  # rows are padding: nothing real advances
                    self._decode_logits(bucket)
                bucket = 64
                while bucket <= self.prefill_graph_tokens and bucket - 1 <= self._max_len:
                    self._prefill_graphed([0], self._slots, bucket)  # the scratch slot's own prompt
                    bucket *= 2

    # ---- capacity ----

    def _plan_slots(self, n: int, max_len: int, held: int = 0) -> int:
        """Slots for `n` requests of `max_len` tokens in free memory plus the `held` bytes of pools that
        would be freed first."""
        if self.device.type != "cuda":  # the interpreter on a CPU: tests and tiny models
            return min(n, self.max_slots, 64)
        free, total = torch.cuda.mem_get_info(self.device)
        free += held
        usable = free - MEMORY_RESERVE * total
        fit = int(usable // self.model.slot_bytes(max_len)) - 1  # one scratch slot for graph padding
        if fit < 1:
            raise torch.OutOfMemoryError(
                f"not even one sequence of {max_len} tokens fits in the {free / 2**30:.1f} GiB free "
                f"on {self.device}"
            )
        return min(n, fit, self.max_slots)

    def _ensure_state(self, n: int, max_len: int) -> int:
        """Pools for at least min(n, what fits) slots of `max_len` tokens; returns the slot count to use."""
        if self._state is not None and self._max_len >= max_len:
            if self._slots >= min(n, self.max_slots):
                return self._slots
            # Pools that memory capped stay unless a new plan (their bytes freed first) gives more slots:
            # planning again would otherwise only reallocate and recapture every graph, inside a timed
            # run and in every later call of a job.
            held = self.model.slot_bytes(self._max_len) * (self._slots + 1)
            if self._plan_slots(n, max_len, held) <= self._slots:
                return self._slots
        self.release()
        slots = self._plan_slots(n, max_len)
        self._state = self.model.new_state(slots + 1, max_len)  # slot `slots` is the padding scratch
        self._slots, self._max_len = slots, max_len
        dev = self.device
        self._ids = torch.zeros(slots, dtype=torch.int64, device=dev)
        self._pos = torch.full((slots,), PAD, dtype=torch.int32, device=dev)
        self._slot_ids = torch.full((slots,), PAD, dtype=torch.int32, device=dev)
        self._temperature = torch.zeros(slots, dtype=torch.float32, device=dev)
        self._top_k = torch.zeros(slots, dtype=torch.int32, device=dev)
        self._top_p = torch.ones(slots, dtype=torch.float32, device=dev)
        self._seeds = torch.zeros(slots, dtype=torch.int64, device=dev)
        self._steps = torch.zeros(slots, dtype=torch.int64, device=dev)
        if dev.type == "cuda":  # two: a step's tokens land in one while the host reads the other's
            self._host_tokens = [torch.empty(slots, dtype=torch.int64, pin_memory=True) for _ in range(2)]
            self._arrived = [torch.cuda.Event(), torch.cuda.Event()]
        log.info(
            "engine state: %d slots of %d tokens (%.1f GiB)",
            slots,
            max_len,
            self.model.slot_bytes(max_len) * (slots + 1) / 2**30,
        )
        return slots

    # ---- one decode step ----

    def _decode_logits(self, bucket: int) -> torch.Tensor:
        args = (self._state, self._ids[:bucket], self._pos[:bucket], self._slot_ids[:bucket])
        if not self.cuda_graphs:
            return self.model.decode(*args)
        if bucket not in self._graphs:
            # Warm-up (kernel compilation, cuBLAS setup) outside the capture. It really runs, so it runs
            # on the scratch slot: the rows' state must advance once, in the replay below.
            rows = self._slot_ids[:bucket].clone()
            self._slot_ids[:bucket] = self._slots
            self.model.decode(*args)
            self._slot_ids[:bucket] = rows
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self.model.decode(*args)
            self._pool = graph.pool()
            self._graphs[bucket] = (graph, logits)
            self.stats["graph_captures"] += 1
        graph, logits = self._graphs[bucket]
        graph.replay()
        return logits

    def _load_rows(self, rows: list[_Seq]) -> None:
        """Copy the running rows' next inputs and sampling parameters into the static buffers."""
        n = len(rows)
        pos = [len(s.prompt) + len(s.tokens) - 1 for s in rows]
        self._ids[:n].copy_(torch.tensor([s.tokens[-1] for s in rows], dtype=torch.int64))
        self._pos[:n].copy_(torch.tensor(pos, dtype=torch.int32))
        self._slot_ids.fill_(PAD)
        self._slot_ids[:n].copy_(torch.tensor([s.slot for s in rows], dtype=torch.int32))
        self._pos[n:].fill_(PAD)
        self._temperature[:n].copy_(torch.tensor([s.params.temperature for s in rows], dtype=torch.float32))
        self._top_k[:n].copy_(torch.tensor([s.params.top_k for s in rows], dtype=torch.int32))
        self._top_p[:n].copy_(torch.tensor([s.params.top_p for s in rows], dtype=torch.float32))
        self._seeds[:n].copy_(torch.tensor([s.params.seed for s in rows], dtype=torch.int64))
        self._steps[:n].copy_(torch.tensor([len(s.tokens) for s in rows], dtype=torch.int64))

    def _keep_rows(self, keep: list[int], n: int) -> None:
        """Rows `keep` of the first `n` of the static buffers move to the front, on the device (their ids
        and positions are the device's own, one step ahead of the host); the rest become padding.
        The index goes up from pinned memory without a stream sync, behind the step in flight."""
        idx = torch.tensor(keep, dtype=torch.int64)
        if self.device.type == "cuda":
            idx = idx.pin_memory()
        idx = idx.to(self.device, non_blocking=True)
        k = len(keep)
        for buf in (self._ids, self._pos, self._slot_ids, self._temperature, self._top_k, self._top_p,
                    self._seeds, self._steps):  # fmt: skip
            buf[:k] = buf[idx]
        self._slot_ids[k:n] = PAD
        self._pos[k:n] = PAD

    def _fetch(self, tokens: torch.Tensor, rows: list[_Seq]) -> _Step:
        """Start the copy of a step's tokens to the host (on CUDA into the pinned buffer the previous step
        did not use) and return the step to record later."""
        if self.device.type != "cuda":
            return _Step(rows, tokens)
        i = self.stats["decode_steps"] % 2
        self._host_tokens[i][: len(rows)].copy_(tokens, non_blocking=True)
        self._arrived[i].record(torch.cuda.current_stream(self.device))
        return _Step(rows, self._host_tokens[i], self._arrived[i])

    def _sample(
        self, logits: torch.Tensor, rows: Sequence[_Seq], params: Callable[[], tuple[torch.Tensor, ...]]
    ) -> torch.Tensor:
        """Next tokens of `rows`: greedy rows need no parameters, so `params` (temperature, top_k,
        top_p, seeds, steps on the device) is called only for a batch with sampled rows."""
        if all(s.params.temperature == 0 for s in rows):
            return logits.argmax(-1)
        filtered = any(s.params.top_k or s.params.top_p < 1 for s in rows)
        return sample(logits.contiguous(), *params(), filtered=filtered)

    def _row_params(self, b: int) -> tuple[torch.Tensor, ...]:
        """The sampling parameters of the decode batch's first `b` rows, as `sample` takes them."""
        return self._temperature[:b], self._top_k[:b], self._top_p[:b], self._seeds[:b], self._steps[:b]

    # ---- prefill ----

    def _next_pass(
        self, partial: list[_Seq], pending: deque[_Seq], free: list[int], refill: bool
    ) -> list[tuple[_Seq, int]]:
        """The pieces `(seq, tokens)` of the next prefill pass, at most `pass_tokens` in all: prompts
        already started first, then (when refilling) waiting prompts that fit whole; a prompt longer than
        the budget starts alone and goes on in later passes (chunked prefill)."""
        budget, pieces = self.pass_tokens, []
        for s in partial:
            if budget == 0:
                break
            n = min(len(s.prompt) - s.prefilled, budget)
            pieces.append((s, n))
            budget -= n
        while refill and pending and free and budget and (not pieces or len(pending[0].prompt) <= budget):
            s = pending.popleft()
            s.slot = free.pop()
            pieces.append((s, min(len(s.prompt), budget)))
            budget -= pieces[-1][1]
        return pieces

    def _prefill(self, pieces: list[tuple[_Seq, int]]) -> list[tuple[_Seq, int, int | None]]:
        """Prefill the pieces (slots assigned); per piece `(seq, tokens prefilled, first output token or
        None while its prompt is unfinished)`. On out-of-memory, splits the pass and retries, down to
        halving a single piece. A failed pass of more than half the budget lowers the budget to half its
        tokens, so a budget too large for this GPU costs one failure, not one a pass; a smaller pass
        failing says little about the budget and leaves it. Later pieces of chunked prompts get their
        slots' DeltaNet state back before the retry (the failed pass may have advanced it in some layers)."""
        later = [s.slot for s, _ in pieces if s.prefilled]
        saved = None
        try:
            saved = self._state.copy_rows(later) if later else None  # type: ignore[union-attr]
            return self._prefill_pass(pieces)
        except torch.OutOfMemoryError:
            if saved is not None:
                self._state.restore_rows(later, saved)  # type: ignore[union-attr]
            if len(pieces) == 1 and pieces[0][1] == 1:
                raise
        # Retried out here, once the error (and with its traceback the failed pass's activations) is gone.
        torch.cuda.empty_cache()
        self.stats["prefill_out_of_memory"] += 1
        tokens = sum(n for _, n in pieces)
        if 2 * tokens > self.pass_tokens:
            log.warning("prefill passes now hold at most %d tokens (was %d)", tokens // 2, self.pass_tokens)
            self.pass_tokens = max(1, tokens // 2)
        if len(pieces) > 1:
            half = len(pieces) // 2
            log.warning(
                "prefill of %d prompts ran out of GPU memory; retrying as %d + %d",
                len(pieces),
                half,
                len(pieces) - half,
            )
            return self._prefill(pieces[:half]) + self._prefill(pieces[half:])
        s, n = pieces[0]
        log.warning(
            "prefill of %d tokens of request %d ran out of GPU memory; retrying with %d", n, s.index, n // 2
        )
        return self._prefill([(s, n // 2)])

    def _prefill_pass(self, pieces: list[tuple[_Seq, int]]) -> list[tuple[_Seq, int, int | None]]:
        dev = self.device
        s0, n0 = pieces[0]
        bucket = prefill_bucket(n0)
        if (
            self.cuda_graphs
            and len(pieces) == 1
            and n0 == len(s0.prompt)
            and bucket <= self.prefill_graph_tokens
            and bucket - n0 <= self._max_len  # the filler fits in the scratch slot
        ):
            logits = self._prefill_graphed(s0.prompt, s0.slot, bucket)
        else:
            logits = self.model.prefill_prompts(
                self._state,
                [s.prompt[s.prefilled : s.prefilled + n] for s, n in pieces],
                [s.slot for s, _ in pieces],
                starts=[s.prefilled for s, _ in pieces],
            )
        self.stats["prefill_passes"] += 1
        done = [i for i, (s, n) in enumerate(pieces) if s.prefilled + n == len(s.prompt)]
        first: dict[int, int] = {}
        if done:
            group = [pieces[i][0] for i in done]
            p = [s.params for s in group]
            tokens = self._sample(
                logits[done],
                group,
                lambda: (
                    torch.tensor([x.temperature for x in p], dtype=torch.float32).to(dev),
                    torch.tensor([x.top_k for x in p], dtype=torch.int32).to(dev),
                    torch.tensor([x.top_p for x in p], dtype=torch.float32).to(dev),
                    torch.tensor([x.seed for x in p], dtype=torch.int64).to(dev),
                    torch.zeros(len(group), dtype=torch.int64, device=dev),
                ),
            )
            first = dict(zip(done, tokens.tolist(), strict=True))
        return [(s, n, first.get(i)) for i, (s, n) in enumerate(pieces)]

    @torch.inference_mode()  # the graph's input buffers are inference tensors (captured in `prepare`)
    def _prefill_graphed(self, prompt: list[int], slot: int, bucket: int) -> torch.Tensor:
        """Logits `[1, V]` of one fresh prompt, by the CUDA graph of its length bucket (captured on first
        use, after a warm-up pass of the same lengths that writes only the scratch slot)."""
        if bucket not in self._prefill_graphs:
            scratch = padded_prompt(prompt, self._slots, self._slots, bucket)
            inputs = tuple(x.to(self.device) for x in scratch)
            self.model.prefill(self._state, *inputs, bucket)  # compiles; the scratch slot only
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self.model.prefill(self._state, *inputs, bucket)
            self._pool = graph.pool()
            self._prefill_graphs[bucket] = (graph, inputs, logits)
            self.stats["graph_captures"] += 1
        graph, inputs, logits = self._prefill_graphs[bucket]
        for buf, x in zip(inputs, padded_prompt(prompt, slot, self._slots, bucket), strict=True):
            buf.copy_(x)
        graph.replay()
        return logits[:1]

    # ---- the loop ----

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        stop_token_ids: Collection[int] = frozenset(),
        on_step: StepCallback | None = None,
    ) -> list[GenerationOutput]:
        """Generate for each prompt with its own sampling params (contract of `models.generate.generate`)."""
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        if not prompts:
            return []
        vocab = self.model.config.vocab_size
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"sequence {i} is empty")
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"sequence {i} has token ids outside 0..{vocab - 1}")
        seqs = [_Seq(i, list(p), sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
        max_len = max(len(s.prompt) + s.params.max_tokens for s in seqs)
        slots = self._ensure_state(len(seqs), max_len)
        buckets = _buckets(slots)
        # Longest-output first: short requests fill the slots the long ones leave behind.
        pending = deque(sorted(seqs, key=lambda s: -s.params.max_tokens))
        free = list(range(slots - 1, -1, -1))
        running: list[_Seq] = []
        partial: list[_Seq] = []  # prompts prefilled in part (longer than one pass)
        dirty = True
        prefilled_last = False
        lag: _Step | None = None  # the last decode step: launched, its tokens not recorded yet
        refill_at = max(1, int(slots * self.refill_fraction))
        with torch.inference_mode():
            while pending or running or partial:
                refill = bool(pending and free) and (not running or len(free) >= min(refill_at, len(pending)))
                # a long prompt's pieces alternate with decode steps, so it never stalls the batch
                if (refill or partial) and not (partial and running and prefilled_last):
                    if lag is not None:  # the batch is rebuilt below from the host's view of every row
                        self._record(lag.rows, lag.wait(), stop_token_ids, on_step)
                        lag = None
                        free += [s.slot for s in running if s.finish is not None]
                        running = [s for s in running if s.finish is None]
                    started, first = [], []
                    for s, n, token in self._prefill(self._next_pass(partial, pending, free, refill)):
                        s.prefilled += n
                        if token is not None:
                            started.append(s)
                            first.append(token)
                        elif s not in partial:
                            partial.append(s)
                    partial = [s for s in partial if s not in started]
                    if started:
                        self._record(started, first, stop_token_ids, on_step)
                    running += [s for s in started if s.finish is None]
                    free += [s.slot for s in started if s.finish is not None]
                    dirty = prefilled_last = True
                    continue
                prefilled_last = False
                if dirty:
                    self._load_rows(running)
                    dirty = False
                b = len(running)
                bucket = next(x for x in buckets if x >= b)
                self.batch_sizes.append(b)
                logits = self._decode_logits(bucket)[:b]
                tokens = self._sample(
                    logits,
                    running,
                    functools.partial(self._row_params, b),
                )
                self._ids[:b].copy_(tokens)
                self._pos[:b] += 1
                self._steps[:b] += 1
                step = self._fetch(tokens, list(running))
                self.stats["decode_steps"] += 1
                if lag is not None:  # the step before, finished or nearly: read while this one runs
                    self._record(lag.rows, lag.wait(), stop_token_ids, on_step)
                lag = step
                # Rows done once this step's token is in (their limit), or stopped already (a stop token or
                # the callback: this step's token for them is dropped), leave before the next step.
                leaving = [s.finish is not None or len(s.tokens) + 1 >= s.params.max_tokens for s in running]
                if any(leaving):
                    free += [s.slot for s, gone in zip(running, leaving, strict=True) if gone]
                    self._keep_rows([i for i, gone in enumerate(leaving) if not gone], b)
                    running = [s for s, gone in zip(running, leaving, strict=True) if not gone]
            if lag is not None:
                self._record(lag.rows, lag.wait(), stop_token_ids, on_step)
        return [GenerationOutput(s.tokens, s.finish or "length") for s in seqs]

    @staticmethod
    def _record(
        rows: Sequence[_Seq], tokens: list[int], stop_ids: Collection[int], on_step: StepCallback | None
    ) -> None:
        """Append each row's token and mark the rows it finishes; rows that finished before (a decode
        step launched before their stop was read) keep their tokens."""
        live = [(s, t) for s, t in zip(rows, tokens, strict=True) if s.finish is None]
        for s, t in live:
            s.tokens.append(t)
            if t in stop_ids and not s.params.ignore_eos:
                s.finish = "stop"
            elif len(s.tokens) >= s.params.max_tokens:
                s.finish = "length"
        if on_step is not None and live:
            step = {s.index: t for s, t in live}
            by_index = {s.index: s for s, _ in live}
            for i in on_step(step) or ():
                if i in by_index:
                    by_index[i].finish = "stop"
