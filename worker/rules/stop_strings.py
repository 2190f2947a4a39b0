"""Where a stop string ends a reply, as vLLM's v1 engine decides it: no stop string counts until
`min_tokens` tokens have been generated (vLLM PR 22014: its detokenizer moves the point its stop
search starts from to the end of the text after each of the first `min_tokens` tokens). A stop
string counts when it ends in the text of a later token, even if it began earlier; the reply is
cut before it. The first to end wins (ties: the order given), as checking after each token finds
it. EOS is held off for those tokens too, by the sampler (worker/model/sampling.py, transformers'
`min_new_tokens`), as vLLM's min-tokens logits processor holds off its stop tokens.

The output stage checks after each token (`RowRules.take`, on the tail that can hold a new stop
string) and the result cuts the whole text (worker/batch/generation.py): both ask `stop_cut`."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def stop_cut(text: str, stops: Sequence[str], checked_from: int = 0) -> int | None:
    """Where to cut `text`: the start of the stop string that ends first beyond its first
    `checked_from` characters (the text of the first `min_tokens` tokens), or None."""
    best: tuple[int, int] | None = None  # (end, start)
    for stop in stops:
        start = text.find(stop, max(checked_from - len(stop) + 1, 0))
        if start != -1 and (best is None or start + len(stop) < best[0]):
            best = (start + len(stop), start)
    return None if best is None else best[1]


def checked_from(decode: Callable[[list[int]], str], generated: Sequence[int], min_tokens: int) -> int:
    """The length of the text of the first `min_tokens` generated tokens: no stop string may end
    within it. `decode` is the tokenizer's decode (ids -> text)."""
    if min_tokens <= 0:
        return 0
    return len(decode(list(generated[:min_tokens])))
