"""What a worker publishes about its model (`ModelInfo`: modules, presets, tokenizer facts,
memory figures, the weights' fingerprint) and what `GET /models` shows of it (`ModelView`)."""

from __future__ import annotations

from functools import cached_property
from typing import Any

from shared.interventions import Hook
from shared.schemas.base import Strict
from shared.tools import ToolFormat


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
    # what one forward pass holds at once. None: in one pass (a worker running one job at a time, or
    # a recurrent or hybrid model's in state slots: their prompts run whole).
    prefill_chunk_tokens: int | None = None
    # Whether the model has a chat template (takes `messages`); without one, only `prompt`.
    chat_template: bool = True
    # How the model writes tool calls (the format parsed and, under tool_choice, enforced), and
    # whether its chat template renders tools itself; False: actq's fallback prompt does
    # (worker/rules/tool_prompt.py). None: no chat template, so no tools.
    tool_format: ToolFormat | None = None
    tool_template: bool = False
    # The tokenizer's special-token strings (`<|im_start|>`...), which the API refuses in tools and
    # tool calls: a template would render them as its own markup. Empty: the deployment allows
    # them (ACTQ_ALLOW_SPECIAL_TOKENS), or its workers predate this field.
    special_tokens: list[str] = []
    # Named module sets, one path per decoder block (worker/model/presets.py): residual, attention, mlp.
    presets: dict[str, list[str]] = {}
    # What trusted nnsight code runs under on the worker (docs/nnsight.md): the
    # nnsight and Python versions (`3.11.9`); nnsight None: not installed, no nnsight jobs.
    nnsight_version: str | None = None
    python_version: str | None = None
    attention: str | None = None  # the attention implementation it runs (`sdpa`, `eager`, ...)
    # How its worker decodes jobs (worker/batch/served.py `describe_decoder`): "in slots, ...",
    # "batched, each job's recurrent state in a slot ...", "in a compacted batch ...", "one job at a
    # time (...)". None: not published (a worker that predates this field).
    decoding: str | None = None
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
    decoding: str | None = None  # how its worker decodes jobs (ModelInfo.decoding)
