"""litellm 1.110 (stock, from PyPI) as a client of actq's OpenAI routes: a prompt over a model's
context is a ContextWindowExceededError (litellm reads OpenAI's and vLLM's wording), so a Router's
`context_window_fallbacks` send it on to a model with a longer context, which answers it."""

from __future__ import annotations

import os

import httpx
import pytest

from tests.support.stack import SMOL, TINY, TestStack

pytestmark = pytest.mark.model

LONG = [{"role": "user", "content": "word " * 400}]  # over the tiny model's 256 tokens, well within SmolLM2's 8192


@pytest.fixture(scope="module")
def litellm():
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network: its bundled cost map
    import litellm

    return litellm


def params(stack: TestStack, model: str) -> dict:
    return {"model": f"openai/{model}", "api_base": f"{stack.base_url}/v1", "api_key": "unused"}


def test_a_prompt_over_the_context_is_a_context_window_error(live: TestStack, litellm) -> None:
    with pytest.raises(litellm.ContextWindowExceededError) as raised:
        litellm.completion(messages=LONG, max_tokens=4, num_retries=0, **params(live, TINY))
    assert "maximum context length is 256 tokens" in str(raised.value)
    short = litellm.completion(messages=[{"role": "user", "content": "hi"}], max_tokens=4, **params(live, TINY))
    assert short.choices[0].finish_reason == "length"  # the same route answers what fits


def test_context_window_fallbacks_move_the_prompt_to_a_longer_context(live_smol: TestStack, litellm) -> None:
    router = litellm.Router(
        model_list=[
            {"model_name": "short", "litellm_params": params(live_smol, TINY)},
            {"model_name": "long", "litellm_params": params(live_smol, SMOL)},
        ],
        context_window_fallbacks=[{"short": ["long"]}],
        num_retries=0,
    )
    answer = router.completion(model="short", messages=LONG, max_tokens=4, temperature=0)
    job_id = answer._hidden_params["additional_headers"].get("llm_provider-x-actq-job-id")
    assert job_id, answer._hidden_params["additional_headers"]
    job = httpx.get(f"{live_smol.base_url}/jobs/{job_id}", timeout=30).json()
    assert job["model"] == SMOL and job["status"] == "succeeded"
    assert job["result"]["usage"]["prompt_tokens"] > 256  # the long prompt, answered by the longer context
