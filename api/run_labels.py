"""A run label in the URL: `/runs/<label>/v1/...` is the OpenAI API with every job it makes tagged
`metadata.run = <label>`, so that a client that cannot tag its requests (stock lm-eval drops the
`actq` field and the job-id header, and its scoring requests carry no gen_kwargs) still leaves
every job of one run findable: `GET /jobs?metadata.run=<label>`, `actq export --label <label>`.
The tokenizer routes answer under the same prefix (`/runs/<label>/tokenize`...), where lm-eval
looks for them beside its base URL.

A label is 1 to 64 letters, digits, `.`, `_` or `-`, starting with a letter or digit. A request
whose own `metadata.run` differs from the URL's label is refused: one job, one run.
"""

from __future__ import annotations

import re

from fastapi import Request
from pydantic import ValidationError

from api.openai.errors import OpenAIError, from_validation
from shared.listing import RUN_KEY
from shared.schemas import JobRequest

PREFIX = "/runs/{label}"
LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def run_label(request: Request) -> str | None:
    """The URL's run label (None outside /runs/<label>/), checked."""
    label = request.path_params.get("label")
    if label is None:
        return None
    if not LABEL.fullmatch(label):
        raise OpenAIError(
            400,
            f"run label {label[:80]!r} in the URL is not a label: use 1 to 64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (/runs/<label>/v1/...)",
            "invalid_request",
        )
    return str(label)


def labelled(request: Request, job_requests: list[JobRequest]) -> list[JobRequest]:
    """The jobs, each tagged with the URL's run label (unchanged outside /runs/<label>/). The
    metadata limits are checked by validating one job per distinct metadata (the n choices of a
    prompt share theirs); the others are copies with the checked metadata."""
    label = run_label(request)
    if label is None:
        return job_requests
    out = []
    checked: dict[tuple[tuple[str, str], ...], dict[str, str]] = {}
    for job in job_requests:
        given = tuple(sorted((job.metadata or {}).items()))
        if given in checked:
            out.append(job.model_copy(update={"metadata": checked[given]}))
            continue
        metadata = dict(job.metadata or {})
        if (own := metadata.get(RUN_KEY, label)) != label:
            raise OpenAIError(
                400,
                f"metadata.{RUN_KEY}={own[:80]!r} differs from the run label {label!r} in the URL: leave "
                f"metadata.{RUN_KEY} out (the URL sets it) or send the request to /runs/{own[:80]}/v1",
                "invalid_request",
                param=f"metadata.{RUN_KEY}",
            )
        metadata[RUN_KEY] = label
        try:
            tagged = JobRequest.model_validate({**job.model_dump(exclude_unset=True), "metadata": metadata})
        except ValidationError as exc:  # the label is one pair too many
            raise from_validation(list(exc.errors())) from None
        checked[given] = metadata
        out.append(tagged)
    return out
