"""The shapes of `POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info` (vLLM's, at the
server root), and of the call that carries them from the API, which holds no tokenizer, to a
worker of the model over Redis (api/routes/tokenizer.py, worker/engine/tokenizer_service.py).

Both sides validate the same shapes: the API the client's body, the worker the call it takes from
Redis (JSON only)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, model_validator

from shared.schemas import MAX_MESSAGES, MAX_PROMPT_CHARS, ChatMessage, Strict

MAX_DETOKENIZE_TOKENS = 1_000_000
ModelName = Annotated[str, Field(min_length=1, max_length=200)]


class TokenizeRequest(Strict):
    """Text (`prompt`) or a chat (`messages`, rendered with the model's chat template, as a chat
    job's prompt is). `add_special_tokens` (text only, default true as in vLLM) adds what the
    tokenizer adds around a text (a BOS for some models); `add_generation_prompt` (chat only,
    default true) ends the chat with the assistant's turn opening. `model`: default the only model
    served."""

    model: ModelName | None = None
    prompt: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool | None = None
    return_token_strs: StrictBool = False

    @model_validator(mode="after")
    def _text_or_chat(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` (text) or `messages` (a chat, rendered with its template)")
        if self.prompt is not None and self.add_generation_prompt is not None:
            raise ValueError("add_generation_prompt applies to `messages`; leave it out for a `prompt`")
        if self.messages is not None and self.add_special_tokens:
            raise ValueError("add_special_tokens applies to a `prompt`; a chat's special tokens come from its template")
        return self


class DetokenizeRequest(Strict):
    """Token ids back to text, special tokens included (the tokenizer's `decode`)."""

    model: ModelName | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0, lt=2**63)]], Field(max_length=MAX_DETOKENIZE_TOKENS)]


class TokenizeResponse(Strict):
    count: int
    max_model_len: int  # the model's context length (0: not stated)
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs: each id's token string


class DetokenizeResponse(Strict):
    prompt: str


class TokenizerInfo(Strict):
    """What clients that tokenize for themselves need (lm-eval's RemoteTokenizer reads
    `eos_token`, `bos_token`, `pad_token` and `chat_template`): a subset of vLLM's answer, never
    the vocabulary."""

    model: str
    tokenizer_class: str
    vocab_size: int  # ids 0 to vocab_size - 1 decode
    max_model_len: int
    model_max_length: int | None  # as the tokenizer states it
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    unk_token_id: int | None
    clean_up_tokenization_spaces: bool
    chat_template: str | None
    added_tokens_decoder: dict[str, str]  # id -> content of each special token the tokenizer adds


class TokenizerCall(Strict):
    """One request as the API pushes it onto the model's list (keys.tokenizer_requests): the
    worker answers on keys.tokenizer_reply(id) unless `deadline` (unix seconds) has passed."""

    id: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
    deadline: float
    op: Literal["tokenize", "detokenize", "info"]
    tokenize: TokenizeRequest | None = None
    detokenize: DetokenizeRequest | None = None


class TokenizerError(Strict):
    """A worker's refusal: `type` is the error_type of a shared.errors class, `message` what to fix."""

    type: str
    message: str


class TokenizerReply(Strict):
    """What the worker pushes back: the answer's JSON, or why there is none."""

    result: dict[str, Any] | None = None
    error: TokenizerError | None = None
