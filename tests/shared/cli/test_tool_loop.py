"""The with-tools loop's pure parts (shared/cli/tool_loop.py): the calculator's answers to calls,
the conversation rebuilt from recorded turns, when a conversation ends, the requests and their
metadata, the samples and the summary; run-file's tools lines; probes and exports over turns and
two runs compared. No API here: tests/e2e/test_gsm8k_tools.py runs the loop on a real stack."""

from __future__ import annotations

import json

import numpy as np
import pytest

from shared.calculator import TOOL, calculate
from shared.cli import probes, run_file, tool_loop
from shared.cli.tool_loop import Conversation, Trajectories
from shared.errors import ToolError
from shared.schemas import JobRequest
from tests.shared.cli.test_probes import make_results

QUESTION = [{"role": "user", "content": "Tom has 12 apples and buys 7 more. How many apples does he have now?"}]


def call(call_id: str, expression: str, name: str = "calculator") -> dict:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps({"expression": expression})},
    }


def turn(n: int, calls: list[dict], status: str = "succeeded", text: str = "", content: str | None = None) -> dict:
    """A recorded turn as tool_loop.turn_record writes it (only the fields the loop reads back)."""
    return {
        "turn": n,
        "job_id": f"job{n}",
        "status": status,
        "text": text,
        "content": content,
        "tool_calls": calls,
        "tool_results": [tool_loop.answer_call(c) for c in calls],
        "prompt_tokens": 100 + n,
        "completion_tokens": 10 + n,
        "activations": {"tensors": [{"name": "model.layers.1"}]},
        "activations_file": None,
        "finish_reason": "tool_calls" if calls else "stop",
    }


def conversation(key: int = 3) -> Conversation:
    request = {"model": "m", "tools": [TOOL], "tool_choice": "auto", "max_tokens": 32, "capture": None}
    return Conversation(key=key, messages=QUESTION, request=request)


def test_a_calculator_call_is_answered_exactly_and_anything_else_gets_an_error_fed_back():
    answered = tool_loop.answer_call(call("c1", "12.50 * 3 - 4 / 2"))
    assert answered == {
        "tool_call_id": "c1",
        "name": "calculator",
        "arguments": '{"expression": "12.50 * 3 - 4 / 2"}',
        "content": "35.5",
        "ok": True,
    }
    assert answered["content"] == calculate("12.50 * 3 - 4 / 2").text
    refused = tool_loop.answer_call(call("c2", "__import__('os')"))
    assert not refused["ok"] and refused["content"].startswith("error: ")
    unknown = tool_loop.answer_call(call("c3", "1 + 1", name="search"))
    assert (
        not unknown["ok"]
        and unknown["content"] == "error: there is no tool named 'search'; the only tool is calculator"
    )
    garbled = tool_loop.answer_call(
        {"id": "c4", "type": "function", "function": {"name": "calculator", "arguments": "12 +"}}
    )
    assert not garbled["ok"] and garbled["content"].startswith("error: ")


def test_each_turn_sends_the_conversation_so_far_with_every_call_and_its_result():
    c = conversation()
    first = [call("a", "12 + 7")]
    second = [call("b", "19 * 2"), call("c", "1 / 0")]
    turns = [turn(0, first), turn(1, second, content="Let me check.")]
    assert tool_loop.next_messages(c, []) == QUESTION
    assert tool_loop.next_messages(c, turns) == [
        *QUESTION,
        {"role": "assistant", "tool_calls": first},
        {"role": "tool", "tool_call_id": "a", "content": "19"},
        {"role": "assistant", "tool_calls": second, "content": "Let me check."},
        {"role": "tool", "tool_call_id": "b", "content": "38"},
        {"role": "tool", "tool_call_id": "c", "content": calculate("1 / 0").text},
    ]
    request = tool_loop.turn_request(c, turns, "run1", "problem")
    assert request["metadata"] == {"actq_run": "run1", "problem": "3", "turn": "2"}
    assert {k: request[k] for k in ("model", "tools", "tool_choice", "max_tokens")} == {
        "model": "m",
        "tools": [TOOL],
        "tool_choice": "auto",
        "max_tokens": 32,
    }
    # the API's own schema reads it: tool messages answer calls made before, in order
    parsed = JobRequest.model_validate(request)
    assert [m.role for m in parsed.messages or []] == ["user", "assistant", "tool", "assistant", "tool", "tool"]
    assert c.messages == QUESTION  # the conversation itself is never changed


def test_a_required_tool_choice_holds_for_the_first_turn_only():
    c = conversation()
    c.request = {**c.request, "tool_choice": "required", "parallel_tool_calls": False}
    assert tool_loop.turn_request(c, [], "r", "problem")["tool_choice"] == "required"
    later = tool_loop.turn_request(c, [turn(0, [call("a", "12 + 7")])], "r", "problem")
    assert later["tool_choice"] == "auto"  # else the model could never answer
    assert c.request["tool_choice"] == "required"  # the conversation's own fields are not changed
    JobRequest.model_validate(later)


def test_a_resumed_run_rebuilds_the_very_request_it_sent_from_the_trajectory_file(tmp_path):
    """The idempotency key of a turn only returns its job for the same request: the request built
    again from trajectories/<n>.jsonl after a restart must equal the one built while running."""
    c = conversation(7)
    turns = [turn(0, [call("call_x1", "3 * 4")])]
    before = tool_loop.turn_request(c, turns, "r", "problem")
    Trajectories(tmp_path).write(7, turns)
    assert (tmp_path / "trajectories" / "7.jsonl").read_text().count("\n") == 1
    again = Trajectories(tmp_path).read(7)
    assert again == turns and tool_loop.turn_request(c, again, "r", "problem") == before
    assert Trajectories(tmp_path).read(8) == []


@pytest.mark.parametrize(
    ("turns", "max_turns", "why"),
    [
        ([], 4, None),
        ([turn(0, [call("a", "1 + 1")])], 4, None),
        ([turn(0, [])], 4, "answer"),
        ([turn(0, [call("a", "1 + 1")]), turn(1, [])], 4, "answer"),
        ([turn(0, [call("a", "1 + 1")])], 1, "turn_limit"),
        ([turn(0, [call("a", "1 + 1")]), turn(1, [], status="failed")], 4, "failed"),
    ],
)
def test_a_conversation_ends_at_an_answer_a_failure_or_the_turn_limit(turns, max_turns, why):
    assert tool_loop.ended(turns, max_turns) == why


def test_the_sample_is_the_last_turns_job_with_every_turn_listed_and_the_summary_counts_them():
    turns = [turn(0, [call("a", "12 + 7")]), turn(1, [], text="The answer is 19.", content="The answer is 19.")]
    fields = tool_loop.sample_fields(3, turns, 4)
    assert fields["text"] == "The answer is 19." and fields["ended"] == "answer"
    assert (fields["turns"], fields["tool_calls"], fields["tool_errors"]) == (2, 1, 0)
    assert fields["job_id"] == "job1" and fields["prompt_tokens"] == 101 and fields["completion_tokens"] == 11
    assert fields["generated_tokens"] == 10 + 11 and fields["trajectory"] == "trajectories/3.jsonl"
    assert [(t["turn"], t["job_id"], t["tool_calls"]) for t in fields["turn_jobs"]] == [(0, "job0", 1), (1, "job1", 0)]
    # calls still made at the turn limit: no answer but the text outside them
    cut = tool_loop.sample_fields(4, [turn(0, [call("a", "1 + 1")], text="<tool_call>..", content=None)], 1)
    assert cut["text"] == "" and cut["ended"] == "turn_limit"
    failed = tool_loop.sample_fields(5, [turn(0, [], status="failed")], 4)
    assert failed["status"] == "failed" and failed["ended"] == "failed" and failed["text"] == ""

    samples = [{"index": 3, **fields}, {"index": 4, **cut}, {"index": 5, **failed}]
    tools = tool_loop.summarize(samples)["tools"]
    assert tools["turns"] == 4 and tools["tool_calls"] == 2 and tools["items_calling_tools"] == 2
    assert tools["turns_per_item_mean"] == round(4 / 3, 4) and tools["tool_calls_per_item_mean"] == round(2 / 3, 4)
    assert tools["ended"] == {"answer": 1, "turn_limit": 1, "failed": 1}
    assert tools["per_item"] == {
        "3": {"turns": 2, "tool_calls": 1},
        "4": {"turns": 1, "tool_calls": 1},
        "5": {"turns": 1, "tool_calls": 0},
    }


def test_run_file_takes_calculator_tools_on_a_line_and_refuses_others_before_queueing(tmp_path):
    good = {"messages": QUESTION, "tools": [TOOL], "tool_choice": "auto", "topic": "apples"}
    other = {"messages": QUESTION, "tools": [{"type": "function", "function": {"name": "search"}}]}
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps({"prompt": "hi"}) + "\n")
    lines = run_file.read_lines(path)
    assert run_file.uses_tools(lines) and run_file.labels(lines[0][1]) == {"topic": "apples"}
    request = run_file.job_request(lines[0][1], "m", None, 16, 0.0)
    assert request["tools"] == [TOOL] and request["tool_choice"] == "auto"
    talk = run_file.conversation(0, lines[0][1], request)
    assert talk.messages == QUESTION and "messages" not in talk.request and talk.request["tools"] == [TOOL]
    plain = run_file.conversation(1, lines[1][1], run_file.job_request(lines[1][1], "m", None, 16, 0.0))
    assert plain.messages is None and "messages" not in tool_loop.turn_request(plain, [], "r", "line")

    path.write_text(json.dumps(good) + "\n" + json.dumps(other) + "\n")
    with pytest.raises(ToolError, match=r"line 2: tools\[0\] is 'search', a tool actq cannot answer"):
        run_file.read_lines(path)
    path.write_text(json.dumps({"messages": QUESTION, "tools": "calculator"}) + "\n")
    with pytest.raises(ToolError, match="`tools` must be a list"):
        run_file.read_lines(path)


def with_turns(root, turns_of) -> None:
    """Give each sample of a make_results directory a conversation: `turns_of(i)` turns, each a job
    whose activations are the sample's own file (the last turn's fields are the sample's)."""
    for path in (root / "samples").glob("*.json"):
        sample = json.loads(path.read_text())
        keep = ("job_id", "status", "prompt_tokens", "completion_tokens", "activations", "activations_file")
        jobs = [
            {"turn": t, **{k: sample.get(k) for k in keep}, "tool_calls": 1} for t in range(turns_of(sample["index"]))
        ]
        jobs[0]["job_id"] = f"{sample['job_id']}-first"
        sample["turn_jobs"] = jobs
        path.write_text(json.dumps(sample))


def test_probes_pool_over_a_tool_runs_turns(tmp_path):
    make_results(tmp_path, n=20)
    with_turns(tmp_path, lambda i: 1 + i % 3)
    turns_total = sum(1 + i % 3 for i in range(20))
    sample = json.loads((tmp_path / "samples" / "4.json").read_text())
    assert [v["turn"] for _, v, _ in probes.job_views(sample, "sample", "all")] == [0, 1]
    assert [v["job_id"] for _, v, _ in probes.job_views(sample, "sample", "first")] == ["job4-first"]
    assert [(v["job_id"], v["turn"]) for _, v, _ in probes.job_views(sample, "sample", "last")] == [("job4", 1)]
    for turns, rows in (("last", 20), ("first", 20), ("all", turns_total)):
        _, labels, meta = probes.load_dataset(tmp_path, turns=turns)
        assert meta["n_samples"] == len(labels) == rows
    # every turn of a problem in one group: its rows are never split between training and testing
    assert probes.load_dataset(tmp_path, turns="all")[2]["groups"].count(2) == 3
    with pytest.raises(ToolError, match="--turns 'every'"):
        probes.run(tmp_path, turns="every")


def test_probe_versus_tells_two_runs_apart_where_their_activations_differ(tmp_path):
    """Two runs of the same problems: the with-tools run's layer-6 activations are shifted one way,
    the no-tools run's the other; a probe of `run` finds it there and nowhere else."""
    with_tools, no_tools = tmp_path / "with", tmp_path / "without"
    make_results(with_tools, n=40, labels=[True] * 40)
    make_results(no_tools, n=40, labels=[False] * 40)
    for root, mode in ((with_tools, "with-tools"), (no_tools, "no-tools")):
        (root / "run.json").write_text(json.dumps({"run_id": "r", "settings": {"mode": mode}}))
    assert probes.run_names(with_tools, no_tools) == ("with-tools", "no-tools")
    report = probes.run(with_tools, versus=no_tools)
    out = probes.versus_dir(with_tools, no_tools)
    assert out == with_tools / "versus-without" and json.loads((out / "probes.json").read_text()) == report
    assert not (with_tools / "probes.json").exists()  # the run's own probes are left alone
    assert report["label"] == "run" and report["n_samples"] == 80
    assert report["runs"] == {"with-tools": str(with_tools), "no-tools": str(no_tools)}
    assert report["sources"] == {"with-tools:generated": 40, "no-tools:generated": 40}
    scores = {(p["point"], p["pooling"]): p["balanced_accuracy_mean"] for p in report["probes"]}
    for (point, _), score in scores.items():
        assert (score > 0.9) if ".6." in point else (score < 0.8), (point, score)
    assert all(p["class_counts"] == {"no-tools": 40, "with-tools": 40} for p in report["probes"])
    with pytest.raises(ToolError, match="the results directory itself"):
        probes.run(with_tools, versus=with_tools)


def test_export_writes_a_row_per_turn_with_its_turn_and_calls(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    from shared.cli import export

    make_results(tmp_path, n=3)
    with_turns(tmp_path, lambda i: 2)
    (tmp_path / "trajectories").mkdir()
    rows = {}
    for turns in ("all", "first", "last"):
        table = pq.read_table(export.run(tmp_path, out=tmp_path / f"{turns}.parquet", turns=turns))
        rows[turns] = list(
            zip(*(table.column(c).to_pylist() for c in ("index", "turn", "job_id", "point")), strict=True)
        )
        assert set(table.column("tool_calls").to_pylist()) == {1}
    points = len(probes.load_dataset(tmp_path)[2]["points"])
    assert len(rows["all"]) == 3 * 2 * points
    assert {(i, t, j) for i, t, j, _ in rows["first"]} == {(i, 0, f"job{i}-first") for i in range(3)}
    assert {(i, t, j) for i, t, j, _ in rows["last"]} == {(i, 1, f"job{i}") for i in range(3)}
    assert np.all([t is not None for _, t, _, _ in rows["all"]])


def test_gsm8k_with_tools_refuses_what_it_cannot_run_before_asking_the_api(tmp_path):
    from shared.cli.gsm8k import data, runner

    problem = data.Problem(index=0, question="Tom has 12 apples and buys 7 more. How many?", answer="#### 19")
    assert data.messages(problem, "bare") == [{"role": "user", "content": problem.question}]
    assert data.plain_prompt(problem, "bare") == f"Question: {problem.question}\nAnswer:"
    common = {"out": tmp_path / "out", "dataset": "samples", "api": "http://127.0.0.1:9"}
    for options, message in (
        ({"mode": "tools"}, "unknown --mode 'tools': no-tools or with-tools"),
        ({"mode": "with-tools", "max_turns": 0}, "--max-turns 0: give at least 1"),
        ({"mode": "with-tools", "capture_on": "gold"}, "leave --capture-on at generated"),
        ({"mode": "with-tools", "prompt_format": "plain"}, "needs a chat"),
    ):
        with pytest.raises(ToolError, match=message):
            runner.run(**common, **options)
    assert not (tmp_path / "out").exists()
    settings = runner.RunSettings(model="m", dataset="samples", mode="with-tools", max_turns=4)
    talks = runner.conversations(settings, [problem], None)
    assert talks[0].request["tools"] == [TOOL] and talks[0].request["tool_choice"] == "auto"
    assert talks[0].messages == data.messages(problem, "zero-shot")  # the prompt of a run without tools
    # a run from before the mode existed resumes as a run without tools
    assert runner.RunSettings.defaults()["mode"] == "no-tools" and runner.RunSettings.defaults()["max_turns"] is None
