"""min_tokens with stop strings, as vLLM's v1 engine has them (PR 22014): no stop string counts
until min_tokens tokens are generated; one that ends later counts even if it began earlier, and
the reply is cut before it. Checked against a plain rendition of vLLM's per-token loop
(`vllm_reference`) on the tiny model's real generations (SmolLM2's tokenizer)."""

from __future__ import annotations

import pytest

from shared.schemas import JobRequest
from shared.settings import Settings
from worker.rules.stop_strings import stop_cut

pytestmark = pytest.mark.model  # loads the tiny model in this process

MESSAGES = [{"role": "user", "content": "Tell me a story about a red fox."}]


@pytest.fixture(scope="module")
def served(tiny_dir):
    from worker.batch.served import ServedModel
    from worker.model.loading import load

    return ServedModel(load(Settings(model=str(tiny_dir), model_name="tiny")))


def generate(served, max_tokens: int, **fields):
    request = JobRequest.model_validate({"model": "tiny", "messages": MESSAGES, **fields})
    return served.run(request, [], max_tokens)


def vllm_reference(decode, ids: list[int], stops: list[str], min_tokens: int) -> tuple[str, int] | None:
    """vLLM's detokenizer, one token at a time: after token k (k > min_tokens) a stop string is
    looked for where it would end in token k's new characters, or, while k <= min_tokens, the
    search start moves past them. The text cut before the first found, and how many tokens were
    generated; None when no stop string was found in `ids`."""
    text, start = "", 0
    for k in range(1, len(ids) + 1):
        text = decode(ids[:k])
        if k <= min_tokens:
            start = len(text)
            continue
        for stop in stops:
            at = text.find(stop, max(start - len(stop) + 1, 0))
            if at != -1:
                return text[:at], k
        start = len(text)
    return None


@pytest.mark.parametrize("min_tokens", [4, 8])
def test_no_stop_string_counts_before_min_tokens(served, min_tokens):
    """A stop string inside the first min_tokens tokens' text neither ends the reply nor cuts it
    (before issue 47's fix it ended the reply at once, at its first token here); one that ends after
    them does, as vLLM's loop finds it."""
    tokenizer = served.tokenizer

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    free = generate(served, 24, min_tokens=min_tokens)  # greedy: the same tokens up to any stop
    ids = free.token_ids[free.prompt_tokens :].tolist()
    second = decode(ids[:2])
    stop = second[-1]  # the last character of the first two tokens
    assert stop.strip() and stop in decode(ids[:min_tokens])
    got = generate(served, 24, min_tokens=min_tokens, stop=[stop])
    expected = vllm_reference(decode, ids, [stop], min_tokens)
    assert got.completion_tokens > min_tokens  # not ended by the stop string in its second token
    assert got.text.startswith(decode(ids[:min_tokens]).rstrip())  # nor cut there
    if expected is None:
        assert (got.completion_tokens, got.text, got.finish_reason) == (24, decode(ids), "length")
    else:
        assert (got.text, got.completion_tokens, got.finish_reason) == (expected[0], expected[1], "stop")
    unheld = generate(served, 24, stop=[stop])  # without min_tokens the stop string counts at once
    assert unheld.completion_tokens <= 2 and unheld.text == second[: second.index(stop)]


@pytest.mark.parametrize(
    ("text", "stops", "held", "cut"),
    [
        ("abcabc", ["b"], 0, 1),
        ("abcabc", ["b"], 2, 4),  # the first "b" ends within the held text
        ("abcabc", ["bc"], 2, 1),  # "bc" begins in the held text and ends beyond it: it counts
        ("abcabc", ["bc"], 3, 4),
        ("abcabc", ["c", "ab"], 0, 0),  # "ab" ends first
        ("abcabc", ["ca", "bc"], 0, 1),  # the first to end wins over the order given
        ("abc", ["x"], 0, None),
        ("abc", ["c"], 3, None),
    ],
)
def test_stop_cut_finds_the_first_stop_string_to_end_beyond_the_held_text(text, stops, held, cut):
    assert stop_cut(text, stops, held) == cut
