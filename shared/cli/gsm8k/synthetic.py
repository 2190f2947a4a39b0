"""Arithmetic word problems in GSM8K's format, made up from templates (`--dataset synthetic`).

For demos and tests where GSM8K itself cannot be had (no network): as many problems as asked,
the same ones for the same seed, each with a worked answer ending in "#### N" like GSM8K's. They
are easier than GSM8K (one or two steps); they are not GSM8K and scores on them are not GSM8K scores.
"""

from __future__ import annotations

import random
from collections.abc import Callable

NAMES = ("Tom", "Mia", "Sam", "Ana", "Leo", "Zoe", "Raj", "Ivy", "Ben", "Lea", "Omar", "Nina")
ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells")

# (question, worked answer) from a name, an item and a random generator
Template = Callable[[str, str, random.Random], tuple[str, str]]


def _add(name: str, item: str, rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(3, 60), rng.randint(2, 40)
    return (
        f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
        f"{name} starts with {a} {item} and gets {b} more, so {name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} "
        f"{item}.\n#### {a + b}",
    )


def _subtract(name: str, item: str, rng: random.Random) -> tuple[str, str]:
    a = rng.randint(20, 90)
    b = rng.randint(2, a - 1)
    return (
        f"{name} had {a} {item} and gave {b} of them away. How many {item} does {name} have left?",
        f"{name} gives away {b} of {a} {item}, so {a} - {b} = <<{a}-{b}={a - b}>>{a - b} are left.\n#### {a - b}",
    )


def _multiply(name: str, item: str, rng: random.Random) -> tuple[str, str]:
    boxes, each = rng.randint(2, 12), rng.randint(3, 15)
    return (
        f"{name} fills {boxes} boxes with {each} {item} each. How many {item} are in the boxes?",
        f"{boxes} boxes of {each} {item} hold {boxes} * {each} = <<{boxes}*{each}={boxes * each}>>"
        f"{boxes * each} {item}.\n#### {boxes * each}",
    )


def _divide(name: str, item: str, rng: random.Random) -> tuple[str, str]:
    friends, each = rng.randint(2, 9), rng.randint(2, 12)
    total = friends * each
    return (
        f"{name} shares {total} {item} equally among {friends} friends. How many {item} does each friend get?",
        f"{total} {item} shared by {friends} friends is {total} / {friends} = <<{total}/{friends}={each}>>{each} "
        f"each.\n#### {each}",
    )


def _two_steps(name: str, item: str, rng: random.Random) -> tuple[str, str]:
    packs, each, extra = rng.randint(2, 9), rng.randint(3, 12), rng.randint(1, 20)
    first = packs * each
    return (
        f"{name} buys {packs} packs of {each} {item} and finds {extra} more. How many {item} does {name} have?",
        f"The packs hold {packs} * {each} = <<{packs}*{each}={first}>>{first} {item}. With the {extra} found, "
        f"{name} has {first} + {extra} = <<{first}+{extra}={first + extra}>>{first + extra} {item}.\n"
        f"#### {first + extra}",
    )


TEMPLATES: tuple[Template, ...] = (_add, _subtract, _multiply, _divide, _two_steps)


def problems(count: int, seed: int = 0) -> list[dict[str, str]]:
    """`count` problems as GSM8K rows ({"question", "answer"}), the same for the same seed."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        question, answer = TEMPLATES[i % len(TEMPLATES)](rng.choice(NAMES), rng.choice(ITEMS), rng)
        rows.append({"question": question, "answer": answer})
    return rows


def corrupt(gold: str, index: int) -> str:
    """A wrong final answer for a problem whose right one is `gold`: off by a small amount that
    depends only on the problem's index (never 0, never negative), so a run is reproducible."""
    offsets = (1, -1, 2, -2, 3, -3, 10, -10)
    value = int(float(gold.replace(",", "")))
    for step in range(len(offsets)):
        wrong = value + offsets[(index + step) % len(offsets)]
        if wrong >= 0 and wrong != value:
            return str(wrong)
    return str(value + 1)
