"""Job preparation: a request made into a sequence ready to join a batch. Checked (modules,
token ids, context length), tokenized (chat template, or a trace's conversation with its
completion span), with its capture buffers (worker/hooks/capture.py), its edits with their values on the
model's device (worker/hooks/edits.py), its sampler settings and its grammar. A problem raises the
job's failure before it reaches the engine core."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shared.capture_spec import check_prompt_fits, logit_bias_problem, token_ids_problem
from shared.edit_refs import References
from shared.errors import ContextLengthExceeded, InterventionError, JobFailure, over_context
from shared.interventions import EditPoint
from shared.schemas import CapturePoint, CaptureSpec, JobRequest
from worker.batch.sequence import Sequence, TokenScores, Watch
from worker.hooks.capture import JobCapture
from worker.hooks.edits import JobEdits, build
from worker.model.sampling import row_sampling

if TYPE_CHECKING:
    from worker.batch.served import ServedModel


def prepare(
    served: ServedModel,
    request: JobRequest,
    points: list[CapturePoint],
    max_tokens: int,
    watch: Watch | None = None,
    edit_points: list[EditPoint] | None = None,
    references: References | None = None,
) -> Sequence:
    """A job's sequence for `served`'s model, ready to join a batch: checked, tokenized, with its
    capture buffers and its edits (`edit_points`, as the API resolved them; `references` reads
    the stored values they name). Raises the job's failure (unknown module, context too long)."""
    info = served.info
    unknown = [p.module for p in points if p.module not in served.module_paths]
    if unknown:
        raise JobFailure(f"modules not in this model's capturable list: {', '.join(unknown)}")
    if request.trace:
        max_tokens = 0
    check_prompt_fits(request, info, max_tokens)  # before tokenizing megabytes of text
    if (problem := token_ids_problem(request, info.vocab_size)) is not None:
        raise JobFailure(problem)
    if (problem := logit_bias_problem(request, info.vocab_size)) is not None:
        raise JobFailure(problem)
    if request.prompt_logprobs and served.solo_reason is not None:
        raise JobFailure(
            f"prompt_logprobs (echo with generation) is not supported for {info.name}, whose prompts run "
            f"through its own cache ({served.solo_reason}); score the prompt with a trace job (echo with max_tokens 0)"
        )
    completion = None
    device = served.loaded.device
    if request.trace:
        prompt, completion = served.prompts.encode_trace(request, served.eos_ids)
        prompt = prompt.to(device)
    else:
        prompt = served.encode(request)["input_ids"]
    prompt_tokens = int(prompt.shape[1])
    limit = info.max_context
    if limit and prompt_tokens + max_tokens > limit:
        what = "messages" if request.messages is not None else "prompt"
        raise ContextLengthExceeded(over_context(limit, prompt_tokens, max_tokens, what))
    capture = None
    if points:
        spec = request.capture or CaptureSpec(modules=[p.module for p in points])
        capture = JobCapture(
            points,
            [width(served, p) for p in points],
            spec.positions,
            prompt_tokens,
            max_tokens,
            getattr(torch, spec.dtype),
            reduce=spec.reduce,
            features=spec.feature_indices,
            completion=completion,
        )
    edits = None
    if request.interventions and edit_points:
        edits = _edits(served, request, edit_points, references, prompt_tokens, max_tokens)
    return Sequence(
        prompt_ids=prompt,
        edits=edits,
        max_tokens=max_tokens,
        capture=capture,
        stops=list(request.stop),
        min_tokens=request.min_tokens,
        watch=watch,
        scores=TokenScores(request.alternatives) if request.logprobs else None,
        completion=completion,
        echo=request.prompt_logprobs,
        constraint=served.grammars.constraint(request, info.tool_format),
        sampling=None if request.trace else row_sampling(request),
    )


def width(served: ServedModel, point: CapturePoint) -> int:
    """The width of a capture point's values (a module without that hook is the job's failure)."""
    info = served.info.modules[served.info.module_index[point.module]]
    found = info.width(point.hook)
    if found is None:
        raise JobFailure(f"module {point.module!r} has no capturable {point.hook}")
    return found


def _edits(
    served: ServedModel,
    request: JobRequest,
    edit_points: list[EditPoint],
    references: References | None,
    prompt_tokens: int,
    max_tokens: int,
) -> JobEdits:
    """The job's edits with their values on the model's device (float32)."""
    assert request.interventions is not None
    unknown = [p.module for p in edit_points if p.module not in served.module_paths]
    if unknown:
        raise JobFailure(f"modules not in this model's list: {', '.join(unknown)}")
    device = served.loaded.device
    edits = request.interventions

    def vector(index: int, field: str, width: int) -> torch.Tensor:
        named = dict(edits[index].vectors())[field]
        if isinstance(named, list):
            return torch.tensor(named, dtype=torch.float32, device=device)
        if references is None:
            raise JobFailure(f"interventions[{index}].{field}: no store to read it from")
        try:
            values = references.vector(named, width, f"interventions[{index}].{field}")
        except InterventionError as exc:  # gone or changed since the API checked it
            raise JobFailure(exc.message) from None
        return torch.from_numpy(values.copy()).to(device)

    def patch(index: int, module: str, hook: str, width: int) -> tuple[int, torch.Tensor]:
        source = edits[index].source
        assert source is not None
        if references is None:
            raise JobFailure(f"interventions[{index}].source: no store to read it from")
        try:
            first, rows = references.patch(source, module, hook, width, f"interventions[{index}].source")
        except InterventionError as exc:
            raise JobFailure(exc.message) from None
        return first, torch.from_numpy(rows.copy()).to(device)

    pairs = [(p.index, p.module, p.hook, p.width) for p in edit_points]
    return build(edits, pairs, vector, patch, prompt_tokens, max_tokens, device)
