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
