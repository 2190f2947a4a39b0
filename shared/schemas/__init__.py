"""Request and response shapes shared by the API and the worker (pydantic, JSON only).

Every shape is importable from here (`from shared.schemas import JobRequest`); each lives in the
module named for what it holds:

- `base`: `Strict` (unknown fields refused) and the shared literal types;
- `request_limits`: a request's limits, the `chat_template_kwargs` and `metadata` checks;
- `request_parts`: a chat turn, a capture spec, an nnsight call;
- `job_request`: `POST /jobs`'s body;
- `batch`: `POST /jobs/batch`'s body and answer;
- `results`: a finished job's result and its activations file's manifest;
- `records`: a job as Redis keeps it and as clients read it;
- `model_info`: what a worker publishes about its model, and `GET /models`.
"""

from __future__ import annotations

from shared.schemas.base import FinishReason, Mode, Positions, Reduce, Strict
from shared.schemas.batch import MAX_BATCH, BatchEntry, BatchItem, BatchRequest, BatchResponse
from shared.schemas.job_request import JobRequest
from shared.schemas.model_info import ModelFingerprint, ModelInfo, ModelView, ModuleInfo, path_shape
from shared.schemas.records import CapturePoint, JobError, JobRecord, JobSummary, JobView
from shared.schemas.request_limits import (
    GREEDY_BELOW,
    MAX_CAPTURE_PATTERNS,
    MAX_FEATURES,
    MAX_LOGIT_BIAS,
    MAX_MESSAGE_CHARS,
    MAX_MESSAGES,
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE_CHARS,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKEN_IDS,
    MAX_STOP_STRINGS,
    MAX_TEMPLATE_KWARGS,
    MAX_TEMPLATE_KWARGS_BYTES,
    MAX_TOP_LOGPROBS,
    MAX_USER_CHARS,
    RESERVED_TEMPLATE_KWARGS,
    TEMPLATE_KWARG,
    check_metadata,
    check_template_kwargs,
)
from shared.schemas.request_parts import CaptureSpec, ChatMessage, NnsightCall
from shared.schemas.results import (
    RESULT_PREVIEW_CHARS,
    RESULT_TEXT_INLINE_CHARS,
    ActivationsManifest,
    BaselineResult,
    JobResult,
    Logprobs,
    NnsightOutput,
    StoredResult,
    TensorInfo,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from shared.states import JobStatus  # re-exported: the states live in shared.states

__all__ = [
    "GREEDY_BELOW",
    "MAX_BATCH",
    "MAX_CAPTURE_PATTERNS",
    "MAX_FEATURES",
    "MAX_LOGIT_BIAS",
    "MAX_MESSAGES",
    "MAX_MESSAGE_CHARS",
    "MAX_METADATA_KEY_CHARS",
    "MAX_METADATA_PAIRS",
    "MAX_METADATA_VALUE_CHARS",
    "MAX_PROMPT_CHARS",
    "MAX_PROMPT_TOKEN_IDS",
    "MAX_STOP_STRINGS",
    "MAX_TEMPLATE_KWARGS",
    "MAX_TEMPLATE_KWARGS_BYTES",
    "MAX_TOP_LOGPROBS",
    "MAX_USER_CHARS",
    "RESERVED_TEMPLATE_KWARGS",
    "RESULT_PREVIEW_CHARS",
    "RESULT_TEXT_INLINE_CHARS",
    "TEMPLATE_KWARG",
    "ActivationsManifest",
    "BaselineResult",
    "BatchEntry",
    "BatchItem",
    "BatchRequest",
    "BatchResponse",
    "CapturePoint",
    "CaptureSpec",
    "ChatMessage",
    "FinishReason",
    "JobError",
    "JobRecord",
    "JobRequest",
    "JobResult",
    "JobStatus",
    "JobSummary",
    "JobView",
    "Logprobs",
    "Mode",
    "ModelFingerprint",
    "ModelInfo",
    "ModelView",
    "ModuleInfo",
    "NnsightCall",
    "NnsightOutput",
    "Positions",
    "Reduce",
    "StoredResult",
    "Strict",
    "TensorInfo",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "check_metadata",
    "check_template_kwargs",
    "path_shape",
]
