"""GSM8K prompts and the default capture (shared/cli/gsm8k/data.py): exact strings, in order."""

from __future__ import annotations

import pytest

from shared.cli.gsm8k import data
from shared.cli.gsm8k.scoring import fewshot_answer, score
from shared.errors import ToolError

INSTRUCTION = "Solve the problem step by step. End your reply with: The answer is <number>."
PROBLEM = data.Problem(index=7, question="Ann has 2 cats and gets 3 more. How many cats?", answer="2 + 3 = 5\n#### 5")


def train(count: int = 10) -> list[data.Problem]:
    return [
        data.Problem(
            index=i, question=f"Q{i}: what is {i} + 1?", answer=f"{i} + 1 = <<{i}+1={i + 1}>>{i + 1}\n#### {i + 1}"
        )
        for i in range(count)
    ]


def test_fewshot_exemplars_are_the_first_eight_train_problems_in_order():
    exemplars = data.fewshot_exemplars(train())
    assert exemplars == [(f"Q{i}: what is {i} + 1?", f"{i} + 1 = {i + 1} The answer is {i + 1}.") for i in range(8)]
    with pytest.raises(data.DatasetUnavailable, match="cot-8shot needs 8 train problems; got 7"):
        data.fewshot_exemplars(train(7))


def test_chat_zero_shot_is_one_user_turn_with_the_instruction():
    assert data.messages(PROBLEM, "zero-shot") == [
        {"role": "user", "content": f"Ann has 2 cats and gets 3 more. How many cats?\n{INSTRUCTION}"}
    ]


def test_chat_cot_8shot_is_the_exemplars_as_turns_then_the_question():
    turns = data.messages(PROBLEM, "cot-8shot", data.fewshot_exemplars(train()))
    assert len(turns) == 17
    assert turns[:4] == [
        {"role": "user", "content": "Q0: what is 0 + 1?"},
        {"role": "assistant", "content": "0 + 1 = 1 The answer is 1."},
        {"role": "user", "content": "Q1: what is 1 + 1?"},
        {"role": "assistant", "content": "1 + 1 = 2 The answer is 2."},
    ]
    assert [t["role"] for t in turns] == ["user", "assistant"] * 8 + ["user"]
    assert turns[14:] == [
        {"role": "user", "content": "Q7: what is 7 + 1?"},
        {"role": "assistant", "content": "7 + 1 = 8 The answer is 8."},
        {"role": "user", "content": PROBLEM.question},
    ]


def test_plain_zero_shot_is_question_instruction_answer():
    assert data.plain_prompt(PROBLEM, "zero-shot") == (
        f"Question: Ann has 2 cats and gets 3 more. How many cats?\n{INSTRUCTION}\nAnswer:"
    )


def test_plain_cot_8shot_is_eight_question_answer_blocks_then_the_question():
    exemplars = [
        ("Tom has 3 apples and buys 5 more. How many?", "3 + 5 = 8 apples.\nThe answer is 8."),
        *((f"Q{i}?", f"A{i}. The answer is {i}.") for i in range(1, 8)),
    ]
    expected = (
        "Question: Tom has 3 apples and buys 5 more. How many?\nAnswer: 3 + 5 = 8 apples.\nThe answer is 8.\n\n"
        "Question: Q1?\nAnswer: A1. The answer is 1.\n\n"
        "Question: Q2?\nAnswer: A2. The answer is 2.\n\n"
        "Question: Q3?\nAnswer: A3. The answer is 3.\n\n"
        "Question: Q4?\nAnswer: A4. The answer is 4.\n\n"
        "Question: Q5?\nAnswer: A5. The answer is 5.\n\n"
        "Question: Q6?\nAnswer: A6. The answer is 6.\n\n"
        "Question: Q7?\nAnswer: A7. The answer is 7.\n\n"
        "Question: Ann has 2 cats and gets 3 more. How many cats?\nAnswer:"
    )
    assert data.plain_prompt(PROBLEM, "cot-8shot", exemplars) == expected


def test_plain_cot_8shot_from_the_built_in_samples():
    problems = data.load("samples")
    prompt = data.plain_prompt(problems[9], "cot-8shot", data.fewshot_exemplars(problems))
    blocks = prompt.split("\n\n")
    assert len(blocks) == 9
    for block, problem in zip(blocks[:8], problems[:8], strict=True):
        assert block == f"Question: {problem.question}\nAnswer: {fewshot_answer(problem.answer)}"
        # what the model is shown as an answer is what the scorer reads back as the gold answer
        assert score(block.partition("\nAnswer: ")[2], problem.gold)["correct"]["strict"] is True
    assert blocks[-1] == f"Question: {problems[9].question}\nAnswer:"
    # the stop string never cuts an exemplar: it only follows the last answer the model writes
    assert all(stop not in block for stop in data.PLAIN_STOP for block in blocks)


def test_request_fields_chat_sends_messages_and_no_stop():
    assert data.request_fields(PROBLEM, "zero-shot", "chat") == {"messages": data.messages(PROBLEM, "zero-shot")}


def test_request_fields_plain_sends_a_prompt_and_the_question_stop():
    fields = data.request_fields(PROBLEM, "zero-shot", "plain")
    assert fields == {"prompt": data.plain_prompt(PROBLEM, "zero-shot"), "stop": ["\n\nQuestion:"]}
    assert "messages" not in fields


def test_unknown_style_and_format_are_refused():
    with pytest.raises(ToolError, match="unknown prompt style 'five-shot'"):
        data.plain_prompt(PROBLEM, "five-shot")
    with pytest.raises(ToolError, match="unknown prompt style 'five-shot'"):
        data.messages(PROBLEM, "five-shot")
    with pytest.raises(data.DatasetUnavailable, match="cot-8shot needs exemplars"):
        data.plain_prompt(PROBLEM, "cot-8shot")
    with pytest.raises(ToolError, match="unknown prompt format 'auto'"):
        data.request_fields(PROBLEM, "zero-shot", "auto")  # resolved before requests are made


@pytest.mark.parametrize(
    ("requested", "chat_template", "resolved"),
    [("auto", True, "chat"), ("auto", False, "plain"), ("chat", True, "chat"), ("plain", True, "plain")],
)
def test_resolve_prompt_format(requested, chat_template, resolved):
    info = {"name": "m", "chat_template": chat_template}
    assert data.resolve_prompt_format(requested, "m", info) == resolved


def test_resolve_prompt_format_refusals_say_what_to_do():
    with pytest.raises(ToolError, match="model 'base' has no chat template.*use --prompt-format plain"):
        data.resolve_prompt_format("chat", "base", {"name": "base", "chat_template": False})
    with pytest.raises(ToolError, match="unknown prompt format 'raw': auto, chat or plain"):
        data.resolve_prompt_format("raw", "m", {"name": "m", "chat_template": True})
    with pytest.raises(ToolError, match="no worker has published model 'gone'.*give --prompt-format chat or plain"):
        data.resolve_prompt_format("auto", "gone", None)
    # an explicit format needs no model entry
    assert data.resolve_prompt_format("chat", "gone", None) == "chat"
    assert data.resolve_prompt_format("plain", "gone", None) == "plain"


def test_spread_layers():
    assert data.spread_layers(30) == [8, 15, 22]  # SmolLM2
    assert data.spread_layers(4) == [1, 2, 3]  # the tests' tiny Llama
    assert data.spread_layers(12) == [3, 6, 9]  # GPT-2
    assert data.spread_layers(2) == [0, 1]
    assert data.spread_layers(1) == [0]


def test_residual_capture_spreads_the_preset_over_the_model_s_blocks():
    info = {
        "name": "gpt2",
        "num_layers": 12,
        "presets": {"residual": [f"transformer.h.{i}" for i in range(12)], "mlp": []},
    }
    assert data.residual_capture(info, positions="last", dtype="bfloat16") == {
        "preset": "residual",
        "layers": [3, 6, 9],
        "hook": "output",
        "positions": "last",
        "dtype": "bfloat16",
    }
    assert data.residual_capture(info) == {
        "preset": "residual",
        "layers": [3, 6, 9],
        "hook": "output",
        "positions": "generated",
        "dtype": "float16",
    }


def test_residual_capture_without_a_residual_preset_asks_for_module():
    with pytest.raises(ToolError, match=r"model 'odd' publishes no `residual` preset \(its presets: mlp\).*--module"):
        data.residual_capture({"name": "odd", "num_layers": 4, "presets": {"mlp": ["a", "b", "c", "d"]}})
    with pytest.raises(ToolError, match=r"\(its presets: none\).*--module PATH"):
        data.residual_capture({"name": "odd", "num_layers": 4, "presets": {}})
