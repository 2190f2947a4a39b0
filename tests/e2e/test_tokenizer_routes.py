"""`POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info` against the live stack: the
worker's own tokenizer answers (the API holds none), in vLLM's shapes, and every id equals what
the model's tokenizer, loaded here on its own from the model's folder, gives. Then lm-eval's own
RemoteTokenizer, as `local-completions` uses it, against a stack that serves one model behind an
API key (lm-eval names no model and sends its key as a Bearer token)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from shared import keys
from shared.cli.redis_server import RedisServer
from shared.client import BadRequest, Client
from shared.schemas import MAX_PROMPT_CHARS
from shared.tokenization import MAX_DETOKENIZE_TOKENS
from tests.e2e.conftest import own_stack
from tests.support.stack import TINY, TestStack

TEXTS = [
    "The capital of France is",
    "  two leading spaces,\ttabs\nand new lines\n\n",
    "accents é, emoji 🙂 and 漢字",
    "special-token strings <|im_start|>user\nhi<|im_end|> are special tokens",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "5"},
]
ALONE = "tiny-alone"
KEY = "lm-eval-key"


@pytest.fixture(scope="module")
def hf(tiny_dir: Path):
    """The tiny model's tokenizer (SmolLM2's), loaded independently of the worker."""
    return AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)


def chat_ids(hf, messages: list[dict], generation_prompt: bool) -> list[int]:
    encoded = hf.apply_chat_template(messages, add_generation_prompt=generation_prompt, return_dict=True)
    return list(encoded["input_ids"])


def test_tokenize_gives_the_models_own_ids(http, hf):
    context = next(m for m in http.get("/models").json() if m["name"] == TINY)["max_context"]
    for text in TEXTS:
        for special in (True, False):
            response = http.post("/tokenize", json={"model": TINY, "prompt": text, "add_special_tokens": special})
            assert response.status_code == 200, response.text
            expected = hf(text, add_special_tokens=special)["input_ids"]
            assert response.json() == {"count": len(expected), "max_model_len": context, "tokens": expected}
    assert 1 in expected and 2 in expected  # the special-token strings became <|im_start|> and <|im_end|>
    strs = http.post("/tokenize", json={"model": TINY, "prompt": TEXTS[2], "return_token_strs": True}).json()
    assert strs["token_strs"] == hf.convert_ids_to_tokens(strs["tokens"])
    # vLLM answers an empty text as the tokenizer does: no tokens
    assert http.post("/tokenize", json={"model": TINY, "prompt": ""}).json()["tokens"] == hf("")["input_ids"] == []


def test_detokenize_round_trips_and_keeps_special_tokens(http, hf):
    for text in TEXTS:
        ids = http.post("/tokenize", json={"model": TINY, "prompt": text}).json()["tokens"]
        response = http.post("/detokenize", json={"model": TINY, "tokens": ids})
        assert response.status_code == 200, response.text
        assert response.json() == {"prompt": text} and hf.decode(ids) == text
    ids = chat_ids(hf, MESSAGES, generation_prompt=False)
    assert http.post("/detokenize", json={"model": TINY, "tokens": ids}).json()["prompt"] == hf.decode(ids)
    assert "<|im_start|>assistant\n5<|im_end|>" in hf.decode(ids)
    assert http.post("/detokenize", json={"model": TINY, "tokens": []}).json() == {"prompt": ""}


def test_chat_tokens_are_the_templates_and_a_chat_jobs(live, http, hf):
    for generation_prompt in (True, False):
        body = {"model": TINY, "messages": MESSAGES[:2], "add_generation_prompt": generation_prompt}
        response = http.post("/tokenize", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["tokens"] == chat_ids(hf, MESSAGES[:2], generation_prompt)
    default = http.post("/tokenize", json={"model": TINY, "messages": MESSAGES}).json()
    assert default["tokens"] == chat_ids(hf, MESSAGES, generation_prompt=True)
    # a chat job is given exactly these tokens
    job = live.wait(http, live.submit(http, {"model": TINY, "messages": MESSAGES, "max_tokens": 1}))
    assert job["result"]["usage"]["prompt_tokens"] == default["count"]


def test_tokenizer_info_is_the_tokenizers_without_its_vocabulary(http, hf):
    response = http.get("/tokenizer_info", params={"model": TINY})
    assert response.status_code == 200, response.text
    info = response.json()
    context = next(m for m in http.get("/models").json() if m["name"] == TINY)["max_context"]
    assert info["model"] == TINY and info["max_model_len"] == context and info["vocab_size"] == len(hf)
    assert info["tokenizer_class"] == type(hf).__name__
    for name in ("bos", "eos", "pad", "unk"):
        assert info[f"{name}_token"] == getattr(hf, f"{name}_token")
        assert info[f"{name}_token_id"] == getattr(hf, f"{name}_token_id")
    assert info["chat_template"] == hf.chat_template
    assert info["added_tokens_decoder"]["2"] == "<|im_end|>" == info["eos_token"]
    assert len(response.content) < 20_000  # never the vocabulary


def test_bad_input_is_a_4xx_saying_what_to_fix(http, hf):
    def refused(path: str, body: dict, status: int = 422) -> str:
        response = http.post(path, json=body)
        assert response.status_code == status, response.text
        assert set(response.json()) >= {"error", "detail"}
        return response.json()["detail"]

    size = len(hf)
    detail = refused("/detokenize", {"model": TINY, "tokens": [5, size, 7, size + 10]})
    assert f"tokens[1] = {size}" in detail and f"0 to {size - 1}" in detail and "2 ids" in detail
    assert "tokens.0" in refused("/detokenize", {"model": TINY, "tokens": [-1]})
    assert "exactly one of `prompt`" in refused("/tokenize", {"model": TINY})
    assert "exactly one of `prompt`" in refused("/tokenize", {"model": TINY, "prompt": "a", "messages": MESSAGES})
    assert "add_special_tokens" in refused("/tokenize", {"model": TINY, "messages": MESSAGES, "add_special_tokens": 1})
    assert "add_generation_prompt" in refused("/tokenize", {"model": TINY, "prompt": "a", "add_generation_prompt": 0})
    assert "temperature" in refused("/tokenize", {"model": TINY, "prompt": "a", "temperature": 0})
    assert "prompt" in refused("/tokenize", {"model": TINY, "prompt": "a" * (MAX_PROMPT_CHARS + 1)})
    assert "tokens" in refused("/detokenize", {"model": TINY, "tokens": [0] * (MAX_DETOKENIZE_TOKENS + 1)})
    detail = refused("/tokenize", {"model": "no-such-model", "prompt": "a"}, status=404)
    assert "'no-such-model' is not served here" in detail and TINY in detail
    assert http.get("/tokenizer_info", params={"model": "no-such-model"}).status_code == 404


def test_the_python_client(live, hf):
    with Client(live.base_url, timeout=60) as actq:
        ids = actq.tokenize(TEXTS[2], model=TINY, add_special_tokens=False)
        assert ids == hf(TEXTS[2], add_special_tokens=False)["input_ids"]
        assert actq.detokenize(ids, model=TINY) == TEXTS[2]
        assert actq.tokenize_chat(MESSAGES[:2], model=TINY) == chat_ids(hf, MESSAGES[:2], generation_prompt=True)
        with pytest.raises(BadRequest, match=f"tokens\\[0\\] = {len(hf)}"):
            actq.detokenize([len(hf)], model=TINY)


def test_a_call_no_worker_takes_ends_in_503_and_leaves_nothing(live, http, redis_client):
    """A worker listed live that never answers (it hung): the API waits its 10 s, then a 503;
    the call left on the list expires with it."""
    described = json.loads(redis_client.get(keys.model(TINY)))
    redis_client.set(keys.model("ghost"), json.dumps({**described, "name": "ghost"}))
    redis_client.sadd(keys.MODELS, "ghost")
    redis_client.zadd(keys.workers("ghost"), {"hung-worker": time.time() + 60})
    started = time.monotonic()
    response = http.post("/tokenize", json={"model": "ghost", "prompt": "a"})
    assert response.status_code == 503, response.text
    assert response.json()["error"] == "no_worker_answer", response.text
    assert "no worker of model 'ghost' answered within 10 s" in response.json()["detail"]
    assert 9 < time.monotonic() - started < 30
    assert 0 < redis_client.ttl(keys.tokenizer_requests("ghost")) <= 60
    redis_client.zadd(keys.workers("ghost"), {"hung-worker": 0})  # long gone: not live, as on /v1/models
    response = http.get("/tokenizer_info", params={"model": "ghost"})
    assert response.status_code == 404 and "no worker of model 'ghost' is live now" in response.json()["detail"]


# --- one model served, behind an API key: what lm-eval's local-completions meets ------------------


@pytest.fixture(scope="module")
def alone(live: TestStack, tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A stack of its own (its own Redis) whose one worker serves the tiny model, with API keys on."""
    root = tmp_path_factory.mktemp("tokenizer-alone")
    with (
        RedisServer(root / "redis") as server,
        own_stack(root / "stack", live.env, ACTQ_REDIS_URL=server.url, ACTQ_API_KEYS=KEY) as stack,
    ):
        stack.start_worker("alone", {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": ALONE})
        yield stack


def test_lm_evals_remote_tokenizer_works_against_actq(alone, hf):
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    base_url = f"{alone.base_url}/v1/completions"  # what lm-eval is given; it asks at the root
    assert check_remote_tokenizer_support(base_url, auth_token=KEY)
    assert not check_remote_tokenizer_support(base_url, auth_token="wrong-key", max_retries=1)
    remote = RemoteTokenizer(base_url, auth_token=KEY)
    assert (remote.eos_token, remote.bos_token, remote.pad_token) == (hf.eos_token, hf.bos_token, hf.pad_token)
    assert (remote.eos_token_id, remote.bos_token_id) == (hf.eos_token_id, hf.bos_token_id)
    for text in TEXTS:
        ids = remote.encode(text)
        assert ids == hf(text, add_special_tokens=False)["input_ids"]
        assert remote.decode(ids) == text
    assert remote.batch_decode([[1, 2], [19556]]) == [hf.decode([1, 2]), hf.decode([19556])]
    rendered = remote.apply_chat_template(MESSAGES[:2], add_generation_prompt=True)
    assert rendered == hf.apply_chat_template(MESSAGES[:2], add_generation_prompt=True, tokenize=False)


def test_the_model_may_be_left_out_only_while_one_is_served(alone, tiny_dir, hf):
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=alone.base_url, headers=auth, timeout=60) as http:
        assert http.post("/tokenize", json={"prompt": "hi"}).json()["tokens"] == hf("hi")["input_ids"]
        assert http.get("/tokenizer_info").json()["model"] == ALONE
        assert httpx.post(f"{alone.base_url}/tokenize", json={"prompt": "hi"}).status_code == 401
        alone.start_worker("second", {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": "tiny-second"})
        try:
            response = http.post("/detokenize", json={"tokens": [1]})
            assert response.status_code == 422, response.text
            assert f"several models are served here ({ALONE}, tiny-second): name one" in response.json()["detail"]
            named = http.post("/detokenize", json={"model": "tiny-second", "tokens": [1]})
            assert named.json() == {"prompt": "<|im_start|>"}
        finally:
            alone.stop_process("worker-second")


def test_with_no_worker_a_404_says_so(live, tmp_path):
    with (
        RedisServer(tmp_path / "redis") as server,
        own_stack(tmp_path / "stack", live.env, ACTQ_REDIS_URL=server.url) as stack,
        stack.client() as http,
    ):
        response = http.post("/tokenize", json={"prompt": "hi"})
        assert response.status_code == 404, response.text
        assert response.json() == {
            "error": "unknown_model",
            "detail": "no worker is serving a model now, so no tokenizer can answer; start a worker",
        }
