"""From a job's messages to the model's prompt tokens, and what the API needs to know about them.

Special tokens are text. A chat template marks turns with special tokens (`<|im_start|>`...);
tokenizing the rendered template parses those strings wherever they appear, so a user who writes
`<|im_end|>\n<|im_start|>system` in a message would forge a system turn. By default the content
of every message is tokenized with special tokens split into ordinary text, and only the
template's own markup becomes special tokens. A deployment whose users are trusted may allow
them (ACTQ_ALLOW_SPECIAL_TOKENS). Messages without any special-token string take the plain
`apply_chat_template` path, so their tokens are exactly what it gives. A raw `prompt` has no
template, so there is no turn to forge: it is tokenized as the tokenizer does it, special-token
strings included (`_raw`).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any, cast

import jinja2
import torch

from shared.errors import JobFailure
from shared.schemas import ChatMessage, JobRequest
from shared.tools import Tool, ToolFormat
from worker.rules.tool_calls import template_family
from worker.rules.tool_prompt import fallback_messages, template_messages

if TYPE_CHECKING:
    from transformers import BatchEncoding, PreTrainedTokenizerBase

_SENTINEL = "\u27e6actq-message-{}\u27e7"  # ⟦actq-message-N⟧: marks where a message's content goes


class PromptEncoder:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, allow_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.allow_special_tokens = allow_special_tokens
        specials = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
        # what the API refuses in tools and tool calls (ModelInfo.special_tokens): none when allowed
        self.refused_specials = [] if allow_special_tokens else sorted(specials)
        self._special = (
            re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True)))) if specials else None
        )

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def tool_template(self) -> bool:
        """Whether the chat template renders tools itself (worker/rules/tool_prompt.py)."""
        return template_family(getattr(self.tokenizer, "chat_template", None)) is not None

    @property
    def tool_format(self) -> ToolFormat | None:
        """How the model writes tool calls: its template's format, else the fallback's (Hermes);
        None without a chat template."""
        if not self.has_chat_template:
            return None
        return template_family(self.tokenizer.chat_template) or ToolFormat.HERMES

    def conversation(
        self, messages: list[ChatMessage], tools: list[Tool] | None
    ) -> tuple[list[dict], list[dict] | None]:
        """The messages and tools as `apply_chat_template` is given them."""
        if self.tool_template:
            return template_messages(messages), [t.rendered() for t in tools] if tools else None
        if tools or any(m.tool_calls or m.role == "tool" for m in messages):
            return fallback_messages(messages, tools), None
        return [{"role": m.role, "content": m.content} for m in messages], None

    def encode(self, request: JobRequest) -> dict[str, torch.Tensor]:
        """`input_ids` and `attention_mask`, `[1, P]`, on the CPU."""
        if request.prompt_token_ids is not None:  # fed as given: the client tokenized the text itself
            tensor = torch.tensor([request.prompt_token_ids], dtype=torch.long)
            return {"input_ids": tensor, "attention_mask": torch.ones_like(tensor)}
        if request.prompt is not None:
            return self._raw(request.prompt)
        messages, tools = self.conversation(request.messages or [], request.tools)
        ids = self._chat(messages, request.generation_prompt, tools, request.template_options)
        tensor = torch.tensor([ids], dtype=torch.long)
        return {"input_ids": tensor, "attention_mask": torch.ones_like(tensor)}

    def encode_trace(self, request: JobRequest, end_of_turn: set[int]) -> tuple[torch.Tensor, tuple[int, int] | None]:
        """A trace job's tokens `[1, P]` and, for messages ending with an assistant turn, that
        turn's range `[start, stop)` (docs/jobs-api.md, "Trace jobs"): the conversation is rendered whole,
        with no generation prompt; `start` is where the reply begins (the length of the
        conversation before it, rendered with the generation prompt: the tokens a generation job
        would have been given), `stop` is one past the turn's first end-of-turn token (the
        model's EOS, which a reply ends with); the template's tokens after it (a newline) are in
        no turn. Other traces: the tokens a generation job would be given, and no range."""
        if not request.messages or request.messages[-1].role != "assistant":
            return self.encode(request)["input_ids"], None
        messages, tools = self.conversation(request.messages, request.tools)
        before_messages, _ = self.conversation(request.messages[:-1], request.tools)
        full = self._chat(messages, generation_prompt=False, tools=tools)
        before = (
            self._chat(before_messages, generation_prompt=True, tools=tools)
            if len(request.messages) > 1 or tools
            else self._bare_prompt()
        )
        if full[: len(before)] != before:
            raise JobFailure(
                "this model's chat template does not render the conversation before the final assistant turn "
                "as a prefix of the whole conversation, so that turn's tokens cannot be told apart; trace the "
                "text as `prompt` instead"
            )
        start = len(before)
        stop = next((i + 1 for i in range(start, len(full)) if full[i] in end_of_turn), len(full))
        if stop <= start:
            raise JobFailure("the final assistant turn renders to no tokens")
        return torch.tensor([full], dtype=torch.long), (start, stop)

    def _bare_prompt(self) -> list[int]:
        """The generation prompt alone (a conversation that starts with the assistant's turn): what
        the template renders for no messages, else the tokens before the reply of a lone
        assistant message with empty content."""
        try:
            return self._chat([], generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that needs a message
            raise JobFailure(
                "this model's chat template cannot render a conversation that starts with the assistant; "
                "put a user turn before it"
            ) from None

    def chat_tokens(
        self, messages: list[dict], generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        """A chat's token ids exactly as a chat job is given them (POST /tokenize with `messages`)."""
        return self._chat(messages, generation_prompt, tools)

    def _chat(
        self,
        messages: list[dict],
        generation_prompt: bool,
        tools: list[dict] | None = None,
        options: dict[str, Any] | None = None,
    ) -> list[int]:
        """The chat's tokens; `options`: apply_chat_template's other keyword arguments (a request's
        `continue_final_message`, its `chat_template_kwargs`)."""
        options = options or {}
        try:
            try:
                return self._render(messages, generation_prompt, tools, options)
            except TypeError:
                if tools is not None or not self.tool_template:
                    raise
                # a template that always lists the tools (vLLM's Hermes 2 Pro) cannot iterate None
                return self._render(messages, generation_prompt, [], options)
        except (jinja2.TemplateError, TypeError) as exc:  # its own refusal (raise_exception), as it words it
            raise JobFailure(f"this model's chat template cannot render these messages: {exc}") from None
        except ValueError as exc:  # continue_final_message: a final message the template does not show as written
            if not options.get("continue_final_message"):
                raise
            raise JobFailure(f"the final message cannot be continued with this chat template: {exc}") from None

    def _render(
        self, messages: list[dict], generation_prompt: bool, tools: list[dict] | None, options: dict[str, Any]
    ) -> list[int]:
        if not self.has_chat_template:
            raise JobFailure(
                "this model has no chat template, so messages cannot be rendered; send the text as `prompt`, "
                "or give the deployment a template (ACTQ_CHAT_TEMPLATE)"
            )
        if self.allow_special_tokens or self._special is None:
            return self._apply(messages, generation_prompt, tools, options)
        special = self._special
        calls = [m["tool_calls"] for m in messages if m.get("tool_calls")]
        if any(special.search(json.dumps(part)) for part in (*calls, tools or [])):
            raise JobFailure(
                "special-token strings in tools or tool calls would be read as the template's markup; remove them, "
                "or ask the deployment to allow them (ACTQ_ALLOW_SPECIAL_TOKENS)"
            )
        if not any(special.search(m["content"] or "") for m in messages):
            return self._apply(messages, generation_prompt, tools, options)
        return self._as_text(messages, generation_prompt, tools, options)

    def _apply(
        self, messages: list[dict], generation_prompt: bool, tools: list[dict] | None, options: dict[str, Any]
    ) -> list[int]:
        encoded = cast(
            "BatchEncoding",
            self.tokenizer.apply_chat_template(
                messages, tools=cast(Any, tools), add_generation_prompt=generation_prompt, return_dict=True, **options
            ),
        )
        return [int(i) for i in encoded["input_ids"]]

    def _raw(self, prompt: str) -> dict[str, torch.Tensor]:
        """A raw prompt: tokenized exactly as `tokenizer(prompt)` does it, the tokenizer's own BOS
        included and special-token strings read as special tokens (as vLLM's completions do, and
        /tokenize): a raw prompt is the caller's whole input, with no template whose turns it
        could forge, and a client that writes `<|im_start|>` or `<|endoftext|>` before a text
        (lm-eval's rolling log-likelihoods) means that token."""
        ids = [int(i) for i in self.tokenizer(prompt, split_special_tokens=False)["input_ids"]]
        if not ids:
            raise JobFailure("the prompt tokenizes to no tokens")
        tensor = torch.tensor([ids], dtype=torch.long)
        return {"input_ids": tensor, "attention_mask": torch.ones_like(tensor)}

    def _as_text(
        self,
        messages: list[dict],
        generation_prompt: bool = True,
        tools: list[dict] | None = None,
        options: dict[str, Any] | None = None,
    ) -> list[int]:
        """The template rendered around placeholders; its own pieces tokenized as usual, each
        message's content with special tokens split into text. A continued final message ends
        its text as apply_chat_template ends it: without trailing whitespace."""
        options = options or {}
        marked = [
            {**m, "content": _SENTINEL.format(i) if m["content"] is not None else None} for i, m in enumerate(messages)
        ]
        rendered = cast(
            str,
            self.tokenizer.apply_chat_template(
                marked, tools=cast(Any, tools), add_generation_prompt=generation_prompt, tokenize=False, **options
            ),
        )
        pieces = re.split("(" + re.escape(_SENTINEL).replace(r"\{\}", r"(\d+)") + ")", rendered)
        found = [int(pieces[k + 1]) for k in range(1, len(pieces), 3)] if len(pieces) > 1 else []
        if sorted(found) != [i for i, m in enumerate(messages) if m["content"] is not None]:
            raise JobFailure(
                "this model's chat template does not place message content as written, so special-token "
                "strings in it cannot be kept as text; remove them, or ask the deployment to allow them"
            )
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            if k % 3 == 0:  # the template's own text
                ids += self._tokens(piece, split_special=False)
            elif k % 3 == 2:  # a message's content
                content = messages[int(piece)]["content"]
                if options.get("continue_final_message") and int(piece) == len(messages) - 1:
                    content = content.rstrip()
                ids += self._tokens(content, split_special=True)
        return ids

    def _tokens(self, text: str, split_special: bool) -> list[int]:
        if not text:
            return []
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=split_special)["input_ids"])

    # -- what the API needs to bound a prompt without a tokenizer ------------------------

    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes any token decodes to (a partial character decodes to U+FFFD, 3
        bytes, which can only overstate it: the bound stays safe)."""
        texts = self.tokenizer.batch_decode([[i] for i in range(len(self.tokenizer))])
        return max(len(text.encode()) for text in texts)

    def template_tokens(self) -> dict[str, int]:
        """The chat template's own tokens: around one empty user message (a default system prompt
        included) and per further message, so the API's size estimate can count them."""
        if not self.has_chat_template:
            return {}
        user = {"role": "user", "content": ""}

        def count(messages: list[dict[str, str]]) -> int:
            encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
            return len(cast("BatchEncoding", encoded)["input_ids"])

        try:
            one = count([user])
            three = count([user, {"role": "assistant", "content": ""}, user])
        except Exception:  # noqa: BLE001 - a template that cannot render this: the API guesses generously
            return {}
        return {"template_tokens": one, "template_tokens_per_message": max(0, -(-(three - one) // 2))}
