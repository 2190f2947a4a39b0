"""`actq run-file`'s reading of a prompt file (shared/cli/run_file.py): every bad line is named
with its number and what to fix, before anything is submitted; job fields, labels and the
command's defaults end up where they belong."""

from __future__ import annotations

import json

import pytest

from shared.cli.run_file import _checked, job_request, labels, read_lines
from shared.errors import ToolError

CAPTURE = {"preset": "residual", "layers": [1], "hook": "output", "positions": "generated", "dtype": "float16"}


def write(tmp_path, *lines: str):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"line 2: not JSON \(Expecting property name"),
        ('["a list"]', r"line 2: expected a JSON object with `prompt` or `messages`"),
        ('{"text": "hi"}', r"line 2: give exactly one of `prompt` \(text\) or `messages`"),
        ('{"prompt": "a", "messages": []}', r"line 2: give exactly one of"),
        ('{"prompt": "a", "model": "gpt2"}', r"line 2: `model` is the same for the whole file; set it with --model"),
        ('{"prompt": "a", "capture": {}}', r"line 2: `capture` is the same for the whole file"),
        ('{"prompt": "a", "id": [1]}', r"line 2: `id` must be a string or a number"),
        ('{"prompt": "a", "id": true}', r"line 2: `id` must be a string or a number"),
        ('{"prompt": "a", "id": "x"}', r"line 2: id 'x' is also on line 1; ids must be unique"),
    ],
)
def test_bad_lines_are_named(tmp_path, line, message):
    with pytest.raises(ToolError, match=message):
        read_lines(write(tmp_path, '{"prompt": "first", "id": "x"}', line))


def test_missing_empty_and_undecodable_files(tmp_path):
    with pytest.raises(ToolError, match="no such file"):
        read_lines(tmp_path / "absent.jsonl")
    with pytest.raises(ToolError, match="no prompts"):
        read_lines(write(tmp_path, "", "   "))
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ToolError, match="cannot read it as UTF-8"):
        read_lines(binary)


def test_blank_lines_keep_their_numbers_and_ids_default_to_them(tmp_path):
    lines = read_lines(write(tmp_path, '{"prompt": "a"}', "", '{"prompt": "b", "id": 5}'))
    assert [number for number, _ in lines] == [0, 2]
    # the default id of line 0 is 0, so an explicit id 0 on another line collides
    with pytest.raises(ToolError, match=r"line 2: id 0 is also on line 1"):
        read_lines(write(tmp_path, '{"prompt": "a"}', '{"prompt": "b", "id": 0}'))


def test_a_lines_job_fields_win_over_the_commands_defaults_and_the_rest_are_labels():
    line = {"id": "q1", "prompt": "2+2=", "max_tokens": 3, "seed": 7, "stop": ["\n"], "topic": "math", "n": 2}
    request = job_request(line, "tiny", CAPTURE, max_tokens=256, temperature=0.5)
    assert request == {
        "model": "tiny",
        "prompt": "2+2=",
        "max_tokens": 3,
        "seed": 7,
        "stop": ["\n"],
        "temperature": 0.5,
        "capture": CAPTURE,
    }
    assert labels(line) == {"topic": "math", "n": 2}
    assert job_request({"prompt": "x"}, "tiny", None, 256, 0.0) == {
        "model": "tiny",
        "prompt": "x",
        "max_tokens": 256,
        "temperature": 0.0,
    }


def test_trace_lines_get_no_sampling_defaults_and_capture_their_reply():
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    request = job_request({"mode": "trace", "messages": chat}, "tiny", CAPTURE, 256, 0.0)
    assert "max_tokens" not in request and "temperature" not in request
    assert request["capture"]["positions"] == "completion"
    raw = job_request({"mode": "trace", "prompt": "some text"}, "tiny", CAPTURE, 256, 0.0)
    assert raw["capture"]["positions"] == "all"
    last = job_request({"mode": "trace", "prompt": "t"}, "tiny", {**CAPTURE, "positions": "last"}, 256, 0.0)
    assert last["capture"]["positions"] == "last"


def test_a_request_the_api_would_refuse_is_named_by_line(tmp_path):
    path = tmp_path / "p.jsonl"
    with pytest.raises(ToolError, match=r"p.jsonl line 4: temperature: Input should be less than or equal to 2"):
        _checked(path, 3, job_request({"prompt": "x", "temperature": 5}, "tiny", None, 256, 0.0))
    with pytest.raises(ToolError, match=r"line 1: .*a trace job"):
        _checked(path, 0, job_request({"mode": "trace", "prompt": "x", "max_tokens": 4}, "tiny", None, 256, 0.0))
    assert _checked(path, 0, {"model": "tiny", "prompt": "x"}) == {"model": "tiny", "prompt": "x"}
    assert json.dumps(job_request({"prompt": "x"}, "tiny", CAPTURE, 256, 0.0))  # plain JSON for the API


def test_mode_trace_is_the_default_of_lines_that_do_not_say():
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    traced = job_request({"messages": chat}, "tiny", CAPTURE, 256, 0.0, mode="trace")
    assert traced["mode"] == "trace" and "max_tokens" not in traced and "temperature" not in traced
    assert traced["capture"]["positions"] == "completion"
    own = job_request({"prompt": "x", "mode": "generate"}, "tiny", CAPTURE, 256, 0.0, mode="trace")
    assert own["mode"] == "generate" and own["max_tokens"] == 256  # a line's own mode wins
    assert "mode" not in job_request({"prompt": "x"}, "tiny", CAPTURE, 256, 0.0)  # generate, as before


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x85"])
def test_lines_end_at_newline_only(tmp_path, separator):
    """JSON allows these raw inside a string; str.splitlines() broke the line there, and every
    line after it was numbered one too far."""
    path = tmp_path / "p.jsonl"
    path.write_text(f'{{"prompt": "a{separator}b", "id": "x"}}\r\n{{"prompt": "c"}}\n', newline="")
    lines = read_lines(path)
    assert [number for number, _ in lines] == [0, 1]
    assert lines[0][1]["prompt"] == f"a{separator}b" and lines[1][1] == {"prompt": "c"}
    path.write_text(f'{{"prompt": "a{separator}b"}}\n{{"prompt": "c", "id": true}}\n', newline="")
    with pytest.raises(ToolError, match=r"p.jsonl line 2: `id` must be"):
        read_lines(path)


@pytest.mark.parametrize("control", ["\x0c", "\x1c", "\x1e"])
def test_a_raw_control_character_is_named_on_its_own_line(tmp_path, control):
    """Not valid JSON raw in a string (json.dumps escapes it), so refused: on the line it is on."""
    path = tmp_path / "p.jsonl"
    path.write_text(f'{{"prompt": "c"}}\n{{"prompt": "a{control}b"}}\n{{"prompt": "d"}}\n', newline="")
    with pytest.raises(ToolError, match=r"p.jsonl line 2: not JSON \(Invalid control character"):
        read_lines(path)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("NaN", r"line 2: label `score`: NaN is not a finite number"),
        ("Infinity", r"line 2: label `score`: Infinity is not a finite number"),
        ("-Infinity", r"line 2: label `score`: -Infinity is not a finite number"),
        ("1e999", r"line 2: label `score`: 1e999 is not a finite number"),
        ("9" * 5000, r"line 2: label `score`: an integer of 5000 digits is too long"),
        ('{"a": 1}', r"line 2: label `score` is an object; a label is a string, a finite number, true/false or null"),
        ("[1, 2]", r"line 2: label `score` is a list"),
        ('[{"x": NaN}]', r"line 2: label `score`: NaN is not a finite number"),
    ],
)
def test_labels_are_plain_finite_values(tmp_path, value, message):
    with pytest.raises(ToolError, match=message):
        read_lines(write(tmp_path, '{"prompt": "a"}', f'{{"prompt": "b", "score": {value}}}'))


def test_job_fields_and_ids_must_be_finite_too(tmp_path):
    with pytest.raises(ToolError, match=r"line 1: `temperature`: NaN is not a finite number"):
        read_lines(write(tmp_path, '{"prompt": "a", "temperature": NaN}'))
    with pytest.raises(ToolError, match=r"line 1: `id`: an integer of 4301 digits is too long"):
        read_lines(write(tmp_path, '{"prompt": "a", "id": ' + "1" * 4301 + "}"))
    fine = read_lines(write(tmp_path, '{"prompt": "a", "n": 1.5e3, "big": ' + "7" * 300 + ', "ok": true, "x": null}'))
    assert labels(fine[0][1]) == {"n": 1500.0, "big": int("7" * 300), "ok": True, "x": None}
