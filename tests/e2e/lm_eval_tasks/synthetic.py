"""The local datasets of the lm-eval tasks beside this file (actq_mc.yaml, actq_gen.yaml,
actq_rolling.yaml): short arithmetic and capital-city questions and a few sentences about them,
made up here, so that the tasks need no hub and the repository holds no dataset. The same seed
gives the same items, in the same order.

    python -m tests.e2e.lm_eval_tasks.synthetic DIR [--mc 8] [--gen 4]

writes DIR/actq_mc.jsonl, DIR/actq_gen.jsonl and DIR/actq_rolling.jsonl; run lm_eval from DIR (the tasks' `data_files`
are relative to the directory lm_eval runs in) with `--include_path` naming this folder."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

TASKS = Path(__file__).resolve().parent  # the task YAMLs: lm_eval's --include_path / TaskManager(include_path=...)

CAPITALS = [
    ("France", "Paris"),
    ("Japan", "Tokyo"),
    ("Italy", "Rome"),
    ("Germany", "Berlin"),
    ("Spain", "Madrid"),
    ("Egypt", "Cairo"),
    ("Canada", "Ottawa"),
    ("Russia", "Moscow"),
    ("Greece", "Athens"),
    ("Norway", "Oslo"),
    ("Kenya", "Nairobi"),
    ("Peru", "Lima"),
]


def _arithmetic(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    return f"What is {a} + {b}?", a + b


def mc_items(count: int, seed: int = 0) -> list[dict]:
    """`count` questions with four choices each (`answer`: the right one's index): every fourth a
    capital city, the others a sum whose wrong choices are one off and ten off."""
    rng = random.Random(seed)
    items = []
    for i in range(count):
        if i % 4 == 0:
            country, capital = CAPITALS[(i // 4) % len(CAPITALS)]
            others = rng.sample([c for _, c in CAPITALS if c != capital], 3)
            question, right, choices = f"What is the capital of {country}?", capital, [capital, *others]
        else:
            question, total = _arithmetic(rng)
            right, choices = str(total), [str(total), str(total + 1), str(total - 1), str(total + 10)]
        rng.shuffle(choices)
        items.append({"question": question, "choices": choices, "answer": choices.index(right)})
    return items


def gen_items(count: int, seed: int = 1) -> list[dict]:
    """`count` sums to answer in words the model writes (`answer`: the sum as digits)."""
    rng = random.Random(seed)
    return [{"question": q, "answer": str(total)} for q, total in (_arithmetic(rng) for _ in range(count))]


def rolling_items(count: int, seed: int = 2) -> list[dict]:
    """`count` short documents (`text`) of a few sentences each, for perplexity."""
    rng = random.Random(seed)
    items = []
    for _ in range(count):
        sentences = []
        for country, capital in rng.sample(CAPITALS, 3):
            a, b = rng.randint(2, 40), rng.randint(2, 40)
            sentences.append(f"The capital of {country} is {capital}, and {a} plus {b} makes {a + b}.")
        items.append({"text": " ".join(sentences)})
    return items


def write(folder: Path, mc: int, gen: int, rolling: int = 4) -> Path:
    """The tasks' data files in `folder` (the directory to run lm_eval in)."""
    folder.mkdir(parents=True, exist_ok=True)
    files = (
        ("actq_mc.jsonl", mc_items(mc)),
        ("actq_gen.jsonl", gen_items(gen)),
        ("actq_rolling.jsonl", rolling_items(rolling)),
    )
    for name, items in files:
        (folder / name).write_text("".join(json.dumps(item) + "\n" for item in items))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--mc", type=int, default=8, help="multiple-choice items")
    parser.add_argument("--gen", type=int, default=4, help="generation items")
    args = parser.parse_args()
    print(write(args.folder, args.mc, args.gen))


if __name__ == "__main__":
    main()
