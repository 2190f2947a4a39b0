"""The model's tokenizer for the API, which holds none: `POST /tokenize`, `POST /detokenize` and
`GET /tokenizer_info` (api/routes/tokenizer.py) are answered here, in the engine process.

The API pushes a call (JSON, shared/tokenization.py) onto the model's list; a thread in every live
worker of the model blocks on that list (BLPOP with a short timeout, so that it can stop), and the
first to pop a call answers it on the call's own key, which expires soon so that an abandoned
reply disappears. A call whose deadline has passed (the API stopped waiting) is dropped.

The thread works on its own copy of the tokenizer: a fast tokenizer keeps per-call settings
(whether special-token strings are split) on its one Rust object, so the engine thread's
encoding and this thread's must not share it. Chats go through the same PromptEncoder as chat
jobs, so their tokens are the ones a chat job is given.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import jinja2
import redis
from pydantic import ValidationError

from shared import keys
from shared.errors import ActqError, BadRequest, JobFailure, NoChatTemplate
from shared.outages import REDIS, outage
from shared.tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizerCall,
    TokenizeRequest,
    TokenizerError,
    TokenizeResponse,
    TokenizerInfo,
    TokenizerReply,
)
from worker.rules.prompts import PromptEncoder

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from worker.batch.served import ServedModel

log = logging.getLogger(__name__)
POLL_SECONDS = 1.0  # BLPOP's timeout: how soon the thread sees that it must stop
REPLY_TTL_SECONDS = 30


class TokenizerService:
    def __init__(self, served: ServedModel, client: redis.Redis, stop: threading.Event) -> None:
        self.tokenizer: PreTrainedTokenizerBase = copy.deepcopy(served.tokenizer)
        self.gate = served.gate
        self.prompts = PromptEncoder(self.tokenizer, served.prompts.allow_special_tokens)
        self.model = served.info.name
        self.max_model_len = served.info.max_context
        self.redis = client
        self.stop = stop

    def start(self) -> TokenizerService:
        threading.Thread(target=self._serve, name="actq-tokenizer", daemon=True).start()
        return self

    def _serve(self) -> None:
        key = keys.tokenizer_requests(self.model)
        while not self.stop.is_set():
            try:
                popped = self.redis.blpop([key], timeout=POLL_SECONDS)
            except redis.RedisError as exc:  # an outage: wait it out, as the heartbeat does
                outage(REDIS).failed(exc)
                self.stop.wait(POLL_SECONDS)
                continue
            outage(REDIS).ok()
            if popped is not None:
                try:
                    self._reply(popped[1])
                except Exception:  # the thread keeps serving; the API's wait ends in a 503
                    log.exception("tokenizer call not answered")

    def _reply(self, raw: bytes | str) -> None:
        try:
            call = TokenizerCall.model_validate_json(raw)
        except ValidationError as exc:  # only the API writes here: a bug, not a client's mistake
            log.error("dropped a malformed tokenizer call: %s", exc)
            return
        if call.deadline < time.time():
            return  # nobody waits for it any more
        reply = self.answer(call).model_dump_json(exclude_none=True)
        try:
            with self.redis.pipeline() as pipe:
                pipe.rpush(keys.tokenizer_reply(call.id), reply)
                pipe.expire(keys.tokenizer_reply(call.id), REPLY_TTL_SECONDS)
                pipe.execute()
        except redis.RedisError as exc:  # the API's wait ends with a 503
            log.warning("tokenizer reply %s not sent: %s", call.id, exc)

    def answer(self, call: TokenizerCall) -> TokenizerReply:
        """The reply to one call: its result, or the error a client can act on. Never while
        trusted code runs on the model (its copy of the tokenizer shares the classes the code
        could patch: worker/batch/gate.py)."""
        with self.gate.reading():
            return self._answer(call)

    def _answer(self, call: TokenizerCall) -> TokenizerReply:
        try:
            if call.op == "tokenize" and call.tokenize is not None:
                result: dict[str, Any] = self.tokenize(call.tokenize).model_dump(exclude_none=True)
            elif call.op == "detokenize" and call.detokenize is not None:
                result = self.detokenize(call.detokenize).model_dump()
            elif call.op == "info":
                result = self.info().model_dump()
            else:
                raise BadRequest(f"a {call.op} call without its request")
        except ActqError as exc:
            return TokenizerReply(error=TokenizerError(type=exc.error_type, message=exc.message))
        except Exception as exc:
            log.exception("tokenizer call %s failed", call.id)
            return TokenizerReply(error=TokenizerError(type="internal_error", message=f"{type(exc).__name__}: {exc}"))
        return TokenizerReply(result=result)

    def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        if request.prompt is not None:
            # As the tokenizer itself (and vLLM) does it: special-token strings are special tokens.
            encoded = self.tokenizer(
                request.prompt, add_special_tokens=request.add_special_tokens is not False, split_special_tokens=False
            )
            ids = [int(i) for i in encoded["input_ids"]]
        else:
            ids = self._chat(request)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    def _chat(self, request: TokenizeRequest) -> list[int]:
        if not self.prompts.has_chat_template:
            raise NoChatTemplate(
                f"model {self.model!r} has no chat template, so `messages` cannot be rendered: send the text "
                "as `prompt`, or give the deployment a template (ACTQ_CHAT_TEMPLATE)"
            )
        try:  # the chat jobs' own rendering (special-token strings in content as the deployment says)
            messages, tools = self.prompts.conversation(request.messages or [], None)
            return self.prompts.chat_tokens(
                messages, generation_prompt=request.add_generation_prompt is not False, tools=tools
            )
        except JobFailure as exc:
            raise BadRequest(exc.message) from None
        except (jinja2.TemplateError, ValueError, TypeError) as exc:
            raise BadRequest(f"this model's chat template cannot render these messages: {exc}") from None

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        size = len(self.tokenizer)
        bad = [(i, t) for i, t in enumerate(request.tokens) if t >= size]
        if bad:
            where, token = bad[0]
            more = f" ({len(bad)} ids in all)" if len(bad) > 1 else ""
            raise BadRequest(
                f"tokens[{where}] = {token} is not in the vocabulary of {self.model!r} (ids 0 to {size - 1}){more}"
            )
        return DetokenizeResponse(prompt=str(self.tokenizer.decode(request.tokens)))

    def info(self) -> TokenizerInfo:
        tok = self.tokenizer
        template = getattr(tok, "chat_template", None)
        if isinstance(template, dict):  # named templates: the default one
            template = template.get("default")
        length = getattr(tok, "model_max_length", None)
        return TokenizerInfo(
            model=self.model,
            tokenizer_class=type(tok).__name__,
            vocab_size=len(tok),
            max_model_len=self.max_model_len,
            model_max_length=length if isinstance(length, int) and length < 2**63 else None,  # 1e30: none stated
            bos_token=_text(tok.bos_token),
            eos_token=_text(tok.eos_token),
            pad_token=_text(tok.pad_token),
            unk_token=_text(tok.unk_token),
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            unk_token_id=tok.unk_token_id,
            clean_up_tokenization_spaces=bool(getattr(tok, "clean_up_tokenization_spaces", False)),
            chat_template=template if isinstance(template, str) else None,
            added_tokens_decoder={str(i): t.content for i, t in tok.added_tokens_decoder.items() if t.special},
        )


def _text(token: object) -> str | None:
    """A special token as its string (the tokenizer may hold an AddedToken)."""
    return None if token is None else str(getattr(token, "content", token))
