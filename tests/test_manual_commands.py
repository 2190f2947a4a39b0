"""Every `actq gsm8k` command in the manual that needs more than actq and its built-in model (the
Hugging Face Hub, a worker serving another model, a file outside the repository) says so where it
stands, with the offline route beside it: the comment lines right above it name what it needs
("Needs ...") and what to run instead ("Offline: ...")."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from tests.support import readme

ROOT = Path(__file__).resolve().parent.parent
BUILT_IN = "smollm2-135m"
SHIPPED = {"samples", "synthetic"}  # problems that come with actq


def needs(command: str) -> list[str]:
    """What an `actq gsm8k` command needs beyond actq and the built-in model."""
    words = shlex.split(command, comments=True)
    options = dict(zip(words, [*words[1:], ""], strict=True))
    found = []
    dataset = options.get("--dataset")
    if dataset == "hub":
        found.append("the Hub")
    elif dataset is not None and dataset not in SHIPPED:
        found.append(f"the file {dataset}")
    model = options.get("--model")
    if model is not None and model != BUILT_IN:
        found.append(f"a worker serving {model}")
    return found


def commands(page: Path) -> list[tuple[str, list[str]]]:
    """(`actq gsm8k` command, the comment lines right above it) for every one in the page's sh blocks."""
    found = []
    for _, lang, body, _ in readme._fences(page.read_text()):
        if lang != "sh":
            continue
        lines = body.replace("\\\n", " ").splitlines()
        for i, line in enumerate(lines):
            if line.startswith("actq gsm8k "):
                above = []
                for previous in reversed(lines[:i]):
                    if not previous.startswith("#"):
                        break
                    above.insert(0, previous)
                found.append((line, above))
    return found


def test_every_gsm8k_command_that_needs_the_hub_another_model_or_an_outside_file_says_so():
    checked, unsaid = 0, []
    for page in readme.pages(ROOT):
        for command, above in commands(page):
            wanted = needs(command)
            if not wanted:
                continue
            checked += 1
            comment = " ".join(above)
            if not (re.search(r"\bNeeds\b", comment) and "Offline:" in comment):
                unsaid.append(f"{page.relative_to(ROOT)}: {command} (needs {', '.join(wanted)})")
    assert checked >= 3, "the manual's GSM8K runs on the Hub, on gpt2 and on a file are checked"
    assert not unsaid, "say what it needs and the offline route in a comment above it:\n" + "\n".join(unsaid)


def test_needs_reads_the_options_that_leave_the_machine():
    assert needs("actq gsm8k --out r --dataset samples --download") == []
    assert needs("actq gsm8k --out r --dataset synthetic --model smollm2-135m") == []
    assert needs("actq gsm8k --out r --dataset hub --model gpt2   # a comment") == ["the Hub", "a worker serving gpt2"]
    assert needs("actq gsm8k --out r --dataset ../data/test.jsonl") == ["the file ../data/test.jsonl"]
