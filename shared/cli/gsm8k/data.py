"""GSM8K problems and prompts: where the problems come from, how they are asked, what is captured.

Sources: a local JSONL file in GSM8K's format (`{"question", "answer"}` a line, the answer ending
in `#### N`), the Hugging Face hub (`openai/gsm8k`, config `main`; needs `pip install datasets`),
or `samples`: a dozen easy problems in the same format that ship with actq (written for it, not
taken from GSM8K), for offline demos.

Prompt formats: `chat` sends `messages` (the worker renders them with the model's chat template);
`plain` sends one raw `prompt` in the classic base-model layout ("Question: ...\nAnswer:" blocks)
with a stop string, so a model without a chat template can be run too; `auto` picks `chat` when
the model has a chat template (GET /models `chat_template`), else `plain`.

Capture: by default the model's `residual` preset (each decoder block's output, whatever the
architecture names it) at three blocks spread over the depth.
"""

from __future__ import annotations

import json
import os
import random
import socket
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from urllib.parse import urlparse

from shared.cli.captures import residual_capture, spread_layers  # noqa: F401  (part of this module's API)
from shared.cli.gsm8k import synthetic
from shared.cli.gsm8k.scoring import fewshot_answer, gold_answer
from shared.errors import ToolError

ZERO_SHOT_INSTRUCTION = "Solve the problem step by step. End your reply with: The answer is <number>."
FEWSHOT_COUNT = 8
# bare: the question alone, no instruction (a model trained on bare questions, such as the
# tests' calculator-calling model, tests/support/tool_model.py)
STYLES = ("zero-shot", "cot-8shot", "bare")
SOURCES = ("generated", "gold", "corrupted")  # what --capture-on can name
SYNTHETIC_PROBLEMS = 2000
PROMPT_FORMATS = ("auto", "chat", "plain")
# A base model given "Question: ...\nAnswer:" writes the next question after its answer: stop there.
PLAIN_STOP = ("\n\nQuestion:",)

Exemplar = tuple[str, str]  # a cot-8shot exemplar: (question, worked answer ending "The answer is N.")


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
    """`samples`, `synthetic`, `hub`, or a path to a JSONL file."""
    if source == "synthetic":
        rows = synthetic.problems(SYNTHETIC_PROBLEMS, seed=0 if split == "test" else 1)
        return [Problem(index=i, question=r["question"], answer=r["answer"]) for i, r in enumerate(rows)]
    if source == "samples":
        text = resources.files("shared.cli.gsm8k").joinpath("samples.jsonl").read_text()
        return _read_jsonl(text.splitlines(), "samples")
    if source == "hub":
        try:
            import datasets  # type: ignore[import-untyped]  # optional (the hub and export extras)
        except ImportError as exc:
            raise DatasetUnavailable(
                "loading GSM8K from the hub needs `pip install datasets`; or pass a JSONL path"
            ) from exc
        _check_hub_reachable()
        try:
            rows = datasets.load_dataset("openai/gsm8k", "main", split=split)
        except Exception as exc:
            raise DatasetUnavailable(f"openai/gsm8k could not be loaded from the hub: {exc}") from exc
        return [Problem(index=i, question=r["question"], answer=r["answer"]) for i, r in enumerate(rows)]
    path = Path(source).expanduser()
    if not path.is_file():
        raise DatasetUnavailable(f"{source}: no such file (give a GSM8K JSONL path, `hub` or `samples`)")
    return _read_jsonl(path.read_text().splitlines(), str(path))


def _check_hub_reachable(timeout: float = 3.0) -> None:
    """Fail at once where the hub cannot be reached: offline, `datasets` retries for ~25 s first.
    (A copy in the local cache is still used when HF_HUB_OFFLINE=1 is set.)"""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
    except OSError as exc:
        raise DatasetUnavailable(
            f"the Hugging Face hub ({host}) cannot be reached ({exc}); pass a JSONL path, `samples` or `synthetic`"
        ) from None


def select(
    problems: list[Problem], offset: int = 0, limit: int | None = None, sample: int | None = None, seed: int = 0
) -> list[Problem]:
    """A slice (offset, limit) or a seeded random sample, in index order."""
    if sample is not None:
        chosen = random.Random(seed).sample(problems, min(sample, len(problems)))
        return sorted(chosen, key=lambda p: p.index)
    end = None if limit is None else offset + limit
    return problems[offset:end]


def fewshot_exemplars(train: list[Problem]) -> list[Exemplar]:
    """The first eight train problems as (question, worked answer ending "The answer is N."), in order."""
    if len(train) < FEWSHOT_COUNT:
        raise DatasetUnavailable(f"cot-8shot needs {FEWSHOT_COUNT} train problems; got {len(train)}")
    return [(problem.question, fewshot_answer(problem.answer)) for problem in train[:FEWSHOT_COUNT]]


def _check_style(style: str, exemplars: list[Exemplar] | None) -> None:
    if style not in STYLES:
        raise ToolError(f"unknown prompt style {style!r} (zero-shot, cot-8shot or bare)")
    if style == "cot-8shot" and not exemplars:
        raise DatasetUnavailable("cot-8shot needs exemplars from a train split")


def messages(problem: Problem, style: str, exemplars: list[Exemplar] | None = None) -> list[dict[str, str]]:
    """The chat format: zero-shot is one user turn (question, then the instruction); cot-8shot is
    the exemplars as user/assistant turns, then the question; bare is the question alone."""
    _check_style(style, exemplars)
    if style == "bare":
        return [{"role": "user", "content": problem.question}]
    if style == "zero-shot":
        return [{"role": "user", "content": f"{problem.question}\n{ZERO_SHOT_INSTRUCTION}"}]
    turns: list[dict[str, str]] = []
    for question, answer in exemplars or []:
        turns += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return [*turns, {"role": "user", "content": problem.question}]


def plain_prompt(problem: Problem, style: str, exemplars: list[Exemplar] | None = None) -> str:
    """The plain (base-model) format, raw text ending in "Answer:" for the model to continue.
    zero-shot: "Question: Q\n<instruction>\nAnswer:"; cot-8shot: "Question: Q_i\nAnswer: A_i"
    for each exemplar, separated by a blank line, then "Question: Q\nAnswer:"; bare:
    "Question: Q\nAnswer:"."""
    _check_style(style, exemplars)
    if style == "bare":
        return f"Question: {problem.question}\nAnswer:"
    if style == "zero-shot":
        return f"Question: {problem.question}\n{ZERO_SHOT_INSTRUCTION}\nAnswer:"
    shots = [f"Question: {question}\nAnswer: {answer}" for question, answer in exemplars or []]
    return "\n\n".join([*shots, f"Question: {problem.question}\nAnswer:"])


def request_fields(
    problem: Problem, style: str, prompt_format: str, exemplars: list[Exemplar] | None = None
) -> dict[str, object]:
    """The prompt part of a job request: `messages` (chat) or `prompt` and `stop` (plain)."""
    if prompt_format == "chat":
        return {"messages": messages(problem, style, exemplars)}
    if prompt_format == "plain":
        return {"prompt": plain_prompt(problem, style, exemplars), "stop": list(PLAIN_STOP)}
    raise ToolError(f"unknown prompt format {prompt_format!r} (chat or plain)")


def resolve_prompt_format(requested: str, model: str, info: dict | None) -> str:
    """`chat` or `plain` for --prompt-format `requested` and the model's GET /models entry
    (`info`, None when no worker has published the model): `auto` is `chat` when the model has a
    chat template, else `plain`; `chat` for a model without a template is refused here rather
    than job by job by the API."""
    if requested not in PROMPT_FORMATS:
        raise ToolError(f"unknown prompt format {requested!r}: auto, chat or plain")
    if requested == "plain":
        return "plain"
    if info is None:
        if requested == "chat":
            return "chat"
        raise ToolError(
            f"no worker has published model {model!r}, so whether it has a chat template is unknown; "
            "give --prompt-format chat or plain"
        )
    has_template = bool(info.get("chat_template", True))  # an API from before the field: chat, as it was
    if requested == "auto":
        return "chat" if has_template else "plain"
    if not has_template:
        raise ToolError(
            f"model {model!r} has no chat template, so --prompt-format chat cannot be used; "
            "use --prompt-format plain (what auto picks for it)"
        )
    return "chat"


def capture_sources(text: str) -> list[str]:
    """`--capture-on`: comma-separated sources, each once, in SOURCES order."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SOURCES]
    if unknown or not names:
        raise ToolError(f"--capture-on {text!r}: name one or more of {', '.join(SOURCES)}, comma-separated")
    return [source for source in SOURCES if source in names]


def trace_text(problem: Problem, source: str) -> str:
    """The assistant turn a trace job scores: GSM8K's worked answer (calculator notes removed,
    ending "The answer is N."), with N replaced by a wrong number for `corrupted`."""
    text = fewshot_answer(problem.answer)
    if source == "gold":
        return text
    if source == "corrupted":
        head, _, _ = text.rpartition("The answer is ")
        return f"{head}The answer is {synthetic.corrupt(problem.gold, problem.index)}."
    raise ToolError(f"no trace text for source {source!r}")
