"""worker/engine/text_stream.py: the pieces of a streamed job's text join into a prefix of its final text,
whatever the tokens (multi-byte characters split across them, a word's leading space) and however
many come per round, and never show what the final text cuts at a stop string."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from worker.engine.text_stream import TextStream

TEXTS = [
    "Plain ASCII, with punctuation: done.",
    "héllo wörld, naïve café",
    "emoji 😀🎉 and CJK 日本語のテキスト, then Ελληνικά",
    "🧑‍🔬 a joined emoji, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 outside the BMP",
]


@pytest.fixture(scope="module")
def tokenizer(smol_dir: Path):
    return AutoTokenizer.from_pretrained(smol_dir, local_files_only=True)


def final_text(tokenizer, ids: list[int], stops: list[str]) -> str:
    """What worker/batch/generation.py answers: the whole decode, cut before the first stop string."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    cuts = [text.find(s) for s in stops if s in text]
    return text[: min(cuts)] if cuts else text


def run(tokenizer, ids: list[int], stops: list[str], rounds: list[int]) -> tuple[list[str], int, int]:
    """The engine appending `ids` one by one (ending at a stop string as its decoder does, and
    reporting only checked counts), with the progress thread's rounds after `rounds[i]` tokens
    and once at the end. Returns the pieces, the tokens generated and the tokens checked."""
    generated: list[int] = []
    stream = TextStream(tokenizer, generated, stops)
    pieces, checked = [], 0
    for token in ids:
        generated.append(token)
        if any(stop in tokenizer.decode(generated) for stop in stops):
            break  # the row ends "stop": the watch is not asked, the count stays
        checked = len(generated)
        if checked in rounds:
            pieces.append(stream.advance(checked))
    pieces.append(stream.advance(checked))
    return pieces, len(generated), checked


@pytest.mark.model
@pytest.mark.parametrize("text", TEXTS)
def test_pieces_join_into_the_text_for_every_round_size(tokenizer, text):
    ids = tokenizer.encode(text)
    rng = random.Random(0)
    every = [list(range(1, len(ids) + 1)), []]  # a round after each token; one round at the end
    for rounds in every + [sorted(rng.sample(every[0], k=rng.randint(1, len(ids)))) for _ in range(20)]:
        pieces, _, _ = run(tokenizer, ids, [], rounds)
        assert "".join(pieces) == text, (rounds, pieces)
        assert all("\ufffd" not in piece for piece in pieces), pieces  # no half of a character shown


@pytest.mark.model
def test_a_character_split_across_tokens_waits_for_its_last_byte(tokenizer):
    ids = tokenizer.encode("a 😀")
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # the emoji spans two tokens
    generated: list[int] = []
    stream = TextStream(tokenizer, generated)
    shown = []
    for token in ids:
        generated.append(token)
        shown.append(stream.advance(len(generated)))
    assert "".join(shown) == "a 😀"
    assert shown[-2] in ("", " ") and shown[-1].endswith("😀")  # nothing of the emoji until it is whole


@pytest.mark.model
@pytest.mark.parametrize("stops", [["STOP"], ["\n\n", "The end"], ["x"]])
def test_streamed_text_never_shows_what_a_stop_string_cuts(tokenizer, stops):
    text = "Counting: one two three. STOP here, then\n\nThe end of it, x marks"
    ids = tokenizer.encode(text)
    for rounds in ([*range(1, len(ids) + 1)], [3, 9, 10, 11, 12, 13], []):
        pieces, used, checked = run(tokenizer, ids, stops, rounds)
        final = final_text(tokenizer, ids[:used], stops)
        joined = "".join(pieces)
        assert final.startswith(joined), (joined, final)
        assert not any(stop in joined for stop in stops)
        shown = tokenizer.decode(ids[:checked])  # held back: the last len(longest stop) - 1 characters
        assert joined == shown[: len(shown) - (max(map(len, stops)) - 1)]


@pytest.mark.model
def test_holding_back_for_a_stop_string_that_never_comes(tokenizer):
    """A text that ends on the start of a stop string keeps that start back: the job's final
    text has it (the API sends it after the pieces)."""
    ids = tokenizer.encode("Wait for the STO")
    pieces, used, _ = run(tokenizer, ids, ["STOP"], list(range(1, len(ids) + 1)))
    joined, final = "".join(pieces), final_text(tokenizer, ids[:used], ["STOP"])
    assert final == "Wait for the STO" and joined == final[: len(final) - 3]


def test_the_tokens_before_the_window_give_a_word_its_space():
    """A SentencePiece-style decoder drops the leading space of the first token it decodes: the
    window starts with tokens already shown, so the next word keeps its space."""
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    assert tokenizer.decode([2]) == "world"  # alone, the space is gone
    generated: list[int] = []
    stream = TextStream(tokenizer, generated)
    pieces = []
    for token in (1, 2, 3):
        generated.append(token)
        pieces.append(stream.advance(len(generated)))
    assert pieces == ["Hello", " world", "!"]


def test_a_decode_that_rewrites_earlier_text_ends_the_pieces():
    """clean_up_tokenization_spaces turns "a ' b" into "a'b": the window's text no longer extends
    what was shown, and no piece is guessed (the job's final text brings the rest)."""
    backend = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "'": 2, "b": 3}, unk_token="<unk>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=True)
    generated = [1, 2]
    stream = TextStream(tokenizer, generated)
    assert stream.advance(2) == "a '"
    generated.append(3)
    assert stream.advance(3) == "" and stream.stopped


@pytest.mark.model
def test_only_checked_tokens_are_decoded_and_a_shorter_list_waits(tokenizer):
    ids = tokenizer.encode("one two three")
    generated = list(ids)
    stream = TextStream(tokenizer, generated)
    assert stream.advance(1) == tokenizer.decode(ids[:1])  # the rest is not checked yet
    generated.clear()  # a retried step empties the list; the same tokens come again
    assert stream.advance(3) == ""
    generated.extend(ids)
    assert stream.advance(len(ids)) == tokenizer.decode(ids)[len(tokenizer.decode(ids[:1])) :]
