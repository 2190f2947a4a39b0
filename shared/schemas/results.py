"""What a finished job holds: its result (text, usage, log-probabilities, tool calls, a baseline
run, an nnsight job's saves, the part stored apart) and its activations file's manifest."""

from __future__ import annotations

from shared.interventions import EditReport, Hook
from shared.schemas.base import FinishReason, Positions, Reduce, Strict
from shared.tools import ToolCall


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
