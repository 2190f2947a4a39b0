"""GSM8K answer extraction and scoring, following lm-evaluation-harness.

Reference: lm-evaluation-harness ``lm_eval/tasks/gsm8k/gsm8k.yaml`` and
``gsm8k-cot.yaml`` (filters ``strict-match`` / ``flexible-extract``, metric
``exact_match`` with ``regexes_to_ignore``).

Extraction (both return the *normalized* string, or None when nothing matches):

* ``strict_match``: the first match, in text order, of either
  ``#### (-?[0-9.,]+)`` (gsm8k) or ``The answer is (-?[0-9.,]+)`` (gsm8k-cot).
  The cot regex in the harness ends in an unescaped ``.`` that needs one more
  character after the number, so at the very end of a completion
  "The answer is 42" yields "4" there. We drop that trailing ``.``; for every
  other text the extracted number is the same.
* ``flexible_match``: the last match of ``(-?[$0-9.,]{2,})|(-?[0-9]+)``,
  taking whichever group matched. As in the harness, this also matches
  runs of ``.``, ``,`` or ``$`` without digits (e.g. "..."). We keep that, so
  scores match the harness; such an extraction never scores correct.

Normalization (``normalize``), applied to extracted and gold answers in the
harness's ``regexes_to_ignore`` order: strip surrounding whitespace, remove
every ``,``, remove every ``$``, remove one trailing ``.``.

Correctness (``is_correct``): False for None; True when the normalized strings
are equal (the harness's exact match) or, a deliberate small relaxation, when
both are plain decimals with the same value ("18.00" == "18", "-3" == "-3.0").

Gold (``gold_answer``): the text after the last ``####`` of the reference
answer field, normalized.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from decimal import Decimal

_NUM = r"(-?[0-9.,]+)"
STRICT_RE = re.compile(rf"#### {_NUM}|The answer is {_NUM}")
FLEXIBLE_RE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
_DECIMAL_RE = re.compile(r"-?(?:[0-9]+\.?[0-9]*|\.[0-9]+)")
_CALC_RE = re.compile(r"<<[^>]*>>")


def normalize(text: str) -> str:
    """Strip whitespace, drop commas and ``$``, drop one trailing period."""
    text = text.strip().replace(",", "").replace("$", "")
    return text[:-1] if text.endswith(".") else text


def _pick(match: str | tuple[str, ...]) -> str:
    # findall gives a tuple when the regex has several groups: take the one that matched.
    if isinstance(match, tuple):
        match = next(m for m in match if m)
    return normalize(match)


def strict_match(completion: str) -> str | None:
    """First "#### N" or "The answer is N" number, normalized; None if absent."""
    found = STRICT_RE.findall(completion)
    return _pick(found[0]) if found else None


def flexible_match(completion: str) -> str | None:
    """Last number-like run in the completion, normalized; None if absent."""
    found = FLEXIBLE_RE.findall(completion)
    return _pick(found[-1]) if found else None


def gold_answer(answer_field: str) -> str:
    """The normalized number after the final ``####`` of a GSM8K answer field."""
    if "####" not in answer_field:
        raise ValueError("GSM8K answer field has no '####' line")
    return normalize(answer_field.split("####")[-1])


def _as_decimal(text: str) -> Decimal | None:
    return Decimal(text) if _DECIMAL_RE.fullmatch(text) else None


def is_correct(extracted: str | None, gold: str) -> bool:
    """Exact match after normalization, or equal decimal values."""
    if extracted is None:
        return False
    a, b = normalize(extracted), normalize(gold)
    if a == b:
        return True
    da, db = _as_decimal(a), _as_decimal(b)
    return da is not None and db is not None and da == db


def score(completion: str, gold: str) -> dict:
    """Both extractions and their correctness against an already-extracted gold."""
    extracted = {"strict": strict_match(completion), "flexible": flexible_match(completion)}
    correct = {k: is_correct(v, gold) for k, v in extracted.items()}
    return {"extracted": extracted, "correct": correct}


def accuracy(samples: Iterable[dict]) -> dict:
    """Fraction of samples whose ``correct["strict"|"flexible"]`` is True."""
    n = strict = flexible = 0
    for sample in samples:
        n += 1
        strict += sample["correct"]["strict"] is True
        flexible += sample["correct"]["flexible"] is True
    return {
        "n": n,
        "strict": strict / n if n else 0.0,
        "flexible": flexible / n if n else 0.0,
    }


def fewshot_answer(answer_field: str) -> str:
    """A GSM8K train answer as a chain-of-thought exemplar ending "The answer is N."."""
    if "####" not in answer_field:
        raise ValueError("GSM8K answer field has no '####' line")
    rationale, _, final = _CALC_RE.sub("", answer_field).rpartition("####")
    rationale, final = rationale.strip(), final.strip()
    if not rationale:
        return f"The answer is {final}."
    sep = "\n" if "\n" in rationale else " "
    return f"{rationale}{sep}The answer is {final}."
