"""vLLM's request extras on the OpenAI routes, as the API decides them alone (no worker): the
constraints vLLM names `structured_outputs` (and the deprecated `guided_*`), chat `echo` and
`continue_final_message`. What cannot apply is refused with a 400 naming the field, nothing
queued; what can is queued as a job with the constraint (tests/e2e/test_vllm_extras.py runs them)."""

from __future__ import annotations

import pytest

from tests.support.stack import TINY, job_count

CHAT = {"model": TINY, "messages": [{"role": "user", "content": "Pick a colour."}], "max_tokens": 4}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
NO_WAIT = {"actq_wait_seconds": 0.1}  # no worker here: an accepted request answers 504 with its queued job


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}}, "guided_json", "send one of them"),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "each constrain the reply"),
        (
            {"guided_json": SCHEMA, "structured_outputs": {"json": SCHEMA}},
            "guided_json",
            "deprecated name of structured_outputs.json",
        ),
        (
            {"structured_outputs": {"regex": "a+"}, "response_format": {"type": "json_object"}},
            None,
            "response_format and structured_outputs each constrain the reply",
        ),
        (
            {"structured_outputs": {"regex": "a+", "choice": ["a", "b"]}},
            "structured_outputs",
            "exactly one kind of constraint",
        ),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structured_outputs.structural_tag"),
        (
            {"structured_outputs": {"whitespace_pattern": " "}},
            "structured_outputs",
            "structured_outputs.whitespace_pattern is not supported",
        ),
        ({"structured_outputs": {"regex": "(?=a)b"}}, "structured_outputs.regex", "look-around"),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "structured_outputs.grammar", "Lark grammar"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least 1 item"),
        ({"structured_outputs": {"regex": "a{9000}"}}, "structured_outputs.regex", "let the model choose sooner"),
        ({"guided_regex": r"[^\s\S]"}, "structured_outputs.regex", "allows no value at all"),
        ({"guided_json": "[1, 2]"}, "structured_outputs.json", "a schema is a JSON object"),
        (
            {"continue_final_message": True, "add_generation_prompt": True},
            None,
            "send add_generation_prompt false",
        ),
    ],
    ids=[
        "guided-and-response-format",
        "two-guided",
        "guided-and-structured",
        "structured-and-response-format",
        "two-kinds",
        "structural-tag",
        "whitespace-pattern",
        "regex-look-around",
        "gbnf",
        "no-choices",
        "forced-regex",
        "empty-regex",
        "schema-not-object",
        "continue-and-open",
    ],
)
def test_constraints_and_renderings_that_cannot_apply_are_refused_naming_the_field(
    http, redis_client, fields, param, words
):
    before = job_count(redis_client)
    response = http.post("/v1/chat/completions", json={**CHAT, **fields, **NO_WAIT})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"], error
    if param is not None:
        assert error["param"] == param, error
    assert job_count(redis_client) == before


@pytest.mark.parametrize(
    ("fields", "stored"),
    [
        ({"guided_json": SCHEMA}, {"json": SCHEMA}),
        ({"guided_json": '{"type": "object"}'}, {"json": {"type": "object"}}),
        ({"guided_regex": "(yes|no)"}, {"regex": "(yes|no)"}),
        ({"guided_choice": ["red", "blue"]}, {"choice": ["red", "blue"]}),
        ({"guided_grammar": 'start: "a" | "b"'}, {"grammar": 'start: "a" | "b"'}),
        ({"structured_outputs": {"json_object": True}}, {"json_object": True}),
        ({"structured_outputs": {"choice": ["x"]}, "response_format": {"type": "text"}}, {"choice": ["x"]}),
    ],
    ids=["guided-json", "guided-json-text", "guided-regex", "guided-choice", "guided-grammar", "json-object", "text"],
)
def test_vllms_constraints_become_the_jobs_structured_outputs(http, fields, stored):
    response = http.post("/v1/chat/completions", json={**CHAT, **fields, **NO_WAIT})
    assert response.status_code == 504, response.text  # queued: no worker runs here
    job = http.get(f"/jobs/{response.headers['x-actq-job-id']}/request").json()
    assert job["structured_outputs"] == stored


def test_the_legacy_completion_takes_them_too(http):
    body = {"model": TINY, "prompt": "Colour:", "max_tokens": 4, "guided_choice": ["red", "blue"], **NO_WAIT}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 504, response.text
    job = http.get(f"/jobs/{response.headers['x-actq-job-id']}/request").json()
    assert job["structured_outputs"] == {"choice": ["red", "blue"]}


@pytest.mark.parametrize("role", ["user", "system", "assistant"])
def test_continue_final_message_takes_a_final_message_of_any_role(http, role):
    messages = [{"role": "user", "content": "Hi."}, {"role": role, "content": "Say: the colour is"}]
    body = {**CHAT, "messages": messages, "continue_final_message": True, "add_generation_prompt": False, **NO_WAIT}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 504, response.text
    job = http.get(f"/jobs/{response.headers['x-actq-job-id']}/request").json()
    assert job["continue_final_message"] is True and job["messages"][-1]["role"] == role
