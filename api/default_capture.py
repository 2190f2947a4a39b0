"""The server's capture for an OpenAI-route request that sends none.

Some clients cannot add a `capture` field to what they send (lm-eval's loglikelihood requests,
LangChain): for them the operator sets a default per API key (ACTQ_DEFAULT_CAPTURE_BY_KEY) and per
served model (ACTQ_DEFAULT_CAPTURE_BY_MODEL); the key's wins. A request's own `capture` always
wins. Only the OpenAI-compatible routes apply it: POST /jobs callers can always send their own.
"""

from __future__ import annotations

from pydantic import ValidationError

from api.deps import key_id
from shared.errors import CaptureSpecError
from shared.schemas import CaptureSpec, JobRequest
from shared.settings import Settings


def default_capture(settings: Settings, model: str, caller: str | None) -> tuple[str, CaptureSpec] | None:
    """(the setting it comes from, the capture) a request of `caller` for `model` gets when it
    sends none; None when no default applies."""
    if caller is not None:
        for key, spec in settings.default_capture_by_key.items():
            if key_id(key) == caller:
                return "ACTQ_DEFAULT_CAPTURE_BY_KEY", spec
    if model in settings.default_capture_by_model:
        return f"ACTQ_DEFAULT_CAPTURE_BY_MODEL for {model!r}", settings.default_capture_by_model[model]
    return None


def with_default_capture(settings: Settings, request: JobRequest, caller: str | None) -> JobRequest:
    """`request`, with the default capture when it has none (checked as POST /jobs checks a
    capture: a default that cannot apply to this request is a 400 naming the setting)."""
    if request.capture is not None:
        return request
    found = default_capture(settings, request.model, caller)
    if found is None:
        return request
    source, spec = found
    data = request.model_dump(exclude_unset=True)
    data["capture"] = spec.model_dump(exclude_unset=True)
    try:
        return JobRequest.model_validate(data)
    except ValidationError as exc:
        reasons = "; ".join(str(e.get("msg")).removeprefix("Value error, ") for e in exc.errors())
        raise CaptureSpecError(
            f"this request sends no capture, and the server's default ({source}) does not fit it: {reasons}. "
            "Send a `capture` of your own (a default with positions 'all', 'prompt' or 'last' fits every request)"
        ) from None
