"""Request and response shapes shared by the API and the worker (pydantic, JSON only)."""

from __future__ import annotations

import json
import math
import re
from datetime import datetime
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from shared.dtypes import CaptureDtype
from shared.interventions import (
    MAX_INTERVENTIONS,
    EditPoint,
    EditReport,
    Hook,
    Intervention,
    check_features,
    feature_indices,
)
from shared.states import JobStatus as JobStatus
from shared.structured_outputs import StructuredOutputs
from shared.tools import (
    CALL_ID_PATTERN,
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    ResponseFormat,
    Tool,
    ToolCall,
    ToolChoice,
    ToolFormat,
    check_tools,
)  # re-exported: the states live in shared.states

Positions = Literal["all", "prompt", "generated", "last", "completion"]
Reduce = Literal["none", "mean", "sum", "max", "last"]
Mode = Literal["generate", "trace", "nnsight"]
FinishReason = Literal["stop", "length", "tool_calls", "cancelled", "timeout"]

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


class Strict(BaseModel):
    """Unknown fields are an error: a typo must not be silently ignored."""

    model_config = ConfigDict(extra="forbid")


class ChatMessage(Strict):
    """One turn. `content` is required but for an assistant turn that makes `tool_calls`; a
    `tool` turn answers one of those calls (`tool_call_id`) with its result as content."""

    role: Literal["system", "user", "assistant", "tool"]
    content: Annotated[str, Field(max_length=MAX_MESSAGE_CHARS)] | None = None
    tool_calls: Annotated[list[ToolCall], Field(min_length=1, max_length=MAX_TOOL_CALLS)] | None = None
    tool_call_id: Annotated[str, Field(pattern=CALL_ID_PATTERN)] | None = None

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to an assistant message, not a {self.role} one")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError(
                "a tool message needs `tool_call_id` (the id of the call it answers)"
                if self.role == "tool"
                else f"tool_call_id belongs to a tool message, not a {self.role} one"
            )
        if self.content is None and self.tool_calls is None:
            raise ValueError(f"a {self.role} message needs `content` (a string)")
        return self

    @property
    def text(self) -> str:
        return self.content or ""

    @model_serializer(mode="wrap")
    def _without_unset_tool_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A plain turn stays `{"role", "content"}` in stored requests and answers."""
        out: dict[str, Any] = handler(self)
        for key in ("tool_calls", "tool_call_id"):
            if out.get(key) is None:
                out.pop(key, None)
        return out


class CaptureSpec(Strict):
    """Which activations to keep: module path patterns, a preset, or both (docs/capture.md)."""

    modules: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=MAX_CAPTURE_PATTERNS)
    ] = []
    # A named module set the model publishes (GET /models: residual, attention, mlp), one module
    # per decoder block; `layers` picks blocks by index (negative counts from the last), default all.
    preset: Annotated[str, Field(pattern=r"^[a-z][a-z_]{0,31}$")] | None = None
    layers: (
        Annotated[list[Annotated[int, Field(ge=-100_000, le=100_000)]], Field(min_length=1, max_length=4096)] | None
    ) = None
    hook: Hook = "output"
    positions: Positions = "all"
    dtype: CaptureDtype = "float32"
    # Server-side reduction over the selected positions: one row per capture point instead of one
    # per position ("none" keeps every row). `features` keeps part of the last dimension: a slice
    # "a:b" (a included, b excluded) or a list of indices, in the order given.
    reduce: Reduce = "none"
    features: (
        Annotated[str, Field(max_length=20)]
        | Annotated[list[Annotated[int, Field(ge=0, lt=10_000_000)]], Field(min_length=1, max_length=MAX_FEATURES)]
        | None
    ) = None

    @field_validator("features")
    @classmethod
    def _feature_syntax(cls, value: str | list[int] | None) -> str | list[int] | None:
        return check_features(value)

    def feature_indices(self, width: int) -> list[int] | None:
        """The kept indices of a `width`-wide value (None: all); raises ValueError when out of range."""
        return feature_indices(self.features, width)

    @model_validator(mode="after")
    def _names_something(self) -> CaptureSpec:
        if not self.modules and self.preset is None:
            raise ValueError('name what to capture: `modules` (path patterns) or a `preset` (e.g. "residual")')
        if self.layers is not None and self.preset is None:
            raise ValueError("`layers` picks the blocks of a `preset`; give a preset, or use index sets in `modules`")
        return self


class NnsightCall(Strict):
    """What an nnsight job runs: a payload that nnsight's 0.8 client built (a trace's code and the
    values it uses, serialized), stored as opaque bytes in the job's storage. The API never reads
    it; the worker loads and runs it (docs/nnsight.md)."""

    model_key: Annotated[str, Field(min_length=1, max_length=2000)]  # as the client sent it
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    bytes: Annotated[int, Field(ge=1)]
    compress: StrictBool = False  # the payload is zstd-compressed, and so is the result
    nnsight_version: Annotated[str, Field(max_length=100)]
    python_version: Annotated[str, Field(max_length=300)]
    session_id: Annotated[str, Field(max_length=100)] | None = None  # the WebSocket that hears its statuses
    caller: Annotated[str, Field(max_length=100)] | None = None  # the sending key's id


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
    # The rest of the sampler, each a per-row tensor of the decoding step (worker/sampling.py), in
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


MAX_BATCH = 5000


class BatchEntry(Strict):
    request: JobRequest
    idempotency_key: Annotated[str, Field(min_length=1, max_length=256)] | None = None


class BatchRequest(Strict):
    """`POST /jobs/batch`: many jobs, validated together; one bad entry rejects the batch."""

    jobs: Annotated[list[BatchEntry], Field(min_length=1, max_length=MAX_BATCH)]

    @field_validator("jobs", mode="before")
    @classmethod
    def _count_first(cls, value: object) -> object:
        # Count the entries before validating any: a 100,000-entry batch is refused in
        # microseconds instead of after 0.8 s of validation on the API's event loop.
        if isinstance(value, list) and len(value) > MAX_BATCH:
            raise ValueError(f"List should have at most {MAX_BATCH} items, not {len(value)}")
        return value


class BatchItem(Strict):
    id: str
    status: str
    created: bool  # False: an earlier request with the same Idempotency-Key created it


class BatchResponse(Strict):
    jobs: list[BatchItem]


class CapturePoint(Strict):
    """One resolved capture point: a module path in the model's list, and which side of it."""

    name: str  # tensor name in the file: the module path, or "<path>:input"
    module: str
    hook: Hook


class Usage(Strict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(Strict):
    token_id: int
    token: str  # the token decoded alone (a piece of a multi-byte character decodes to U+FFFD)
    logprob: float


class TokenLogprob(Strict):
    """A token of the text and its log-probability given the tokens before it (None for a trace's
    first token, which nothing predicts), with the most likely alternatives at its position."""

    token_id: int
    token: str
    logprob: float | None  # None only for a trace's first token
    top_logprobs: list[TopLogprob] = []
    rank: int | None = None  # how many tokens were at least as likely, itself included (1: the likeliest)


class Logprobs(Strict):
    """`content`: one entry per generated token (a trace: per token of the text), unless there are
    more than ACTQ_LOGPROBS_INLINE_TOKENS; then `content` is None and the values are tensors in the
    activations file (`in_file`: logprobs, top_logprobs, top_logprob_ids)."""

    content: list[TokenLogprob] | None
    in_file: bool = False
    total: float  # the sum of the log-probabilities over the entries (the text's log-likelihood)
    completion_total: float | None = None  # trace over a final assistant turn: the sum over that turn
    prompt_entries: int | None = None  # prompt_logprobs: the first this many entries are the prompt's


RESULT_TEXT_INLINE_CHARS = 4096  # a result stored apart keeps its text in the record up to this long
RESULT_PREVIEW_CHARS = 200  # and of a longer text, its first this many characters


class StoredResult(Strict):
    """Where the rest of a result is: one larger than ACTQ_RESULT_INLINE_BYTES is stored apart from
    the job's record (a Redis key with the record's TTL) and read by `GET /jobs/{id}/result`."""

    bytes: int  # the whole result's JSON
    text_truncated: bool  # the text was longer than RESULT_TEXT_INLINE_CHARS: `text` holds its first 200 characters
    url: str | None = None  # filled in by the API when it renders a job


class BaselineResult(Strict):
    """The same job run without its interventions, in the same batch (`baseline: true`)."""

    text: str
    finish_reason: FinishReason
    usage: Usage
    logprobs: Logprobs | None = None


class NnsightOutput(Strict):
    """An nnsight job's result: its saves, stored as its client loads them (`torch.save`, zstd
    when it asked), downloaded at GET /jobs/{id}/nnsight-result or by the link its client gets."""

    bytes: int
    sha256: str
    saved: list[str]  # the names the trace saved
    # The storage key of the saves (in the folder of the attempt that ran the job); None in records
    # written before attempts had folders of their own: `jobs/<id>/nnsight-result.pt`.
    key: str | None = None
    # Besides nnsight's own wrapping, what the code changed on the model and the worker put back
    # (a hook left registered, a module in train mode): `module: attributes`.
    restored: list[str] = []
    held_s: float = 0.0  # seconds the job had the model to itself (the running batch paused as long)
    # What the run used where the client's own settings do not travel or do not apply (one model
    # serves every job): dtype, attn_implementation, padding_side, random_state.
    served: dict[str, str] = {}


class JobResult(Strict):
    text: str  # the generated text as it is: with tool calls, the raw text they were read from (for audit)
    finish_reason: FinishReason
    usage: Usage
    # A job with `tools` (tool_choice not "none"): the calls read from the text, in OpenAI's shape
    # (finish_reason "tool_calls", also when max_tokens cut a later call), `content` the text
    # outside them (None when nothing is left), and `tool_call_problems` what looked like a call
    # but did not parse, was cut short, or repeated an earlier call (left out of content too).
    tool_calls: list[ToolCall] | None = None
    content: str | None = None
    tool_call_problems: list[str] | None = None
    logprobs: Logprobs | None = None
    # A trace over messages ending with an assistant turn: that turn's token_ids range
    # [start, stop) (positions "completion"; docs/jobs-api.md, "Trace jobs").
    completion_span: list[int] | None = None
    # Set when the result is stored apart: here `logprobs.content` is null (the totals stay) and
    # `text` may be cut (`stored.text_truncated`); GET /jobs/{id}/result answers the whole result.
    stored: StoredResult | None = None
    # Per edit and module, the positions it touched at each forward step (docs/interventions.md).
    interventions: list[EditReport] | None = None
    baseline: BaselineResult | None = None
    nnsight: NnsightOutput | None = None  # mode "nnsight"


class TensorInfo(Strict):
    name: str
    module: str
    hook: Hook
    shape: list[int]
    dtype: str
    positions: Positions
    start: int  # index into token_ids of the first row
    stop: int  # one past the last row's index into token_ids
    bytes: int
    reduce: Reduce = "none"  # not "none": one row, this reduction of rows [start, stop)
    features: list[int] | None = None  # the kept indices of the last dimension (None: all)
    baseline: bool = False  # captured by the unedited run of a `baseline: true` job (name "baseline/<point>")
    sha256: str | None = None  # of the tensor's bytes in the file (None: a file written before actq recorded it)


class ActivationsManifest(Strict):
    uri: str
    key: str
    sha256: str
    bytes: int
    tensors: list[TensorInfo]
    # Other tensors in the file besides token_ids (log-probabilities: logprobs, top_logprobs, ...).
    extra: list[str] = []
    # sha256 of the bytes of token_ids and of each `extra` tensor (the captures' are in `tensors`)
    extra_sha256: dict[str, str] = {}
    download_url: str | None = None  # filled in by the API when it renders a job

    def tensor_sha256(self, name: str) -> str | None:
        """The sha256 of one tensor's bytes as written, from the manifest; None when not recorded."""
        for info in self.tensors:
            if info.name == name:
                return info.sha256
        return self.extra_sha256.get(name)


class JobError(Strict):
    type: str
    message: str


class JobRecord(Strict):
    """What Redis keeps for a job. The task message carries only `id`."""

    id: str
    status: JobStatus
    model: str
    request: JobRequest
    owner: str | None = None  # id of the API key that made it (ACTQ_API_KEYS); others get 404
    idempotency: str | None = None  # the Redis key of its Idempotency-Key, removed with the job
    max_tokens: int  # resolved by the API (request or default), checked against the limits
    capture_points: list[CapturePoint] = []
    edit_points: list[EditPoint] = []  # the interventions at each module, resolved by the API
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    attempts: int = 0
    # deliveries that ended through no fault of the job (its engine was ended by another job's
    # trusted code, or replaced after it): not counted against ACTQ_MAX_ATTEMPTS
    forgiven_attempts: int = 0
    worker: str | None = None
    result: JobResult | None = None
    activations: ActivationsManifest | None = None
    error: JobError | None = None
    # The version of actq that last wrote the record (the job store stamps it on every write; None:
    # written before it did). An older version names it when it cannot read the record (rolling upgrades).
    written_by: str | None = None


class JobView(Strict):
    """`GET /jobs/{id}`. `queue_position` (1 = next) while queued, `generated_tokens` while running."""

    id: str
    status: JobStatus
    model: str
    mode: Mode = "generate"  # the request's: `generate`, `trace`, or `nnsight` (its saves in `result.nnsight`)
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    attempts: int
    # of `attempts`, those that ended through no fault of the job (another job's trusted code
    # ended the engine running it): not counted against ACTQ_MAX_ATTEMPTS
    forgiven_attempts: int = 0
    # the worker that claimed its last attempt: its Celery node name, as Flower and `celery inspect`
    # show it (None while queued)
    worker: str | None = None
    result: JobResult | None
    activations: ActivationsManifest | None
    error: JobError | None
    queue_position: int | None = None
    generated_tokens: int | None = None


class JobSummary(Strict):
    """`GET /jobs` entry: what a listing needs, never the result (read that with GET /jobs/{id})."""

    id: str
    status: JobStatus
    model: str
    mode: Mode
    created_at: datetime
    finished_at: datetime | None
    prompt_preview: str  # the first 200 characters of the prompt (a chat: of its last message)
    error_type: str | None  # a failed or cancelled job's `error.type`
    finish_reason: str | None  # a finished job's `result.finish_reason`
    activations: bool  # the job stored an activations file
    metadata: dict[str, str] | None = None  # the request's `metadata`
    user: str | None = None  # the request's `user`


def path_shape(segments: list[str] | tuple[str, ...]) -> str:
    """A module path with every index (or `*`) as `*`: `model.layers.3.mlp` -> `model.layers.*.mlp`."""
    return ".".join("*" if s == "*" or s.isdigit() else s for s in segments)


class ModuleInfo(Strict):
    """A capturable module, as the worker found it in a dry run."""

    path: str
    output_dim: int | None  # last dim of the output tensor, None when not capturable
    input_dim: int | None  # last dim of the first input tensor, None when not capturable
    all_positions: bool  # False when the module only sees the last position (lm_head in generate)

    def width(self, hook: str) -> int | None:
        """The last dimension captured on `hook` ("output" or "input"); None: not capturable."""
        return self.output_dim if hook == "output" else self.input_dim

    def hooks(self) -> dict[Hook, int]:
        """The hooks a capture of this module may name, with their widths (`width` is not None)."""
        found: dict[Hook, int] = {}
        for hook in ("output", "input"):
            width = self.width(hook)
            if width is not None:
                found[hook] = width
        return found


class ModelFingerprint(Strict):
    """Which weights a model folder holds (shared/model_identity.py): its config without the
    keys that only say where and by what it was saved, and every safetensors tensor's dtype, shape
    and bytes. Two folders with equal `config_sha256` and `weights_sha256` hold the same model,
    however their files are sharded."""

    config_sha256: str
    config: dict[str, Any]  # config.json as compared, to name the keys that differ
    weights_sha256: str  # over every tensor's name, dtype, shape and sha256, in name order
    tensors: dict[str, str]  # name -> "dtype shape sha256[:16]" (`F32 64x128 0123abcd...`): which ones differ
    bytes: int  # the tensors' bytes, all together


class ModelInfo(Strict):
    """What a worker publishes about its model; the API validates capture specs against it."""

    name: str
    source: str
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_context: int
    dtype: str
    device: str
    modules: list[ModuleInfo]  # forward-execution order
    not_capturable: dict[str, str] = {}  # other modules the forward pass runs: path -> why not
    # The chat template's own tokens, measured by the worker: around a one-message conversation
    # (a default system prompt included), and per further message. None: not measured.
    template_tokens: int | None = None
    template_tokens_per_message: int | None = None
    # The most UTF-8 bytes one token stands for: a prompt of B bytes is at least B / this many
    # tokens, so the API can refuse a prompt that cannot fit without a tokenizer. None: unknown.
    max_token_bytes: int | None = None
    # The worker memory a sequence needs beyond the weights, from the model's configuration: KV
    # cache per token, one layer's activations per prompt token (the prefill's peak), and, where
    # the attention implementation materialises the scores, bytes per (query, key) pair. None:
    # not published (the estimate then counts the capture only).
    kv_bytes_per_token: int | None = None
    activation_bytes_per_token: int | None = None
    attention_bytes_per_token_pair: int = 0
    # A text longer than this is fed in chunks of this many positions (ACTQ_PREFILL_CHUNK_TOKENS):
    # what one forward pass holds at once. None: in one pass (a worker running one job at a time).
    prefill_chunk_tokens: int | None = None
    # Whether the model has a chat template (takes `messages`); without one, only `prompt`.
    chat_template: bool = True
    # How the model writes tool calls (the format parsed and, under tool_choice, enforced), and
    # whether its chat template renders tools itself; False: actq's fallback prompt does
    # (worker/tool_prompt.py). None: no chat template, so no tools.
    tool_format: ToolFormat | None = None
    tool_template: bool = False
    # The tokenizer's special-token strings (`<|im_start|>`...), which the API refuses in tools and
    # tool calls: a template would render them as its own markup. Empty: the deployment allows
    # them (ACTQ_ALLOW_SPECIAL_TOKENS), or its workers predate this field.
    special_tokens: list[str] = []
    # Named module sets, one path per decoder block (worker/presets.py): residual, attention, mlp.
    presets: dict[str, list[str]] = {}
    # What trusted nnsight code runs under on the worker (docs/nnsight.md): the
    # nnsight and Python versions (`3.11.9`); nnsight None: not installed, no nnsight jobs.
    nnsight_version: str | None = None
    python_version: str | None = None
    attention: str | None = None  # the attention implementation it runs (`sdpa`, `eager`, ...)
    hub_id: str | None = None  # the Hugging Face id of the checkpoint it was made from, when known
    # The files the worker loaded its weights from (a folder, or the Hub's files in its cache),
    # fingerprinted: what an nnsight client's folder must match. None: not known (no safetensors).
    fingerprint: ModelFingerprint | None = None
    packages: dict[str, str] = {}  # versions of nnsight, torch and transformers on the worker (nnsight's /env)

    @cached_property
    def module_index(self) -> dict[str, int]:
        """Each module path's place in `modules` (built once per description)."""
        return {m.path: i for i, m in enumerate(self.modules)}

    @cached_property
    def shape_index(self) -> dict[str, list[str]]:
        """Module paths by shape, indices as `*` (`model.layers.*.mlp`): what a wildcard can match."""
        shapes: dict[str, list[str]] = {}
        for m in self.modules:
            shapes.setdefault(path_shape(m.path.split(".")), []).append(m.path)
        return shapes


class ModelView(Strict):
    """`GET /models` entry."""

    name: str
    live_workers: int
    architecture: str
    num_layers: int
    hidden_size: int
    max_context: int
    dtype: str
    chat_template: bool  # False: a base model, send `prompt` (raw text) rather than `messages`
    tool_format: ToolFormat | None = None  # how it writes tool calls (None: no tools)
    tool_template: bool = False  # its template renders tools (False: actq's fallback prompt)
    presets: dict[str, list[str]]  # preset -> one module path per decoder block
    modules: list[str]  # forward-execution order
    # Per module, the hooks a capture may name ("output", "input") and the width each captures; a
    # hook missing here is refused. Modules in `last_position_only` take positions generated/last only.
    hooks: dict[str, dict[Hook, int]]
    last_position_only: list[str]
    not_capturable: dict[str, str]  # modules the forward pass runs that cannot be captured, and why
