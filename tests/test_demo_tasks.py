"""Demo tasks: correct answers, disjoint deterministic splits, ChatML corpus and the tokenizer round trip."""

import random
import re

import pytest

from batchinfer.demo.corpus import build_demo_tokenizer, chatml_prompt, chatml_text, tokenizer_corpus
from batchinfer.demo.tasks import (
    HELDOUT_FRACTION,
    TASKS,
    Example,
    Task,
    make_examples,
    make_mixture,
    score,
    split_of,
)
from batchinfer.tokenizer import Tokenizer

# smallest unit of each quantity: mm, mg, ml
_BASE = {"km": 10**6, "m": 10**3, "cm": 10, "mm": 1, "kg": 10**6, "g": 10**3, "mg": 1, "l": 10**3, "ml": 1}


def solve(task: str, prompt: str) -> str:
    """An independent solver that parses the prompt text."""
    if task == "add":
        a, b = re.fullmatch(r"What is (\d+) \+ (\d+)\?", prompt).groups()
        return str(int(a) + int(b))
    if task == "reverse":
        return " ".join(re.fullmatch(r"Reverse: ([a-z](?: [a-z])*)", prompt).group(1).split()[::-1])
    if task == "sort":
        numbers = re.fullmatch(r"Sort: (\d+(?: \d+)*)", prompt).group(1).split()
        return " ".join(str(n) for n in sorted(int(x) for x in numbers))
    if task == "count":
        target, letters = re.fullmatch(r"Count ([a-z]) in: ([a-z](?: [a-z])*)", prompt).groups()
        return str(letters.split().count(target))
    if task == "convert":
        value, src, dst = re.fullmatch(r"Convert (\d+) (\w+) to (\w+)", prompt).groups()
        assert src[-1:] == dst[-1:] or {src, dst} <= {"l", "ml"}  # same quantity
        whole, rest = divmod(int(value) * _BASE[src], _BASE[dst])
        assert rest == 0, prompt
        return str(whole)
    raise AssertionError(task)


def test_hand_checked_first_examples_of_seed_0():
    first = {t: make_examples(t, 1, seed=0, split="train")[0] for t in TASKS}
    assert (first["add"].prompt, first["add"].answer) == ("What is 789 + 973?", "1762")
    assert (first["reverse"].prompt, first["reverse"].answer) == ("Reverse: e s v j u k", "k u j v s e")
    assert (first["sort"].prompt, first["sort"].answer) == ("Sort: 61 45 37 52", "37 45 52 61")
    assert (first["count"].prompt, first["count"].answer) == ("Count d in: c e d c a b d e b", "2")
    assert (first["convert"].prompt, first["convert"].answer) == ("Convert 78850 mm to cm", "7885")


@pytest.mark.parametrize("task", list(TASKS))
def test_answers_match_an_independent_solver(task):
    for split in ("train", "heldout"):
        for e in make_examples(task, 300, seed=7, split=split):
            assert e.task == task
            assert e.answer == solve(task, e.prompt), e
            assert len(e.prompt) <= 40 and len(e.answer) <= 20


def test_at_least_five_tasks_with_descriptions():
    assert len(TASKS) >= 5
    assert all(t.description and name == t.name for name, t in TASKS.items())


@pytest.mark.parametrize("task", list(TASKS))
def test_splits_are_disjoint_and_prompts_distinct(task):
    train = {e.prompt for s in (0, 1, 2) for e in make_examples(task, 400, seed=s, split="train")}
    heldout = [e.prompt for e in make_examples(task, 400, seed=0, split="heldout")]
    assert len(set(heldout)) == 400
    assert not train & set(heldout)
    assert all(split_of(task, p) == "heldout" for p in heldout)
    assert all(split_of(task, p) == "train" for p in train)


def test_heldout_share_of_the_prompt_space():
    rng = random.Random(0)
    prompts = {TASKS["add"].generate(rng)[0] for _ in range(20000)}
    share = sum(split_of("add", p) == "heldout" for p in prompts) / len(prompts)
    assert abs(share - HELDOUT_FRACTION) < 0.01


def test_deterministic_per_seed_and_split():
    assert make_examples("sort", 50, seed=3, split="train") == make_examples(
        "sort", 50, seed=3, split="train"
    )
    assert make_examples("sort", 50, seed=3, split="train") != make_examples(
        "sort", 50, seed=4, split="train"
    )
    mix = make_mixture(20, seed=5, split="heldout")
    assert mix == make_mixture(20, seed=5, split="heldout")
    assert len(mix) == 20 * len(TASKS) and {e.task for e in mix[:15]} != {mix[0].task}  # interleaved
    assert [e.task for e in make_mixture(3, 5, "train", tasks=["add"])] == ["add"] * 3


def test_errors_name_what_is_wrong():
    with pytest.raises(ValueError, match="unknown task 'nope'; known tasks: add, reverse"):
        make_examples("nope", 1, 0, "train")
    with pytest.raises(ValueError, match="split must be one of"):
        make_examples("add", 1, 0, "test")
    tiny = Task("coin", "two prompts only", lambda rng: (rng.choice(["heads", "tails"]), "x"))
    with pytest.raises(
        ValueError, match="task 'coin': found only [0-2] distinct train prompts, 5 were asked"
    ):
        make_examples(tiny, 5, 0, "train")


def test_score_is_exact_match_after_stripping():
    assert score("add", " 1762\n", "1762")
    assert not score("add", "01762", "1762")
    assert not score("sort", "37 45  52 61", "37 45 52 61")
    assert score("sort", "\t37 45 52 61 ", "37 45 52 61")
    with pytest.raises(ValueError, match="unknown task"):
        score("nope", "1", "1")


def test_chatml_matches_the_chat_template(tmp_path):
    build_demo_tokenizer(tmp_path, vocab_size=400, n_per_task=200)
    tok = Tokenizer.from_pretrained(tmp_path)
    e = Example("add", "What is 1 + 2?", "3")
    user = [{"role": "user", "content": e.prompt}]
    assert chatml_prompt(e.prompt) == tok.apply_chat_template(user, add_generation_prompt=True)
    both = [*user, {"role": "assistant", "content": e.answer}]
    assert chatml_text(e) == tok.apply_chat_template(both, add_generation_prompt=False)


def test_corpus_holds_only_train_prompts():
    corpus = tokenizer_corpus(100, seed=0)
    assert len(corpus) == 100 * len(TASKS)
    first_word = {
        "What": "add",
        "Reverse:": "reverse",
        "Sort:": "sort",
        "Count": "count",
        "Convert": "convert",
    }
    for text in corpus:
        prompt, answer = re.fullmatch(
            r"<\|im_start\|>user\n(.*)<\|im_end\|>\n<\|im_start\|>assistant\n(.*)<\|im_end\|>\n", text
        ).groups()
        task = first_word[prompt.split()[0]]
        assert split_of(task, prompt) == "train" and answer == solve(task, prompt)


def test_demo_tokenizer_round_trips_every_task(tmp_path):
    build_demo_tokenizer(tmp_path, vocab_size=512)
    tok = Tokenizer.from_pretrained(tmp_path)
    im_start, im_end = tok.encode("<|im_start|>"), tok.encode("<|im_end|>")
    assert len(im_start) == 1 and len(im_end) == 1
    for split in ("train", "heldout"):
        for e in make_mixture(200, seed=11, split=split):
            for text in (e.prompt, e.answer, f"{e.prompt} {e.answer}"):
                assert tok.decode(tok.encode(text)) == text
            ids = tok.encode(chatml_text(e))
            assert tok.decode(ids, skip_special_tokens=False) == chatml_text(e)
            assert ids.count(im_start[0]) == 2 and ids.count(im_end[0]) == 2
            assert len(ids) <= 64  # the demo model's context (~128) holds every conversation
