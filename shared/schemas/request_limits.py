"""A job request's limits (messages, prompt, stop strings, log-probabilities, metadata...) and
the checks of its free-form maps: `chat_template_kwargs` and `metadata`."""

from __future__ import annotations

import json
import re
from typing import Any

MAX_CAPTURE_PATTERNS = 256
MAX_MESSAGES = 512
MAX_MESSAGE_CHARS = 1_000_000
MAX_PROMPT_CHARS = 1_000_000
MAX_PROMPT_TOKEN_IDS = 1_000_000
MAX_STOP_STRINGS = 8
GREEDY_BELOW = 1e-5  # temperatures below this decode greedily (as vLLM does)
MAX_TOP_LOGPROBS = 20  # as OpenAI
MAX_LOGIT_BIAS = 300  # tokens a request biases (OpenAI's limit)
MAX_FEATURES = 65_536
MAX_METADATA_PAIRS = 16  # OpenAI's limits on `metadata` and `user`
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_USER_CHARS = 256

MAX_TEMPLATE_KWARGS = 16
MAX_TEMPLATE_KWARGS_BYTES = 4096
TEMPLATE_KWARG = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# apply_chat_template's own parameters and the variables it sets: the request's fields say these
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
        "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs",
        "bos_token", "eos_token", "unk_token", "pad_token", "raise_exception", "strftime_now",
    }
)  # fmt: skip


def check_template_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`chat_template_kwargs`: at most 16 variables named like identifiers, none of
    apply_chat_template's own, at most 4 KiB as JSON; ValueError naming what to change."""
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise ValueError(f"chat_template_kwargs holds {len(kwargs)} variables; at most {MAX_TEMPLATE_KWARGS}")
    for key in kwargs:
        if not TEMPLATE_KWARG.fullmatch(key):
            raise ValueError(f"chat_template_kwargs: {key[:80]!r} is not a template variable name (an identifier)")
        if key in RESERVED_TEMPLATE_KWARGS:
            raise ValueError(
                f"chat_template_kwargs: {key!r} is set by actq or by the request's own fields "
                "(messages, tools, add_generation_prompt, continue_final_message); leave it out"
            )
    if len(json.dumps(kwargs)) > MAX_TEMPLATE_KWARGS_BYTES:
        raise ValueError(f"chat_template_kwargs is over {MAX_TEMPLATE_KWARGS_BYTES} bytes as JSON")
    return kwargs


def check_metadata(pairs: dict[str, str]) -> dict[str, str]:
    """OpenAI's limits on `metadata`: at most 16 pairs, keys of 1 to 64 characters, values of at
    most 512 (each breach named, with its fix)."""
    if len(pairs) > MAX_METADATA_PAIRS:
        raise ValueError(f"holds {len(pairs)} pairs; at most {MAX_METADATA_PAIRS} are kept (as OpenAI's metadata)")
    for key, text in pairs.items():
        if not 1 <= len(key) <= MAX_METADATA_KEY_CHARS:
            raise ValueError(
                f"key {key[:20]!r}{'...' if len(key) > 20 else ''} has {len(key)} characters; "
                f"keys have 1 to {MAX_METADATA_KEY_CHARS}"
            )
        if len(text) > MAX_METADATA_VALUE_CHARS:
            raise ValueError(
                f"the value of {key!r} has {len(text)} characters; values have at most {MAX_METADATA_VALUE_CHARS}"
            )
    return pairs
