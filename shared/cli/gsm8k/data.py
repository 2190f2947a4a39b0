"""GSM8K problems and prompts: where the problems come from, how they are asked, what is captured.

Sources: a local JSONL file in GSM8K's format (`{"question", "answer"}` a line, the answer ending
in `#### N`), the Hugging Face hub (`openai/gsm8k`, config `main`; needs `pip install datasets`),
or `samples`: a dozen easy problems in the same format that ship with actq (written for it, not
taken from GSM8K), for offline demos.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from shared.cli.gsm8k.scoring import fewshot_answer, gold_answer
from shared.errors import ToolError

ZERO_SHOT_INSTRUCTION = "Solve the problem step by step. End your reply with: The answer is <number>."
FEWSHOT_COUNT = 8


@dataclass(frozen=True)
class Problem:
    index: int  # position in the source split: stable across runs, names samples/<index>.json
    question: str
    answer: str  # GSM8K's worked answer, ending in "#### N"

    @property
    def gold(self) -> str:
        return gold_answer(self.answer)


class DatasetUnavailable(ToolError):
    """The problems cannot be had from that source here (no file, no hub)."""


def _read_jsonl(lines: list[str], source: str) -> list[Problem]:
    problems: list[Problem] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            problems.append(Problem(index=len(problems), question=row["question"], answer=row["answer"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ToolError(f"{source}:{number}: not a GSM8K line ({{'question', 'answer'}} expected): {exc}") from exc
    return problems


def load(source: str, split: str = "test") -> list[Problem]:
    """`samples`, `hub`, or a path to a JSONL file."""
    if source == "samples":
        text = resources.files("shared.cli.gsm8k").joinpath("samples.jsonl").read_text()
        return _read_jsonl(text.splitlines(), "samples")
    if source == "hub":
        try:
            import datasets  # type: ignore[import-not-found]  # optional, for `hub` only; not installed here
        except ImportError as exc:
            raise DatasetUnavailable(
                "loading GSM8K from the hub needs `pip install datasets`; or pass a JSONL path"
            ) from exc
        try:
            rows = datasets.load_dataset("openai/gsm8k", "main", split=split)
        except Exception as exc:
            raise DatasetUnavailable(f"openai/gsm8k could not be loaded from the hub: {exc}") from exc
        return [Problem(index=i, question=r["question"], answer=r["answer"]) for i, r in enumerate(rows)]
    path = Path(source).expanduser()
    if not path.is_file():
        raise DatasetUnavailable(f"{source}: no such file (give a GSM8K JSONL path, `hub` or `samples`)")
    return _read_jsonl(path.read_text().splitlines(), str(path))


def select(
    problems: list[Problem], offset: int = 0, limit: int | None = None, sample: int | None = None, seed: int = 0
) -> list[Problem]:
    """A slice (offset, limit) or a seeded random sample, in index order."""
    if sample is not None:
        chosen = random.Random(seed).sample(problems, min(sample, len(problems)))
        return sorted(chosen, key=lambda p: p.index)
    end = None if limit is None else offset + limit
    return problems[offset:end]


def fewshot_exemplars(train: list[Problem]) -> list[dict[str, str]]:
    """The first eight train problems as chat turns, answers ending "The answer is N."."""
    if len(train) < FEWSHOT_COUNT:
        raise DatasetUnavailable(f"cot-8shot needs {FEWSHOT_COUNT} train problems; got {len(train)}")
    turns: list[dict[str, str]] = []
    for problem in train[:FEWSHOT_COUNT]:
        turns += [
            {"role": "user", "content": problem.question},
            {"role": "assistant", "content": fewshot_answer(problem.answer)},
        ]
    return turns


def messages(problem: Problem, style: str, exemplars: list[dict[str, str]] | None = None) -> list[dict[str, str]]:
    if style == "zero-shot":
        return [{"role": "user", "content": f"{problem.question}\n{ZERO_SHOT_INSTRUCTION}"}]
    if style == "cot-8shot":
        if not exemplars:
            raise DatasetUnavailable("cot-8shot needs exemplars from a train split")
        return [*exemplars, {"role": "user", "content": problem.question}]
    raise ToolError(f"unknown prompt style {style!r} (zero-shot or cot-8shot)")


def spread_layers(num_layers: int, count: int = 3) -> list[int]:
    """`count` layer indices spread over the depth (quarter, half, three quarters for 3)."""
    return sorted({max(0, min(num_layers - 1, round(num_layers * (i + 1) / (count + 1)))) for i in range(count)})


def residual_preset(num_layers: int) -> list[str]:
    """The residual stream entering attention and MLP at three layers spread over the model."""
    layers = ",".join(map(str, spread_layers(num_layers)))
    return [f"model.layers.{{{layers}}}.input_layernorm", f"model.layers.{{{layers}}}.post_attention_layernorm"]
