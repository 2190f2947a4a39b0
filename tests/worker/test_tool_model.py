"""The tool-calling tiny model (tests/support/tool_model.py) behaves, checked with plain
transformers before any actq code runs it: on held-out problems (another seed, none of them in
its training set), greedy generation with the calculator in `tools` writes a Hermes tool call
that parses and whose expression the calculator answers correctly, and, given that call and the
calculator's result, a final answer the GSM8K scoring reads as right."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shared.calculator import TOOL, TOOL_NAME, calculate
from shared.cli.gsm8k.scoring import is_correct, strict_match
from tests.support.tool_model import POOL, call, problems
from worker.rules.tool_calls import ToolFormat, parse_tool_calls, template_family

pytestmark = pytest.mark.model  # trains (or takes from the cache) and loads the tool model

HELD_OUT = 20
MIN_ACCURACY = 0.8


@pytest.fixture(scope="module")
def loaded(tool_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tool_model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tool_model_dir, local_files_only=True).eval()
    return tokenizer, model


@pytest.fixture(scope="module")
def held_out():
    seen = {p.question for p in problems(POOL, seed=0)}
    fresh = [p for p in problems(10 * HELD_OUT, seed=12345) if p.question not in seen]
    assert len(fresh) >= HELD_OUT
    return fresh[:HELD_OUT]


def generate(tokenizer, model, messages: list[dict], max_new_tokens: int = 48) -> str:
    inputs = tokenizer.apply_chat_template(
        messages, tools=[TOOL], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def test_its_template_is_hermes(loaded):
    tokenizer, _ = loaded
    assert template_family(tokenizer.chat_template) is ToolFormat.HERMES


def test_it_calls_the_calculator_then_answers_with_its_result(loaded, held_out):
    tokenizer, model = loaded
    family = template_family(tokenizer.chat_template)
    right_calls, right_answers, report = 0, 0, []
    for problem in held_out:
        question = [{"role": "user", "content": problem.question}]
        first = generate(tokenizer, model, question)
        parsed = parse_tool_calls(first, family, {TOOL_NAME})
        expression = json.loads(parsed.calls[0].arguments).get("expression") if parsed.calls else None
        result = calculate(expression) if parsed.calls else None
        right_calls += len(parsed.calls) == 1 and result.ok and result.text == problem.answer

        # The second turn continues from the expected call and its result, so that it is measured
        # on its own (the with-tools loop feeds back whatever the model called).
        after = question + [
            {"role": "assistant", "tool_calls": [call(problem.expression)]},
            {"role": "tool", "name": TOOL_NAME, "content": problem.answer},
        ]
        second = generate(tokenizer, model, after, max_new_tokens=16)
        right_answers += is_correct(strict_match(second), problem.answer)
        report.append(f"{problem.expression} = {problem.answer}: {first!r} then {second!r}")
    detail = "\n".join(report)
    print(f"tool model: {right_calls}/{len(held_out)} right calls, {right_answers}/{len(held_out)} right answers")
    assert right_calls >= MIN_ACCURACY * len(held_out), f"{right_calls}/{len(held_out)} right calls\n{detail}"
    assert right_answers >= MIN_ACCURACY * len(held_out), f"{right_answers}/{len(held_out)} right answers\n{detail}"
