"""Train the demo model: a small Qwen3.5-MoE on the synthetic tasks, written as a real HF checkpoint.

    python -m batchinfer.demo.train --out models/demo-qwen3.5-moe            # GPU if present, else CPU
    python -m batchinfer.demo.train --out /tmp/demo --device cpu --steps 50  # a quick CPU smoke run

The model is trained through the reference forward of `batchinfer.models` (the same math every
engine is checked against), on ChatML conversations from the train split, with the loss on the
answer and its closing `<|im_end|>` only. The checkpoint is written by the checkpoint writer in the
official Qwen3.5 layout, so it loads through exactly the same path as a downloaded model. A
`training.json` beside it records the seed, data sizes, the schedule and the held-out accuracy.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from batchinfer.checkpoint.layout import weight_specs
from batchinfer.checkpoint.loader import load_checkpoint, model_config_from_hf
from batchinfer.checkpoint.presets import random_weights
from batchinfer.checkpoint.writer import save_checkpoint
from batchinfer.demo.corpus import build_demo_tokenizer, chatml_prompt
from batchinfer.demo.tasks import TASKS, Example, make_examples, make_mixture, score
from batchinfer.engine.api import SamplingParams
from batchinfer.models.generate import generate
from batchinfer.models.qwen_moe import QwenMoeModel
from batchinfer.tokenizer import Tokenizer

log = logging.getLogger("batchinfer.demo.train")

VOCAB_SIZE = 384  # embedding rows; the trained BPE stops below this (see training.json)


def demo_config(vocab_size: int, eos_id: int, pad_id: int) -> dict[str, Any]:
    """The demo model's `config.json`: Qwen3.5-MoE layout at a few million parameters."""
    text = {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": vocab_size,
        "hidden_size": 192,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "attn_output_gate": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 48,
        "linear_value_head_dim": 48,
        "linear_conv_kernel_dim": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 192,
        "shared_expert_intermediate_size": 192,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": pad_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "dtype": "bfloat16",
    }
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "text_config": text,
    }


def encode(tok: Tokenizer, examples: list[Example], eos_id: int) -> list[tuple[list[int], int]]:
    """(token ids of prompt + answer + <|im_end|>, index where the answer starts) per example."""
    out = []
    for e in examples:
        prompt = tok.encode(chatml_prompt(e.prompt))
        out.append((prompt + tok.encode(e.answer) + [eos_id], len(prompt)))
    return out


def batch_tensors(rows: list[tuple[list[int], int]], pad_id: int, device: str):
    """Right-padded inputs, next-token targets (-100 outside the answers) and real lengths."""
    T = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), T), -100, dtype=torch.long)
    for b, (seq, start) in enumerate(rows):
        ids[b, : len(seq)] = torch.tensor(seq)
        targets[b, start - 1 : len(seq) - 1] = torch.tensor(seq[start:])
    lengths = torch.tensor([len(seq) for seq, _ in rows])
    return ids.to(device), targets.to(device), lengths.to(device)


def train_logits(model: QwenMoeModel, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The reference forward with autograd on: `forward` itself runs under inference_mode, so call
    the function it wraps, on a fresh cache sized to the batch."""
    cache = model.new_cache(ids.shape[0], ids.shape[1])
    return QwenMoeModel.forward.__wrapped__(model, ids, cache, lengths)


def evaluate(model: QwenMoeModel, tok: Tokenizer, examples: list[Example], eos_id: int) -> dict[str, float]:
    """Greedy exact-match accuracy per task on `examples`."""
    prompts = [tok.encode(chatml_prompt(e.prompt)) for e in examples]
    params = [SamplingParams(max_tokens=24) for _ in examples]
    outs = generate(model, prompts, params, stop_token_ids={eos_id})
    hits: dict[str, list[bool]] = {t: [] for t in TASKS}
    for e, o in zip(examples, outs, strict=True):
        text = tok.decode([t for t in o.token_ids if t != eos_id])
        hits[e.task].append(score(e.task, text, e.answer))
    return {t: sum(h) / len(h) for t, h in hits.items() if h}


def train(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    out = Path(args.out)
    build_demo_tokenizer(out, VOCAB_SIZE, n_per_task=2000, seed=args.seed)
    tok = Tokenizer.from_pretrained(out)
    eos_id, pad_id = tok.hf.token_to_id("<|im_end|>"), tok.hf.token_to_id("<|endoftext|>")
    raw = demo_config(VOCAB_SIZE, eos_id, pad_id)
    cfg = model_config_from_hf(raw, source="demo config")

    if args.init_from:  # continue training an earlier checkpoint (same config and tokenizer)
        init_cfg, start = load_checkpoint(args.init_from, device=args.device, dtype=torch.float32)
        if init_cfg != cfg:
            raise ValueError(f"--init-from {args.init_from}: its config differs from the demo config")
    else:
        start = random_weights(cfg, seed=args.seed, device=args.device, dtype=torch.float32)
    params = {n: w.detach().float().clone().requires_grad_(True) for n, w in start.items()}
    n_params = sum(p.numel() for p in params.values())
    decay = [p for n, p in params.items() if weight_specs(cfg)[n].linear or n == "embed_tokens"]
    no_decay = [p for n, p in params.items() if not (weight_specs(cfg)[n].linear or n == "embed_tokens")]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
    )
    train_rows = encode(tok, make_mixture(args.train_per_task, args.seed, "train"), eos_id)
    for task, weight in (w.split("=") for w in args.task_weight):  # e.g. add=3: 3x the add examples
        extra = make_examples(task, args.train_per_task * (int(weight) - 1), args.seed + 7, "train")
        train_rows += encode(tok, extra, eos_id)
    heldout = make_mixture(args.eval_per_task, args.seed + 1, "heldout")
    log.info("%d parameters, %d training examples, device %s", n_params, len(train_rows), args.device)

    g = torch.Generator().manual_seed(args.seed)
    t0, history, steps_done = time.time(), [], 0
    for step in range(1, args.steps + 1):
        if args.max_seconds and time.time() - t0 > args.max_seconds:
            log.warning(
                "stopping at step %d of %d: --max-seconds %d reached", step - 1, args.steps, args.max_seconds
            )
            break
        steps_done = step
        lr = args.lr * min(1.0, step / args.warmup) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in opt.param_groups:
            group["lr"] = max(lr, args.lr * 0.02)
        pick = torch.randint(len(train_rows), (args.batch,), generator=g).tolist()
        ids, targets, lengths = batch_tensors([train_rows[i] for i in pick], pad_id, args.device)
        logits = train_logits(QwenMoeModel(cfg, params), ids, lengths)  # [B, T, V]
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        opt.step()
        if step % args.log_every == 0 or step == args.steps:
            history.append(
                {"step": step, "loss": round(loss.item(), 4), "seconds": round(time.time() - t0, 1)}
            )
            log.info("step %d loss %.4f lr %.2e (%.0fs)", step, loss.item(), lr, time.time() - t0)

    weights = {n: p.detach().to(torch.bfloat16) for n, p in params.items()}
    accuracy = evaluate(QwenMoeModel(cfg, weights), tok, heldout, eos_id)
    mean = sum(accuracy.values()) / len(accuracy)
    log.info("held-out exact match %.3f: %s", mean, accuracy)
    save_checkpoint(out, raw, weights)
    record = {
        "seed": args.seed,
        "init_from": args.init_from,
        "task_weight": args.task_weight,
        "steps": args.steps,
        "steps_done": steps_done,
        "batch": args.batch,
        "lr": args.lr,
        "warmup": args.warmup,
        "train_examples_per_task": args.train_per_task,
        "eval_examples_per_task": args.eval_per_task,
        "parameters": n_params,
        "tokenizer_vocab": tok.vocab_size,
        "device": args.device,
        "train_seconds": round(time.time() - t0, 1),
        "loss_history": history,
        "heldout_exact_match": {**{k: round(v, 4) for k, v in accuracy.items()}, "mean": round(mean, 4)},
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="checkpoint folder to write")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-per-task", type=int, default=40000)
    p.add_argument("--eval-per-task", type=int, default=200)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--max-seconds", type=int, default=0, help="stop early (and still save) after this long")
    p.add_argument("--init-from", help="continue from this checkpoint instead of random weights")
    p.add_argument("--task-weight", action="append", default=[], help="TASK=N: N times that task's examples")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    record = train(p.parse_args())
    print(json.dumps(record["heldout_exact_match"]))


if __name__ == "__main__":
    main()
