"""The state of a fast tokenizer's backend (the `tokenizers` object under a transformers
tokenizer) that Python attributes do not show (worker/nnsight/guard.py): its padding and
truncation (put back exactly: they are plain parameters), and what decides how text encodes and
decodes: the added tokens, the vocabulary's size, the normalizer, pre-tokenizer, post-processor
and decoder (their serialized form), the model's kind and settings (a BPE's dropout, its unknown
token), and, for the vocabulary and merges themselves, a fixed probe: a text of many scripts
encoded and one id in every `_STRIDE` decoded (a full serialization costs 80-100 ms a read on
SmolLM2's 49k vocabulary; the probe well under a millisecond). A change there cannot be put back
(the backend has no way to load a state in place): it is named.
"""

from __future__ import annotations

from typing import Any

_STRIDE = 61
_PROBE = (
    "Hello, World! The quick brown fox jumps over 13 lazy dogs.\n\n\tIndented  double  spaces "
    "ÀÉÎÕÜ àéîõü ß Ωμέγα Привет мир 你好，世界 こんにちは 안녕하세요 مرحبا שלום 🙂🚀 "
    'def f(x):\n    return x ** 2  # comment\n{"json": [1, 2.5, null]} 0123456789 '
)
_MODEL_SETTINGS = (
    "dropout",
    "unk_token",
    "continuing_subword_prefix",
    "end_of_word_suffix",
    "fuse_unk",
    "byte_fallback",
    "ignore_merges",
    "max_input_chars_per_word",
)


def backend_of(tokenizer: object) -> Any | None:
    """The `tokenizers.Tokenizer` under a fast transformers tokenizer, or None."""
    backend = getattr(tokenizer, "__dict__", {}).get("_tokenizer")
    return backend if backend is not None and hasattr(backend, "get_added_tokens_decoder") else None


class Backend:
    """A backend's state as noted now."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.padding, self.truncation = backend.padding, backend.truncation
        self.special = getattr(backend, "encode_special_tokens", None)
        self.state = self._state()

    def _state(self) -> dict[str, object]:
        b = self.backend
        added = b.get_added_tokens_decoder()
        size = b.get_vocab_size(with_added_tokens=True)
        specials = "".join(str(token) for token in added.values())
        state: dict[str, object] = {
            "vocabulary size": (b.get_vocab_size(with_added_tokens=False), size),
            "added tokens": sorted((i, repr(token)) for i, token in added.items()),
            "model": (type(b.model).__name__, *(repr(getattr(b.model, name, None)) for name in _MODEL_SETTINGS)),
            "encoding": b.encode(_PROBE + specials, add_special_tokens=True).ids,
            "vocabulary": b.decode(list(range(0, size, _STRIDE)), skip_special_tokens=False),
        }
        for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
            component = getattr(b, part)
            state[part] = None if component is None else component.__getstate__()
        return state

    def restore(self) -> tuple[list[str], list[str]]:
        """Padding, truncation and special-token splitting set back; returns (what was put back,
        what differs and cannot be)."""
        b, restored = self.backend, []
        if b.padding != self.padding:
            if self.padding is None:
                b.no_padding()
            else:
                b.enable_padding(**self.padding)
            restored.append("padding")
        if b.truncation != self.truncation:
            if self.truncation is None:
                b.no_truncation()
            else:
                b.enable_truncation(**self.truncation)
            restored.append("truncation")
        if self.special is not None and b.encode_special_tokens != self.special:
            b.encode_special_tokens = self.special
            restored.append("encode_special_tokens")
        now = self._state()
        differ = [key for key, value in self.state.items() if now.get(key) != value]
        if b.padding != self.padding or b.truncation != self.truncation:
            differ.append("padding or truncation")
        return restored, differ
