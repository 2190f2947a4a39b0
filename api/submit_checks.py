"""What can be refused before a job exists (`plan`): a request checked against the served model
(its description from the registry), the capture and memory budgets, the token ids and logit
bias, the tools' format and special tokens, the schemas' size, depth and metaschema, and the
grammar a constrained reply would compile. The cheap checks come first; the costly ones (schemas,
grammars) last, on a check-pool thread (api/check_pool.py) when a request carries them. What
passes is queued by api/enqueue.py."""

from __future__ import annotations

import functools
import hashlib
import json
import re

from api.deps import Services
from shared import capture_spec, intervention_check
from shared.edit_refs import References
from shared.errors import (
    BadRequest,
    ContextLengthExceeded,
    InvalidSchema,
    NoChatTemplate,
    PayloadTooLarge,
    PromptTooLong,
    UnknownModel,
)
from shared.interventions import EditPoint
from shared.schema_checks import MAX_SCHEMA_DEPTH, check_schema, too_deep
from shared.schemas import CapturePoint, JobRequest, ModelInfo

# max_tokens, capture points, estimated capture bytes, the interventions' (edit, module) pairs
Plan = tuple[int, list[CapturePoint], int, list[EditPoint]]


def has_references(request: JobRequest) -> bool:
    """Whether the request's interventions name stored values (read from Redis and the store at
    submit: off the event loop)."""
    for edit in request.interventions or []:
        if edit.source is not None or any(not isinstance(v, list) for _, v in edit.vectors()):
            return True
    return False


def check_references(
    services: Services, request: JobRequest, edits: list[EditPoint], owner: str | None, memo: dict | None = None
) -> None:
    """Every vector and patch source the interventions name exists, is the caller's, fits the
    module it edits and holds finite values (the worker reads them again, with the same checks)."""
    assert request.interventions is not None
    refs = References(services.jobs, services.store, request.model, owner, bool(services.settings.api_key_list), memo)
    seen: set[int] = set()
    for point in edits:
        edit = request.interventions[point.index]
        where = f"interventions[{point.index}]"
        if edit.source is not None:
            refs.patch(edit.source, point.module, point.hook, point.width, f"{where}.source")
        if point.index not in seen:
            seen.add(point.index)
            for name, vector in edit.vectors():
                if not isinstance(vector, list):
                    values = refs.vector(vector, point.width, f"{where}.{name}")
                    if name == "vector" and edit.divides_by_norm:
                        intervention_check.check_direction(values, f"{where}.vector", edit.op)


def plan(
    services: Services,
    request: JobRequest,
    cache: dict[tuple[str, ...], object] | None = None,
    owner: str | None = None,
) -> Plan:
    """Everything that can be refused before a job exists. Returns max_tokens, the capture points,
    the estimated capture bytes and the interventions resolved against the model.
    `cache` (one per batch) keeps model descriptions and resolved specs across entries."""
    settings = services.settings
    if request.mode == "nnsight":
        raise BadRequest(
            "nnsight jobs are sent by nnsight's own client (`remote=True`) or actq's Client.nnsight to POST /request, "
            "by a key in ACTQ_NNSIGHT_KEYS; POST /jobs takes modes 'generate' and 'trace'"
        )
    cache = {} if cache is None else cache
    if ("model", request.model) not in cache:
        cache[("model", request.model)] = services.registry.get(request.model)
    info = cache[("model", request.model)]
    if not isinstance(info, ModelInfo):
        served = ", ".join(services.registry.names()) or "none yet (is a worker running?)"
        raise UnknownModel(f"model {request.model!r} is not served here; served models: {served}")
    if request.messages is not None and not info.chat_template:
        raise NoChatTemplate(
            f"model {info.name!r} has no chat template, so `messages` cannot be rendered: send the text as `prompt` "
            "(raw text; /v1/completions under the OpenAI API), or give its workers a template "
            "(ACTQ_CHAT_TEMPLATE=path/to/template.jinja)"
        )
    check_tool_format(request, info)
    max_tokens = 0 if request.trace else request.max_tokens or settings.max_tokens_default
    if max_tokens > settings.max_tokens_limit:
        raise BadRequest(
            f"max_tokens {max_tokens} exceeds the limit of {settings.max_tokens_limit} (ACTQ_MAX_TOKENS_LIMIT)"
        )
    if request.time_limit is not None and request.time_limit > settings.job_soft_time_limit:
        raise BadRequest(
            f"time_limit {request.time_limit:g}s exceeds this deployment's limit of {settings.job_soft_time_limit:g}s "
            "(ACTQ_JOB_SOFT_TIME_LIMIT); ask for less or leave it out"
        )
    if info.max_context and max_tokens >= info.max_context:
        raise BadRequest(
            f"max_tokens is too large: {max_tokens}. This model's maximum context length is {info.max_context} "
            f"tokens, and {info.name} needs at least one of them for the prompt; ask for fewer tokens"
        )
    if (problem := capture_spec.token_ids_problem(request, info.vocab_size)) is not None:
        raise BadRequest(problem)
    if (problem := capture_spec.logit_bias_problem(request, info.vocab_size)) is not None:
        raise BadRequest(problem)
    check_schema_budget(request, settings.max_schema_bytes, cache)
    try:
        capture_spec.check_prompt_fits(request, info, max_tokens)
    except ContextLengthExceeded as exc:  # at submit it is bad input: 422, nothing queued
        raise PromptTooLong(exc.message) from None
    points: list[CapturePoint] = []
    if request.capture is not None:
        spec_key = ("spec", request.model, request.capture.model_dump_json())
        if spec_key not in cache:
            cache[spec_key] = capture_spec.resolve(request.capture, info)
        points = cache[spec_key]  # type: ignore[assignment]
    edits: list[EditPoint] = []
    if request.interventions:
        edits = intervention_check.resolve(request.interventions, info, request.trace, max_tokens)
        if has_references(request):
            check_references(services, request, edits, owner, cache)
    estimate = capture_spec.estimate(request, points, info, max_tokens)
    if request.baseline:  # the unedited run is a second sequence with its own capture
        estimate = capture_spec.MemoryEstimate(2 * estimate.capture, 2 * estimate.working)
    capture_spec.check_budget(estimate, settings.capture_budget_bytes, settings.job_memory_budget_bytes)
    check_schemas(request, info, cache)  # last: what costs most, once every cheap refusal has had its say
    return max_tokens, points, estimate.capture, edits


def has_schemas(request: JobRequest) -> bool:
    """Whether submitting the request checks JSON Schemas or compiles a grammar (tools or a
    `response_format`, `structured_outputs`): work that scales with the request, done off the event
    loop (api/check_pool.py)."""
    return bool(request.tools) or request.response_format is not None or request.structured_outputs is not None


def heavy(requests: list[JobRequest], large: bool) -> bool:
    """Whether submitting `requests` is work that scales with what they carry: a large body
    (api/bodies.py), or schemas to check and grammars to compile."""
    return large or any(has_schemas(r) for r in requests)


def check_tool_format(request: JobRequest, info: ModelInfo) -> None:
    """Tools need a model that publishes how it writes calls."""
    if info.tool_format is None and (request.tools or request.messages_have_tools):
        raise BadRequest(
            f"model {info.name!r} does not say how it writes tool calls (its workers predate tools, or it has no chat "
            "template): leave out tools and tool turns"
        )


def check_special_tokens(request: JobRequest, info: ModelInfo) -> None:
    """No special-token string of the model in its tools or tool calls: a chat template renders
    them into the prompt, where they would be read as its markup (message text stays text)."""
    if not info.special_tokens or not (request.tools or request.messages_have_tools):
        return
    places: list[tuple[str, object]] = [
        (f"tools[{i}]", [t.function.name, t.function.description, t.function.parameters])
        for i, t in enumerate(request.tools or [])
    ]
    places += [
        (f"messages[{i}].tool_calls", [c.model_dump() for c in m.tool_calls or []])
        for i, m in enumerate(request.messages or [])
        if m.tool_calls
    ]
    pattern = _alternation(tuple(info.special_tokens))
    for where, part in places:
        if (match := pattern.search(json.dumps(part, ensure_ascii=False))) is not None:
            found = match.group(0)
            raise BadRequest(
                f"{where} holds {found!r}, a special token of {info.name}: its chat template would read it as its own "
                "markup; remove it (a deployment whose users are trusted may allow it: ACTQ_ALLOW_SPECIAL_TOKENS)"
            )


@functools.lru_cache(maxsize=16)
def _alternation(tokens: tuple[str, ...]) -> re.Pattern[str]:
    """One pass over a text finds any of `tokens` (the longest first where one contains another)."""
    return re.compile("|".join(map(re.escape, sorted(tokens, key=len, reverse=True))))


def check_schema_budget(request: JobRequest, budget: int, cache: dict) -> None:
    """Cheap, and before anything reads a schema: the request's tools and response_format schema
    within ACTQ_MAX_SCHEMA_BYTES as JSON (`json.dumps`, in C, one tool at a time, stopping once
    over; a schema repeated across the jobs of one HTTP request, `cache`, counts once), each
    schema at most MAX_SCHEMA_DEPTH levels deep."""
    tools = request.tools or []
    parts: list[tuple[str, object]] = [
        (f"tools[{i}]", [t.function.name, t.function.description, t.function.parameters]) for i, t in enumerate(tools)
    ]
    parts += [(where, schema) for where, schema in request.schemas() if not where.startswith("tools")]
    seen: set[bytes] = cache.setdefault(("schema-texts",), set())
    for where, part in parts:
        try:
            text = json.dumps(part)
        except RecursionError:  # deeper than Python writes
            field = f"{where}.function.parameters" if where.startswith("tools") else where
            message = f"{field} nests objects and arrays more than {MAX_SCHEMA_DEPTH} levels deep"
            raise InvalidSchema(message, field) from None
        digest = hashlib.sha256(text.encode()).digest()
        if digest in seen:
            continue
        seen.add(digest)
        cache[("schema-bytes",)] = total = int(cache.get(("schema-bytes",), 0)) + len(text)
        if total > budget:
            raise PayloadTooLarge(
                f"the tools and response_format schemas of this request are over {budget:,} bytes as JSON (at "
                f"{where}, {total:,} so far; ACTQ_MAX_SCHEMA_BYTES): send fewer or smaller tools"
            )
    deep = next((where for where, schema in request.schemas() if too_deep(schema)), None)
    if deep is not None:
        raise InvalidSchema(
            f"{deep} nests objects and arrays more than {MAX_SCHEMA_DEPTH} levels deep; flatten it, or name the "
            "repeated part once in `$defs` and `$ref` it",
            deep,
        )


def check_schemas(request: JobRequest, info: ModelInfo, cache: dict) -> None:
    """Each schema is a JSON Schema (draft 2020-12's metaschema) and a constrained reply's grammar
    compiles and allows a value: the costly checks, run once per distinct schema and grammar of
    an HTTP request (`cache`), off the event loop."""
    check_special_tokens(request, info)
    if not has_schemas(request):
        return
    for where, schema in request.schemas():
        key = ("metaschema", where, json.dumps(schema))
        if key not in cache:
            try:
                check_schema(schema, where)
                cache[key] = None
            except ValueError as exc:
                cache[key] = str(exc)
        if cache[key] is not None:
            raise InvalidSchema(str(cache[key]), where)
    from shared.grammars import grammar_problem

    key = ("grammar", info.name, request.model_dump_json(include=GRAMMAR_FIELDS))
    if key not in cache:
        cache[key] = grammar_problem(request, info.tool_format)
    if (problem := cache[key]) is not None:
        field = str(problem).split(":", 1)[0]
        raise InvalidSchema(str(problem), None if " " in field else field)


# what a grammar is built from
GRAMMAR_FIELDS = {"tools", "tool_choice", "parallel_tool_calls", "response_format", "structured_outputs"}
