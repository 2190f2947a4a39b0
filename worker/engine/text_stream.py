"""A streamed job's text as it grows, decoded a few tokens at a time by the progress thread.

The job's final text is `tokenizer.decode(generated, skip_special_tokens=True)` cut before its
first stop string (worker/batch/generation.py). The API sends, after the streamed pieces, whatever part of
that final text they did not hold, so the pieces must always be a prefix of it. Hence:

- Incremental decoding as vLLM's detokenizer does it: decode the new tokens together with the
  ones before them (`ids[prefix:]` and `ids[prefix:read]`) and keep the difference, because a
  token's text depends on its neighbours (a SentencePiece word's leading space). A character
  whose UTF-8 bytes span tokens decodes to U+FFFD until its last byte has come: trailing U+FFFD
  is held back.
- Stop strings: only the tokens the engine has checked for a stop string are decoded (`checked`,
  the count its watch last reported: the decoder calls the watch after its stop check). That text
  holds no stop string that counts (one within the first `min_tokens` tokens does not:
  worker/rules/stop_strings.py), so a stop string found later begins within its last `len(longest
  stop) - 1` characters: those are held back until the job ends (what vLLM holds back too), and
  the final text, cut before the stop string, comes from the result.
- A decode that does not extend what was decoded before (a tokenizer that rewrites text across
  token boundaries, such as `clean_up_tokenization_spaces`) stops the stream for this job: the
  rest comes with the final text rather than a piece that might not be a prefix of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"  # what a piece of a multi-byte character decodes to


class TextStream:
    """`advance(checked)` -> the text that became safe to show since the last call. `ids` is the
    sequence's own list of generated ids, which the engine thread appends to: it is sliced (the
    few ids of the current window), never copied whole, and never written here."""

    def __init__(self, tokenizer: Any, ids: list[int], stops: Sequence[str] = ()) -> None:
        self.tokenizer, self.ids = tokenizer, ids
        self.hold = max((len(stop) for stop in stops), default=1) - 1
        self._prefix = self._read = 0  # ids[_prefix:_read]: the context of the next window
        self._text = ""  # the decoded text of ids[:_read]
        self.sent = 0  # characters handed out so far
        self.stopped = False  # the decoded text stopped extending itself: nothing more is handed out

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def advance(self, checked: int) -> str:
        """The new text, given that the first `checked` generated ids passed the stop check."""
        count = min(checked, len(self.ids))  # a retried step may have emptied the list meanwhile
        if self.stopped or count <= self._read:
            return ""
        window = self.ids[self._prefix : count]
        before = self._decode(window[: self._read - self._prefix])
        after = self._decode(window)
        if not after.startswith(before):
            self.stopped = True
            return ""
        text = self._text + after[len(before) :]
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self._text, self._prefix, self._read = text, self._read, count
        safe = text.rstrip(REPLACEMENT)
        safe = safe[: max(len(safe) - self.hold, 0)]
        if len(safe) <= self.sent:
            return ""
        piece = safe[self.sent :]
        self.sent = len(safe)
        return piece
