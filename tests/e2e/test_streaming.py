"""`stream: true` on the OpenAI routes, read with the openai SDK's streaming iterator and LangChain's
`.stream` against the live stack: the pieces join into exactly the non-streamed text (choice by
choice with `n` > 1 or several prompts, each chunk naming its choice's index), the last chunk
carries `actq` (the job and its activations manifest), `include_usage` adds the usage chunk, a
stop string never shows, and an error after the stream began reaches the SDK as an APIError."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from langchain_openai import ChatOpenAI
from openai import OpenAI

from tests.support.stack import SMOL, TINY

MESSAGES = [{"role": "user", "content": "Name three colours."}]
STORY = [{"role": "user", "content": "Write a long story about a cat who learns to sail."}]
CAPTURE = {"modules": ["model.layers.1"], "positions": "generated"}


@pytest.fixture(scope="module")
def client(live):
    with OpenAI(base_url=live.base_url + "/v1", api_key="unused", timeout=120, max_retries=0) as c:
        yield c


def read(stream) -> tuple[list, str]:
    """Every chunk, and the text their pieces join into."""
    chunks = list(stream)
    pieces = []
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.delta.content if chunk.object == "chat.completion.chunk" else choice.text
            pieces.append(piece or "")
    return chunks, "".join(pieces)


def content_chunks(chunks) -> int:
    return sum(1 for c in chunks for ch in c.choices if (ch.delta.content if hasattr(ch, "delta") else ch.text))


def test_chat_stream_joins_into_the_non_streamed_text_with_usage_and_manifest(live, http, client):
    asked = {"model": TINY, "messages": MESSAGES, "max_tokens": 24, "temperature": 0}
    whole = client.chat.completions.create(**asked)
    raw = client.chat.completions.with_raw_response.create(
        **asked, stream=True, stream_options={"include_usage": True}, extra_body={"capture": CAPTURE}
    )
    assert raw.headers["content-type"].startswith("text/event-stream")
    job_id = raw.headers["x-actq-job-id"]
    chunks, text = read(raw.parse())

    assert text == whole.choices[0].message.content and text  # exactly the non-streamed text
    first, *middle, finish, usage = chunks
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert all(c.object == "chat.completion.chunk" and c.id == f"chatcmpl-{job_id}" for c in chunks)
    assert all(c.usage is None for c in chunks[:-1]) and all(len(c.choices) == 1 for c in chunks[:-1])
    assert finish.choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    assert usage.choices == [] and usage.usage.model_dump(
        include={"prompt_tokens", "completion_tokens", "total_tokens"}
    ) == whole.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})
    actq = usage.model_extra["actq"]
    job = http.get(f"/jobs/{job_id}").json()
    assert actq["job_id"] == job_id and actq["live"] is True
    assert actq["activations"] == job["activations"] and actq["activations"]["tensors"][0]["name"] == "model.layers.1"
    assert http.get(f"/jobs/{job_id}/request").json()["stream"] is True and job["result"]["text"] == text
    assert not any("actq" in (c.model_extra or {}) for c in chunks[:-1])


def test_legacy_completion_stream_joins_into_the_non_streamed_text(live, http, client):
    asked = {"model": TINY, "prompt": "The quick brown fox", "max_tokens": 32, "temperature": 0}
    whole = client.completions.create(**asked)
    raw = client.completions.with_raw_response.create(**asked, stream=True)
    chunks, text = read(raw.parse())
    assert text == whole.choices[0].text and text
    assert all(c.object == "text_completion" and c.id == f"cmpl-{raw.headers['x-actq-job-id']}" for c in chunks)
    last = chunks[-1]
    assert last.choices[0].finish_reason == "length" and last.choices[0].text == ""
    assert last.model_extra["actq"]["job_id"] == raw.headers["x-actq-job-id"]
    assert last.model_extra["actq"]["activations"] is None and last.usage is None  # usage not asked for


def test_log_probabilities_come_whole_with_the_finish_reason(live, client):
    asked = {
        "model": TINY,
        "messages": MESSAGES,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = client.chat.completions.create(**asked).choices[0].logprobs
    chunks, _ = read(client.chat.completions.create(**asked, stream=True))
    shown = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs is not None]
    assert len(shown) == 1 and chunks[-1].choices[0].finish_reason == "length"
    assert shown[0].model_dump() == whole.model_dump() and len(whole.content) == 8


def test_random_tokens_join_exactly_whatever_bytes_they_split(live, client):
    """The tiny model's weights are random: its greedy text is arbitrary tokens of SmolLM2's
    vocabulary, pieces of multi-byte characters among them."""
    for prompt in ("日本語の文章", "emoji 😀🎉 and more", "Ελληνικά και"):
        asked = {"model": TINY, "prompt": prompt, "max_tokens": 64, "temperature": 0}
        whole = client.completions.create(**asked).choices[0].text
        _, text = read(client.completions.create(**asked, stream=True))
        assert text == whole


def test_stream_options_are_checked_before_anything_is_queued(live, http, client):
    bad = [
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
        ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),
        ({"stream": True, "stream_options": ["include_usage"]}, "stream_options"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ]
    for fields, param in bad:
        response = http.post("/v1/chat/completions", json={"model": TINY, "messages": MESSAGES, **fields})
        assert response.status_code == 400, (fields, response.text)
        assert response.headers["content-type"] == "application/json"
        assert response.json()["error"]["param"] == param, response.json()
    many = http.post("/v1/completions", json={"model": TINY, "prompt": ["a", "b"], "n": 200, "stream": True})
    assert many.status_code == 400 and "would make 400 jobs" in many.json()["error"]["message"], many.text
    with pytest.raises(openai.BadRequestError, match="include_usage"):
        client.chat.completions.create(model=TINY, messages=MESSAGES, stream=True, stream_options={"include_usage": 1})
    assert http.get("/jobs").json() == []


def by_index(chunks) -> dict[int, list]:
    """Each choice's chunks, in order of arrival."""
    choices: dict[int, list] = {}
    for chunk in chunks:
        assert len(chunk.choices) <= 1, chunk  # one choice per chunk, named by its index
        for choice in chunk.choices:
            choices.setdefault(choice.index, []).append(choice)
    return choices


def test_chat_stream_with_n_choices_names_each_by_index(live, http, client):
    """n=3 at temperature 1 with a seed: three different jobs, each choice's pieces join into its
    own job's text, each choice starts with the role and ends with its own finish chunk, the usage
    is the whole request's and `actq` (on the last chunk) names every job."""
    asked = {"model": TINY, "messages": MESSAGES, "max_tokens": 12, "temperature": 1.0, "seed": 5, "n": 3}
    raw = client.chat.completions.with_raw_response.create(**asked, stream=True, stream_options={"include_usage": True})
    job_ids = raw.headers["x-actq-job-id"].split(",")
    chunks = list(raw.parse())
    choices = by_index(chunks)
    assert sorted(choices) == [0, 1, 2] and len(set(job_ids)) == 3
    texts = []
    for index, job_id in enumerate(job_ids):
        mine = choices[index]
        assert mine[0].delta.role == "assistant" and mine[0].delta.content == ""
        assert mine[-1].finish_reason == "length" and [c for c in mine if c.finish_reason] == [mine[-1]]
        text = "".join(c.delta.content or "" for c in mine)
        job = http.get(f"/jobs/{job_id}").json()
        assert text == job["result"]["text"] and http.get(f"/jobs/{job_id}/request").json()["stream"] is True
        texts.append(text)
    assert len(set(texts)) > 1, texts  # sampled: the choices are different jobs, not one text three times
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 3 * 12
    assert [c["job_id"] for c in usage.model_extra["actq"]["choices"]] == job_ids
    assert usage.model_extra["actq"]["live"] is True
    assert not any("actq" in (c.model_extra or {}) for c in chunks[:-1])


def test_completion_stream_of_several_prompts_matches_the_non_streamed_choices(live, client):
    """Prompt i's choice j is index i * n + j, streamed or not; at temperature 0 each streamed
    choice joins into exactly the non-streamed choice of the same index."""
    prompts = ["The quick brown fox", "日本語の文章"]
    asked = {"model": TINY, "prompt": prompts, "max_tokens": 16, "temperature": 0, "n": 2}
    whole = client.completions.create(**asked)
    chunks = list(client.completions.create(**asked, stream=True))
    choices = by_index(chunks)
    assert sorted(choices) == [0, 1, 2, 3]
    for choice in whole.choices:
        assert "".join(c.text for c in choices[choice.index]) == choice.text
        assert choices[choice.index][-1].finish_reason == choice.finish_reason
    assert whole.choices[0].text != whole.choices[2].text  # two prompts, two texts
    streamed_jobs = {c["job_id"] for c in chunks[-1].model_extra["actq"]["choices"]}
    assert len(streamed_jobs) == 4 and not streamed_jobs & {c["job_id"] for c in whole.model_extra["actq"]["choices"]}


def test_an_unknown_model_is_an_ordinary_404_before_the_stream(live, client):
    with pytest.raises(openai.NotFoundError, match="not served"):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, stream=True)


def test_a_replay_of_a_finished_job_says_it_is_not_live_and_sends_one_piece(live, http):
    body = {"model": TINY, "messages": MESSAGES, "max_tokens": 12, "stream": True}
    headers = {"Idempotency-Key": "stream-replay-1"}
    first = http.post("/v1/chat/completions", json=body, headers=headers)
    again = http.post("/v1/chat/completions", json=body, headers=headers)
    assert first.headers["x-actq-job-id"] == again.headers["x-actq-job-id"]
    assert ": actq: not streamed live: the job had already finished" in again.text
    events = [line.removeprefix("data: ") for line in again.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    pieces = [c["choices"][0]["delta"]["content"] for c in chunks if c["choices"][0]["delta"].get("content")]
    job = http.get(f"/jobs/{again.headers['x-actq-job-id']}").json()
    assert pieces == [job["result"]["text"]]
    assert chunks[-1]["actq"]["live"] is False and "already finished" in chunks[-1]["actq"]["not_live"]


def test_scoring_a_prompt_streams_it_in_one_piece(live, client):
    asked = {"model": TINY, "prompt": "Score this text", "max_tokens": 0, "echo": True, "logprobs": 0}
    whole = client.completions.create(**asked)
    chunks, text = read(client.completions.create(**asked, stream=True))
    assert text == whole.choices[0].text == "Score this text"
    assert chunks[-1].model_extra["actq"]["live"] is False
    assert chunks[-1].choices[0].logprobs.token_logprobs == whole.choices[0].logprobs.token_logprobs


@pytest.mark.slow
def test_a_long_generation_arrives_in_several_pieces_and_joins_exactly(live_smol, client):
    asked = {"model": SMOL, "messages": STORY, "max_tokens": 48, "temperature": 0}
    whole = client.chat.completions.create(**asked).choices[0].message.content
    chunks, text = read(client.chat.completions.create(**asked, stream=True))
    assert text == whole
    assert content_chunks(chunks) > 1, chunks  # tokens as the worker produced them, not one piece at the end
    assert chunks[-1].model_extra["actq"]["live"] is True


@pytest.mark.slow
def test_a_stop_string_never_shows_in_the_streamed_text(live_smol, client):
    asked = {"model": SMOL, "messages": STORY, "max_tokens": 48, "temperature": 0}
    full = client.chat.completions.create(**asked).choices[0].message.content
    words = full.split()
    stop = " " + words[len(words) // 2]  # a word halfway through the greedy text
    cut = full[: full.find(stop)]
    whole = client.chat.completions.create(**asked, stop=[stop]).choices[0].message.content
    assert whole == cut
    stream = client.chat.completions.create(**asked, stop=[stop], stream=True)
    seen = ""
    for chunk in stream:
        for choice in chunk.choices:
            seen += choice.delta.content or ""
            assert stop not in seen and cut.startswith(seen), seen  # never past the cut, at any moment
    assert seen == cut


@pytest.mark.slow
def test_langchain_stream_yields_the_same_text(live_smol, client):
    llm = ChatOpenAI(
        model=SMOL, base_url=live_smol.base_url + "/v1", api_key="unused", temperature=0, max_tokens=40, max_retries=0
    )
    prompt = "Write a long story about a cat who learns to sail."
    whole = (
        client.chat.completions.create(
            model=SMOL, messages=[{"role": "user", "content": prompt}], max_tokens=40, temperature=0
        )
        .choices[0]
        .message.content
    )
    pieces = [chunk.content for chunk in llm.stream(prompt)]
    assert "".join(pieces) == whole
    assert sum(1 for p in pieces if p) > 1


@pytest.mark.slow
def test_a_job_cancelled_mid_stream_reaches_the_sdk_as_an_error(live_smol, client):
    raw = client.chat.completions.with_raw_response.create(
        model=SMOL, messages=STORY, max_tokens=200, temperature=0, stream=True
    )
    job_id = raw.headers["x-actq-job-id"]
    stream = raw.parse()
    text, cancelled = "", False
    with pytest.raises(openai.APIError, match=f"job {job_id} was cancelled") as raised:
        for chunk in stream:
            text += chunk.choices[0].delta.content or ""
            if text and not cancelled:  # the job is generating: cancel it
                assert httpx.delete(f"{live_smol.base_url}/jobs/{job_id}").status_code == 202
                cancelled = True
    assert text and raised.value.body["job_id"] == job_id and raised.value.body["code"] == "cancelled"
