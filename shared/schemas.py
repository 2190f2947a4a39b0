"""Request and response shapes shared by the API and the worker (pydantic, JSON only)."""

from __future__ import annotations

import math
from datetime import datetime
from functools import cached_property
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.dtypes import CaptureDtype
from shared.states import JobStatus as JobStatus  # re-exported: the states live in shared.states

Positions = Literal["all", "prompt", "generated", "last"]
Hook = Literal["output", "input"]

MAX_CAPTURE_PATTERNS = 256
MAX_MESSAGES = 512
MAX_MESSAGE_CHARS = 1_000_000
MAX_PROMPT_CHARS = 1_000_000
MAX_STOP_STRINGS = 8
GREEDY_BELOW = 1e-5  # temperatures below this decode greedily (as vLLM does)


class Strict(BaseModel):
    """Unknown fields are an error: a typo must not be silently ignored."""

    model_config = ConfigDict(extra="forbid")


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant"]
    content: Annotated[str, Field(max_length=MAX_MESSAGE_CHARS)]


class CaptureSpec(Strict):
    """Which activations to keep: module path patterns, a preset, or both (README "Capture")."""

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

    @model_validator(mode="after")
    def _names_something(self) -> CaptureSpec:
        if not self.modules and self.preset is None:
            raise ValueError('name what to capture: `modules` (path patterns) or a `preset` (e.g. "residual")')
        if self.layers is not None and self.preset is None:
            raise ValueError("`layers` picks the blocks of a `preset`; give a preset, or use index sets in `modules`")
        return self


class JobRequest(Strict):
    """`POST /jobs`: an OpenAI-style chat request (`messages`, rendered with the model's chat
    template) or a raw text `prompt` (tokenized as it is, for base models), plus an optional
    capture spec."""

    model: Annotated[str, Field(min_length=1, max_length=200)]
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    prompt: Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 0.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    stop: Annotated[list[Annotated[str, Field(min_length=1, max_length=200)]], Field(max_length=MAX_STOP_STRINGS)] = []
    capture: CaptureSpec | None = None
    time_limit: Annotated[float, Field(gt=0, le=7 * 24 * 3600)] | None = (
        None  # seconds; at most ACTQ_JOB_SOFT_TIME_LIMIT
    )

    @model_validator(mode="after")
    def _one_prompt(self) -> JobRequest:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError(
                "give exactly one of `messages` (a chat, rendered with the model's chat template) "
                "or `prompt` (raw text, tokenized as it is, no template)"
            )
        return self

    @property
    def content_bytes(self) -> int:
        """UTF-8 bytes of the text the user wrote: the prompt, or every message's content."""
        if self.prompt is not None:
            return len(self.prompt.encode())
        return sum(len(m.content.encode()) for m in self.messages or [])

    @property
    def samples(self) -> bool:
        """Whether the job samples; a temperature below GREEDY_BELOW is greedy decoding (dividing
        logits by 1e-300 overflows to inf and NaN: such a job used to fail as internal_error)."""
        return self.temperature >= GREEDY_BELOW

    @field_validator("temperature", "top_p")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value  # OpenAI allows a single string


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


class JobResult(Strict):
    text: str
    finish_reason: Literal["stop", "length", "cancelled", "timeout"]
    usage: Usage


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


class ActivationsManifest(Strict):
    uri: str
    key: str
    sha256: str
    bytes: int
    tensors: list[TensorInfo]
    download_url: str | None = None  # filled in by the API when it renders a job


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
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    attempts: int = 0
    worker: str | None = None
    result: JobResult | None = None
    activations: ActivationsManifest | None = None
    error: JobError | None = None


class JobView(Strict):
    """`GET /jobs/{id}`. `queue_position` (1 = next) while queued, `generated_tokens` while running."""

    id: str
    status: JobStatus
    model: str
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    attempts: int
    result: JobResult | None
    activations: ActivationsManifest | None
    error: JobError | None
    queue_position: int | None = None
    generated_tokens: int | None = None


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
    # Whether the model has a chat template (takes `messages`); without one, only `prompt`.
    chat_template: bool = True
    # Named module sets, one path per decoder block (worker/presets.py): residual, attention, mlp.
    presets: dict[str, list[str]] = {}

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
    presets: dict[str, list[str]]  # preset -> one module path per decoder block
    modules: list[str]  # forward-execution order
    not_capturable: dict[str, str]  # modules the forward pass runs that cannot be captured, and why
