"""GSM8K extraction and scoring, checked against lm-evaluation-harness behaviour."""

from __future__ import annotations

from decimal import Decimal

import pytest

from shared.cli.gsm8k import data
from shared.cli.gsm8k.scoring import (
    accuracy,
    fewshot_answer,
    flexible_match,
    gold_answer,
    is_correct,
    normalize,
    score,
    strict_match,
)

JANET = (
    "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n"
    "She makes 9 * 2 = $<<9*2=18>>18 every day at the farmer\u2019s market.\n"
    "#### 18"
)


def test_commas_are_removed():
    assert strict_match("#### 1,234") == "1234"
    assert flexible_match("They sold 1,234 tickets.") == "1234"
    assert is_correct("1,234", "1234")


def test_negative_numbers():
    assert strict_match("The answer is -5.") == "-5"
    assert flexible_match("The change is -5") == "-5"
    assert score("The answer is -5.", "-5")["correct"] == {"strict": True, "flexible": True}
    assert not is_correct("5", "-5")


def test_decimals_and_value_equality():
    assert flexible_match("It takes 3.5 hours") == "3.5"
    assert is_correct("3.5", "3.50")
    assert is_correct("18.00", "18")
    assert is_correct("-3", "-3.0")
    assert not is_correct("18.01", "18")
    assert score("The answer is 18.00.", "18")["correct"]["strict"]


def test_dollar_signs():
    assert flexible_match("She makes $18 a day") == "18"
    assert flexible_match("The total is $1,000.50.") == "1000.50"
    assert is_correct("$1,000.50", "1000.5")
    # The harness's strict regex has no `$`, so "The answer is $18" is not a strict match.
    assert strict_match("The answer is $18.") is None
    assert score("The answer is $18.", "18")["correct"] == {"strict": False, "flexible": True}


def test_trailing_period():
    assert strict_match("The answer is 42.") == "42"
    assert flexible_match("The answer is 42.") == "42"
    assert normalize(" 42. ") == "42"
    assert normalize("4.2") == "4.2"  # only a trailing period goes


def test_hash_marker():
    assert strict_match("6 + 36 = 42\n#### 42") == "42"
    assert strict_match("####42") is None  # the harness requires "#### " with a space


def test_answer_is_without_period():
    # The harness regex would give "4" here (its trailing unescaped `.` eats the "2").
    assert strict_match("The answer is 42") == "42"
    assert strict_match("The answer is 42 apples") == "42"


def test_no_number_at_all():
    result = score("I am not sure how to solve this", "42")
    assert result == {
        "extracted": {"strict": None, "flexible": None},
        "correct": {"strict": False, "flexible": False},
    }
    assert not is_correct(None, "42")


def test_strict_and_flexible_differ():
    result = score("The answer is 5. Then 7 more", "5")
    assert result["extracted"] == {"strict": "5", "flexible": "7"}
    assert result["correct"] == {"strict": True, "flexible": False}


def test_strict_takes_first_match():
    assert strict_match("The answer is 3.\n#### 4\nThe answer is 5.") == "3"
    assert strict_match("#### 4\nThe answer is 5.") == "4"


def test_numbers_attached_to_words_and_units():
    assert flexible_match("Natalia sold 18 clips") == "18"
    assert flexible_match("The box weighs 18kg") == "18"
    assert flexible_match("He has 5 apples") == "5"  # one digit: the harness's second group


def test_punctuation_runs_match_like_the_harness():
    # `[$0-9.,]{2,}` also matches "..."; kept for harness parity, and never correct.
    assert flexible_match("The answer is 18. Hmm...") == ".."
    assert not score("The answer is 18. Hmm...", "18")["correct"]["flexible"]


def test_multiline_rationale():
    completion = (
        "Natalia sold 48/2 = 24 clips in May.\n"
        "Natalia sold 48 + 24 = 72 clips altogether in April and May.\n"
        "The answer is 72.\n\n"
    )
    result = score(completion, "72")
    assert result["extracted"] == {"strict": "72", "flexible": "72"}
    assert result["correct"] == {"strict": True, "flexible": True}


def test_gold_answer_from_reference_field():
    assert gold_answer(JANET) == "18"
    assert gold_answer("Total is 1000+80=<<1000+80=1080>>1080\n#### 1,080") == "1080"
    with pytest.raises(ValueError):
        gold_answer("no marker here")


def test_fewshot_answer():
    answer = (
        "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n"
        "#### 72"
    )
    assert fewshot_answer(answer) == (
        "Natalia sold 48/2 = 24 clips in May.\n"
        "Natalia sold 48+24 = 72 clips altogether in April and May.\n"
        "The answer is 72."
    )
    # A one-line rationale is continued with a space, as in the gsm8k-cot exemplars.
    assert fewshot_answer("3 + 2 = <<3+2=5>>5 cars.\n#### 5") == "3 + 2 = 5 cars. The answer is 5."
    assert fewshot_answer("#### 6") == "The answer is 6."
    assert "$18 every day" in fewshot_answer(JANET)
    # The exemplar's own answer scores under both extractions.
    assert score(fewshot_answer(JANET), gold_answer(JANET))["correct"] == {
        "strict": True,
        "flexible": True,
    }


def test_accuracy():
    samples = [
        {"correct": {"strict": True, "flexible": True}},
        {"correct": {"strict": False, "flexible": True}},
        {"correct": {"strict": False, "flexible": False}},
        {"correct": {"strict": True, "flexible": False}},
    ]
    assert accuracy(samples) == {"n": 4, "strict": 0.5, "flexible": 0.5}
    assert accuracy(iter(samples[:3])) == {"n": 3, "strict": 1 / 3, "flexible": 2 / 3}
    assert accuracy([]) == {"n": 0, "strict": 0.0, "flexible": 0.0}


def test_every_built_in_sample_scores_its_own_gold_answer():
    """The samples that ship with actq (the offline demo's problems) parse like GSM8K's own lines;
    bench/bench_gsm8k.py runs the same check over the whole test split when it is present."""
    problems = data.load("samples")
    assert len(problems) >= 8
    for problem in problems:
        gold = gold_answer(problem.answer)
        Decimal(gold)  # raises on anything but a number
        assert is_correct(gold, gold)
        assert strict_match(fewshot_answer(problem.answer)) == gold
