"""`POST /jobs`'s body (`JobRequest`): every field of a job, the checks between them, and what the
API and the worker read from it (its prompt, sampling, tools, rendering, trace)."""

from __future__ import annotations

import json
import math
from typing import Annotated, Any

from pydantic import Field, StrictBool, ValidationInfo, field_validator, model_validator

from shared.interventions import MAX_INTERVENTIONS, Intervention
from shared.schemas.base import Mode, Strict
from shared.schemas.request_limits import (
    GREEDY_BELOW,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKEN_IDS,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    MAX_USER_CHARS,
    check_metadata,
    check_template_kwargs,
)
from shared.schemas.request_parts import CaptureSpec, ChatMessage, NnsightCall
from shared.structured_outputs import StructuredOutputs
from shared.tools import MAX_TOOLS, ResponseFormat, Tool, ToolChoice, check_tools


class JobRequest(Strict):
    """`POST /jobs`: an OpenAI-style chat request (`messages`, rendered with the model's chat
    template) or a raw text `prompt` (tokenized as it is, for base models), plus an optional
    capture spec. `mode: "trace"` generates nothing: one forward pass over the given text
    (messages may end with the assistant turn to score), for its activations and log-probabilities."""

    model: Annotated[str, Field(min_length=1, max_length=200)]
    mode: Mode = "generate"
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    prompt: Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)] | None = None
    # The prompt as token ids, fed as given (no BOS added): what a client that tokenized the text
    # itself means (lm-eval's tokenized requests); checked against the model's vocabulary.
    prompt_token_ids: (
        Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS)] | None
    ) = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 0.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    # The rest of the sampler, each a per-row tensor of the decoding step (worker/model/sampling.py), in
    # the order transformers' generate applies its processors: `logit_bias` (token id -> -100 to
    # 100, added to its logit), `repetition_penalty` (transformers', over prompt and reply),
    # `presence_penalty` / `frequency_penalty` (OpenAI's, -2 to 2, over the reply), `min_tokens`
    # (EOS held off until this many tokens), then `top_k` (0 or -1: off) and `min_p` (0: off).
    top_k: Annotated[int, Field(ge=-1, le=1_000_000)] = 0
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    min_tokens: Annotated[int, Field(ge=0)] = 0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    logit_bias: (
        Annotated[dict[int, Annotated[float, Field(ge=-100.0, le=100.0)]], Field(max_length=MAX_LOGIT_BIAS)] | None
    ) = None
    stop: Annotated[list[Annotated[str, Field(min_length=1, max_length=200)]], Field(max_length=MAX_STOP_STRINGS)] = []
    capture: CaptureSpec | None = None
    time_limit: Annotated[float, Field(gt=0, le=7 * 24 * 3600)] | None = (
        None  # seconds; at most ACTQ_JOB_SOFT_TIME_LIMIT
    )
    # Log-probabilities of each generated token (trace: of each given token), and the `top_logprobs`
    # most likely alternatives at each position (0 to 20; needs logprobs).
    logprobs: StrictBool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # A generation's logprobs also cover its prompt, before the generated tokens (the prompt's
    # first token has none): OpenAI's legacy `echo` with generation, from the same prefill.
    prompt_logprobs: StrictBool = False
    # Edits applied during the job's forward passes (docs/interventions.md), in this order on a
    # module that several name; `baseline: true` also runs the job unedited, in the same batch.
    interventions: Annotated[list[Intervention], Field(max_length=MAX_INTERVENTIONS)] | None = None
    baseline: StrictBool = False
    # The worker also publishes the text as it is generated (keys.job_text): what the OpenAI
    # routes' `stream: true` reads; the result is the same either way.
    stream: StrictBool = False
    # OpenAI's `metadata` (string pairs) and `user`: stored with the job for the caller's own
    # bookkeeping (GET /jobs shows them and filters on them); they change nothing that runs.
    metadata: dict[str, str] | None = None
    user: Annotated[str, Field(max_length=MAX_USER_CHARS)] | None = None
    # Functions the model may call (rendered by its chat template; calls parsed from the reply
    # into result.tool_calls), which it must call (`tool_choice` "required" or a named function:
    # constrained decoding), and `response_format` json_object/json_schema (constrained too).
    tools: Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    # false: a forced reply ("required") is one call, not one or more
    parallel_tool_calls: StrictBool = True
    response_format: ResponseFormat | None = None
    # vLLM's `structured_outputs`: the reply follows one of a JSON Schema, any JSON object, a
    # regex, a choice of strings or a Lark grammar (shared/structured_outputs.py; constrained)
    structured_outputs: StructuredOutputs | None = None
    # How a chat is rendered (vLLM's chat extras): `add_generation_prompt` false leaves the
    # assistant's turn unopened; `continue_final_message` continues the final message, whatever
    # its role, as transformers does (an assistant prefill: the reply goes on from its text, in
    # its turn); `chat_template_kwargs` are
    # variables the chat template reads (`enable_thinking` for reasoning models). None: default.
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # mode "nnsight" only: the trusted code it runs, sent by nnsight's client to POST /request
    nnsight: NnsightCall | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> JobRequest:
        if (self.mode == "nnsight") != (self.nnsight is not None):
            raise ValueError(
                "mode 'nnsight' jobs are sent by nnsight's own client (`remote=True`) to POST /request, which fills "
                "`nnsight`; other modes leave it out"
            )
        if self.mode == "nnsight":
            return self
        if sum(x is not None for x in (self.messages, self.prompt, self.prompt_token_ids)) != 1:
            raise ValueError(
                "give exactly one of `messages` (a chat, rendered with the model's chat template), "
                "`prompt` (raw text, tokenized as it is, no template) or `prompt_token_ids` (the tokens themselves)"
            )
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.prompt_logprobs and not self.logprobs:
            raise ValueError("prompt_logprobs needs logprobs: true")
        if self.prompt_logprobs and self.trace:
            raise ValueError("a trace job's logprobs already cover its whole text: leave prompt_logprobs out")
        if self.baseline and not self.interventions:
            raise ValueError("baseline: true runs the job unedited beside its edited run: give `interventions`")
        self._check_tools()
        self._check_rendering()
        positions = self.capture.positions if self.capture is not None else None
        if self.mode == "trace":
            self._check_trace(positions)
        elif positions == "completion":
            raise ValueError(
                "positions 'completion' selects the final assistant turn of a trace job (mode: trace); "
                "a generation job's new tokens are positions 'generated'"
            )
        return self

    def _check_tools(self) -> None:
        if (self.tools or self.messages_have_tools) and self.messages is None:
            raise ValueError(
                "tools and tool turns belong to a chat (`messages`): a raw prompt has no template to render them"
            )
        shaped = self.response_format is not None and self.response_format.type != "text"
        constrained = self.forced_tools is not None or shaped or self.structured_outputs is not None
        if constrained and self.trace:
            raise ValueError(
                "a trace job generates nothing, so tool_choice 'required' or a named function, response_format "
                "json_object or json_schema, and structured_outputs cannot apply; leave them out (or use mode: "
                "generate)"
            )
        if shaped and self.structured_outputs is not None:
            raise ValueError(
                "response_format and structured_outputs each constrain the reply: give one of them (a JSON Schema "
                "goes in either)"
            )
        if self.forced_tools is not None and (shaped or self.structured_outputs is not None):
            given = "response_format" if shaped else "structured_outputs"
            raise ValueError(f"tool_choice forces a tool call and {given} constrains the reply: give one of them")

    def _check_rendering(self) -> None:
        given = [
            name
            for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
            if getattr(self, name) is not None
        ]
        if not given:
            return
        if self.messages is None:
            raise ValueError(f"{', '.join(given)}: how a chat is rendered; a raw prompt has no template, leave it out")
        if self.trace:
            raise ValueError(
                f"{', '.join(given)}: a trace job renders its conversation whole (docs/jobs-api.md, Trace jobs); "
                "leave it out"
            )
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise ValueError(
                    "continue_final_message continues the final message in its own turn, and "
                    "add_generation_prompt opens a new one: send add_generation_prompt false (or leave it out)"
                )
            if not self.messages[-1].content:
                raise ValueError(
                    "continue_final_message continues the final message's text, and the last message has none: "
                    "end with a message whose content the reply goes on from"
                )
        if self.chat_template_kwargs is not None:
            check_template_kwargs(self.chat_template_kwargs)

    @property
    def generation_prompt(self) -> bool:
        """Whether a chat's rendering opens the assistant's turn (not when it continues the last)."""
        return self.add_generation_prompt is not False and not self.continue_final_message

    @property
    def template_options(self) -> dict[str, Any]:
        """apply_chat_template's keyword arguments beside the messages, tools and generation prompt."""
        options = dict(self.chat_template_kwargs or {})
        if self.continue_final_message:
            options["continue_final_message"] = True
        return options

    @field_validator("messages")
    @classmethod
    def _tool_turns(cls, messages: list[ChatMessage] | None) -> list[ChatMessage] | None:
        """Each tool message answers a call made earlier in the conversation, and only once."""
        open_calls: set[str] = set()  # calls made and not yet answered
        made: set[str] = set()
        for i, message in enumerate(messages or []):
            for call in message.tool_calls or []:
                if call.id in made:
                    raise ValueError(
                        f"messages[{i}]: tool call id {call.id!r} is used twice; give each call its own id"
                    )
                made.add(call.id)
                open_calls.add(call.id)
            if message.role == "tool":
                if message.tool_call_id not in open_calls:
                    raise ValueError(
                        f"messages[{i}] answers tool call {message.tool_call_id!r}, which no earlier assistant "
                        "message made (or which is already answered): a tool message follows the assistant message "
                        "whose tool_calls include its tool_call_id"
                    )
                open_calls.discard(message.tool_call_id)
        return messages

    @field_validator("tools")
    @classmethod
    def _unique_tools(cls, tools: list[Tool] | None) -> list[Tool] | None:
        check_tools(tools, None)
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, choice: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        if "tools" in info.data:  # else tools failed validation: that error is the one to show
            check_tools(info.data["tools"], choice)
        return choice

    @property
    def messages_have_tools(self) -> bool:
        return any(m.tool_calls or m.role == "tool" for m in self.messages or [])

    @property
    def forced_tools(self) -> list[Tool] | None:
        """The tools one of which the reply must call (constrained decoding), or None."""
        from shared.tools import forced_calls

        return forced_calls(self.tool_choice, self.tools)

    @property
    def several_calls(self) -> bool:
        """Whether a forced reply may hold more than one call: tool_choice "required" with
        parallel_tool_calls (a named function is called once)."""
        return self.tool_choice == "required" and self.parallel_tool_calls

    @property
    def output_schema(self) -> dict | None:
        """The JSON Schema the reply must satisfy (response_format json_object/json_schema, or
        structured_outputs json/json_object), or None."""
        if self.structured_outputs is not None:
            return self.structured_outputs.json_schema()
        return self.response_format.json_schema_of() if self.response_format is not None else None

    def schemas(self) -> list[tuple[str, dict[str, Any]]]:
        """(field, schema) for every JSON Schema the request carries, as a 4xx would name it: each
        tool's `parameters`, the `response_format` schema and `structured_outputs.json`
        (shared/schema_checks.py checks them)."""
        found = [
            (f"tools[{i}].function.parameters", tool.function.parameters)
            for i, tool in enumerate(self.tools or [])
            if tool.function.parameters is not None
        ]
        if self.response_format is not None and self.response_format.json_schema is not None:
            found.append(("response_format.json_schema.schema", self.response_format.json_schema.schema_))
        if self.structured_outputs is not None and self.structured_outputs.json_ is not None:
            found.append(("structured_outputs.json", self.structured_outputs.json_))
        return found

    @property
    def parses_tool_calls(self) -> bool:
        """Whether the worker reads tool calls from the reply: tools given and tool_choice not 'none'."""
        return bool(self.tools) and self.tool_choice != "none"

    def _check_trace(self, positions: str | None) -> None:
        given = self.model_fields_set
        sampling: list[str] = [f for f in ("max_tokens", "seed") if f in given and getattr(self, f) is not None]
        sampling += ["temperature"] if self.temperature != 0 else []
        sampling += ["top_p"] if self.top_p != 1 else []
        sampling += ["stop"] if self.stop else []
        if sampling:
            raise ValueError(
                f"a trace job generates nothing, so {', '.join(sampling)} cannot apply; leave "
                f"{'it' if len(sampling) == 1 else 'them'} out (or use mode: generate)"
            )
        if positions == "generated":
            raise ValueError(
                "a trace job generates nothing: positions 'generated' selects no token; use 'all', 'prompt', "
                "'last', or 'completion' (the final assistant turn)"
            )
        if positions == "completion" and not (self.messages and self.messages[-1].role == "assistant"):
            raise ValueError(
                "positions 'completion' selects the final assistant turn, and these "
                + ("messages do not end with one" if self.messages else "are raw `prompt` text with no turns")
                + ": end the messages with the assistant turn to score, or use positions 'all' or 'last'"
            )

    @property
    def trace(self) -> bool:
        return self.mode == "trace"

    @property
    def alternatives(self) -> int:
        """Alternatives per position in the log-probabilities (0 when none were asked for)."""
        return self.top_logprobs or 0

    @property
    def content_bytes(self) -> int:
        """UTF-8 bytes of the text the user wrote: the prompt, or every message's content."""
        if self.prompt is not None:
            return len(self.prompt.encode())
        if self.prompt_token_ids is not None:
            return 0  # no text: shared/capture_spec counts the ids themselves
        text = sum(len(m.text.encode()) for m in self.messages or [])
        calls = sum(
            len(c.function.arguments.encode()) + len(c.function.name)
            for m in self.messages or []
            for c in m.tool_calls or []
        )
        tools = len(json.dumps([t.rendered() for t in self.tools]).encode()) if self.tools else 0
        return text + calls + tools

    @property
    def samples(self) -> bool:
        """Whether the job samples; a temperature below GREEDY_BELOW is greedy decoding (dividing
        logits by 1e-300 overflows to inf and NaN: such a job used to fail as internal_error)."""
        return self.temperature >= GREEDY_BELOW

    @field_validator("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value  # OpenAI allows a single string

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return None if value is None else check_metadata(value)
