"""ChatML text of the demo tasks, and the demo model's tokenizer trained on it.

The text is what the chat template in `batchinfer.checkpoint.tokenizer_files` renders for a user
turn and the assistant's answer, so training sequences match what the engine feeds at inference.
Only the train split is used: the tokenizer never sees a held-out prompt.
"""

from __future__ import annotations

from pathlib import Path

from batchinfer.checkpoint.tokenizer_files import build_tokenizer
from batchinfer.demo.tasks import Example, make_mixture


def chatml_prompt(prompt: str) -> str:
    """The generation prompt for one user turn (template with `add_generation_prompt=True`)."""
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def chatml_text(example: Example) -> str:
    """One full conversation: the generation prompt, the answer and the closing end-of-turn."""
    return f"{chatml_prompt(example.prompt)}{example.answer}<|im_end|>\n"


def tokenizer_corpus(n_per_task: int, seed: int) -> list[str]:
    """ChatML conversations from the train split, `n_per_task` of every task."""
    return [chatml_text(e) for e in make_mixture(n_per_task, seed, "train")]


def build_demo_tokenizer(out_dir: str | Path, vocab_size: int, n_per_task: int = 2000, seed: int = 0) -> None:
    """Write the demo `tokenizer.json` + `tokenizer_config.json`, trained on `tokenizer_corpus`."""
    build_tokenizer(tokenizer_corpus(n_per_task, seed), vocab_size, out_dir)
