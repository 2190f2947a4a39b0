"""The capture-path grammar, its resolution against a model's module list, and the size estimate.

A pattern is dotted segments::

    pattern  := segment ("." segment)*
    segment  := name | index | "*" | "{" index ("," index)* "}"
    name     := [A-Za-z][A-Za-z0-9_]*        (no leading underscore: no dunders, no privates)
    index    := [0-9]+

`*` matches any one numeric segment ("every layer"); `{8,12,16}` is a list of indices.
Patterns are only ever compared with the published module paths: nothing is evaluated and
no attribute is looked up by a request's string.
"""

from __future__ import annotations

import difflib
import itertools
import math
import os
import re
from collections.abc import Iterable
from typing import NamedTuple

from shared.dtypes import ITEM_BYTES
from shared.errors import CaptureSpecError, CaptureTooLarge, ContextLengthExceeded, JobTooLarge, over_context
from shared.schemas import CapturePoint, CaptureSpec, JobRequest, ModelInfo, ModuleInfo

_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
_INDEX = re.compile(r"[0-9]{1,6}")
_SET = re.compile(r"\{([0-9]{1,6}(?:,[0-9]{1,6})*)\}")
WILDCARD = "*"
MAX_EXPANSION = 4096
# Chat-template framing per message, in tokens; generous so the estimate stays an upper bound.
TEMPLATE_TOKENS_PER_MESSAGE = 16


def _segments(pattern: str) -> list[str]:
    """A pattern's segments, each checked against the grammar (no set is expanded yet)."""
    segments = pattern.split(".")
    for segment in segments:
        if not (
            _NAME.fullmatch(segment) or _INDEX.fullmatch(segment) or segment == WILDCARD or _SET.fullmatch(segment)
        ):
            raise CaptureSpecError(
                f"capture path {pattern!r}: segment {segment!r} is not a name, an index, '*' or "
                "an index list like {8,12,16}"
            )
    return segments


def _options(segment: str) -> list[str]:
    """One segment's choices: a set's distinct indices, or the segment itself."""
    if segment.startswith("{"):
        return list(dict.fromkeys(str(int(i)) for i in segment[1:-1].split(",")))
    return [segment]


def check_patterns(patterns: list[str]) -> list[list[str]]:
    """Each distinct pattern's segments, checked against the grammar, with nothing expanded.

    A pattern's expansion is counted from its text (a set of n indices counts n) as it is
    checked, and the first pattern, or running total, over MAX_EXPANSION concrete paths is refused
    at once: no request makes the API look at more than its own text once before refusing it."""
    checked: list[list[str]] = []
    total = 0
    for pattern in dict.fromkeys(patterns):  # a repeated pattern names nothing more
        segments = _segments(pattern)
        count = math.prod(s.count(",") + 1 for s in segments)
        if count > MAX_EXPANSION:
            raise CaptureSpecError(f"capture path {pattern!r} expands to {count} paths (at most {MAX_EXPANSION})")
        total += count
        if total > MAX_EXPANSION:
            raise CaptureSpecError(
                f"the capture spec expands to more than {MAX_EXPANSION} concrete paths; "
                "use '*' for every layer instead of long index lists"
            )
        checked.append(segments)
    return checked


def parse_all(patterns: list[str]) -> list[list[str]]:
    """Every concrete pattern the patterns spell (`{a,b}` sets expanded, `*` kept), at most
    MAX_EXPANSION of them (check_patterns counts them first)."""
    return [
        list(combo) for segments in check_patterns(patterns) for combo in itertools.product(*map(_options, segments))
    ]


def names(segments: list[str], model: ModelInfo) -> list[str]:
    """The module paths one checked pattern names, found without expanding its index sets.

    The model's paths of the pattern's shape (indices, sets and `*` alike) are compared segment
    by segment: a set is a membership test, `*` any index. Every concrete path the sets spell
    must name a module (with `*`, at least one); otherwise CaptureSpecError names the first that
    does not. The work is the number of the model's paths of that shape, whatever the sets hold."""
    if not any(s == WILDCARD or s.startswith("{") for s in segments):  # a plain path: one lookup
        concrete = ".".join(segments)
        if concrete in model.module_index:
            return [concrete]
        raise CaptureSpecError(
            f"capture path {concrete!r} names no module of model {model.name!r}"
            f"{_closest(concrete, list(model.module_index))}"
        )
    options = [_options(s) for s in segments]
    allowed = [None if s == WILDCARD else frozenset(o) for s, o in zip(segments, options, strict=True)]
    sets = [i for i, s in enumerate(segments) if s.startswith("{")]
    shape = ".".join("*" if s == WILDCARD or s.isdigit() or s.startswith("{") else s for s in segments)
    hits: list[str] = []
    spelled: set[tuple[str, ...]] = set()
    for path in model.shape_index.get(shape, []):
        parts = path.split(".")
        if all(ok is None or part in ok for part, ok in zip(parts, allowed, strict=True)):
            hits.append(path)
            spelled.add(tuple(parts[i] for i in sets))
    if len(spelled) < math.prod(len(options[i]) for i in sets) or not hits:
        for combo in itertools.product(*(options[i] for i in sets)):  # stops at the first missing one
            if combo not in spelled:
                spelt = list(segments)
                for i, value in zip(sets, combo, strict=True):
                    spelt[i] = value
                missing = ".".join(spelt)
                raise CaptureSpecError(
                    f"capture path {missing!r} names no module of model {model.name!r}"
                    f"{_closest(missing, list(model.module_index))}"
                )
    return hits


CLOSEST_CANDIDATES = 512  # bounds the fuzzy match's cost on a model with thousands of modules


def _closest(concrete: str, paths: list[str]) -> str:
    """Up to three published paths close to a path that names nothing. Compared against paths
    with about as many segments (at most CLOSEST_CANDIDATES of them), so a typo costs the API a
    bounded moment whatever the model's size."""
    probe = concrete.replace(WILDCARD, "0")
    depth = probe.count(".")
    near_depth = [p for p in paths if abs(p.count(".") - depth) <= 1]
    if len(near_depth) > CLOSEST_CANDIDATES:  # keep the paths that share the longest prefix
        near_depth.sort(key=lambda p: -len(os.path.commonprefix([p, probe])))
        near_depth = near_depth[:CLOSEST_CANDIDATES]
    near = difflib.get_close_matches(probe, near_depth, n=3, cutoff=0.5)
    return f"; closest valid names: {', '.join(near)}" if near else ""


def preset_paths(spec: CaptureSpec, model: ModelInfo) -> list[str]:
    """The module paths a spec's preset names at its layers (all layers by default)."""
    if spec.preset is None:
        return []
    paths = model.presets.get(spec.preset)
    if paths is None:
        known = ", ".join(sorted(model.presets)) or "none (name modules instead)"
        raise CaptureSpecError(
            f"model {model.name!r} has no preset {spec.preset!r}; its presets: {known} (GET /models lists them)"
        )
    if spec.layers is None:
        return list(paths)
    count, picked = len(paths), []
    for layer in spec.layers:
        if not -count <= layer < count:
            raise CaptureSpecError(
                f"layer {layer} is out of range for preset {spec.preset!r}: model {model.name!r} has {count} "
                f"layers (0 to {count - 1}, or -1 for the last)"
            )
        picked.append(paths[layer])
    return picked


def resolve(spec: CaptureSpec, model: ModelInfo) -> list[CapturePoint]:
    """The capture points a spec names, in forward-execution order, each checked for the hook."""
    modules: list[ModuleInfo] = model.modules
    index = model.module_index
    selected: set[str] = set(preset_paths(spec, model))
    for segments in check_patterns(spec.modules):
        selected.update(names(segments, model))

    points: list[CapturePoint] = []
    for info in (modules[i] for i in sorted(index[path] for path in selected)):
        dim = info.width(spec.hook)
        if dim is None:
            raise CaptureSpecError(
                f"module {info.path!r} has no capturable {spec.hook} (it is not one [batch, position, hidden] tensor)"
            )
        if not info.all_positions and spec.positions in ("all", "prompt"):
            raise CaptureSpecError(
                f"module {info.path!r} only computes the last position of each step; "
                "capture it with positions 'generated' or 'last'"
            )
        try:
            spec.feature_indices(dim)
        except ValueError as exc:
            raise CaptureSpecError(f"module {info.path!r} ({spec.hook} width {dim}): {exc}") from None
        name = info.path if spec.hook == "output" else f"{info.path}:input"
        points.append(CapturePoint(name=name, module=info.path, hook=spec.hook))
    return points


def prompt_tokens_upper_bound(request: JobRequest, model: ModelInfo) -> int:
    """An upper bound on prompt tokens without a tokenizer: a byte-level BPE token covers >= 1 byte
    of content, plus the chat template's own tokens as the worker measured them (a default system
    prompt included); a generous guess where the worker did not measure them. A raw `prompt` has
    no template: only the tokens the tokenizer adds (BOS), well inside the slack of 8."""
    if request.prompt_token_ids is not None:
        return len(request.prompt_token_ids)
    content = request.content_bytes
    if request.messages is None:
        return content + 8
    if model.template_tokens is None or model.template_tokens_per_message is None:
        return content + TEMPLATE_TOKENS_PER_MESSAGE * len(request.messages) + 8
    per_message = max(model.template_tokens_per_message, 0)
    return content + model.template_tokens + per_message * (len(request.messages) - 1) + 8


def span(
    positions: str, prompt_tokens: int, new_tokens: int, completion: tuple[int, int] | None = None
) -> tuple[int, int]:
    """The token_ids range `[start, stop)` a positions choice keeps (docs/capture.md, "Positions").

    A generation of N new tokens from a P-token prompt feeds P + N - 1 tokens to the model (the
    last new token is never fed back); row i of a capture is the activation at fed position i.

    A trace job (`new_tokens` 0) feeds its P tokens once: `all` is [0, P), `last` [P - 1, P);
    `completion` is the final assistant turn's range and `prompt` everything before it (all of
    it when there is no such turn).
    """
    if new_tokens == 0:
        if positions == "all":
            return 0, prompt_tokens
        if positions == "last":
            return prompt_tokens - 1, prompt_tokens
        if positions == "prompt":
            return 0, completion[0] if completion is not None else prompt_tokens
        if positions == "completion" and completion is not None:
            return completion
        raise ValueError(f"positions {positions!r} selects nothing in a trace job")
    fed = prompt_tokens + new_tokens - 1
    if positions == "all":
        return 0, fed
    if positions == "prompt":
        return 0, prompt_tokens
    if positions == "generated":
        return prompt_tokens - 1, fed
    if positions == "last":
        return fed - 1, fed
    raise ValueError(f"unknown positions {positions!r}")


def prompt_tokens_lower_bound(request: JobRequest, model: ModelInfo) -> int:
    """At least this many prompt tokens: no token stands for more than `model.max_token_bytes`
    bytes of text (0 when the worker did not say)."""
    if request.prompt_token_ids is not None:
        return len(request.prompt_token_ids)
    if not model.max_token_bytes:
        return 0
    return -(-request.content_bytes // model.max_token_bytes)


def check_prompt_fits(request: JobRequest, model: ModelInfo, max_tokens: int) -> None:
    """Refuse a prompt that cannot fit the context whatever the tokenizer does with it; the API
    checks it at submit and the worker again before it tokenizes anything."""
    least = prompt_tokens_lower_bound(request, model)
    if model.max_context and least + max_tokens > model.max_context:
        what = "prompt" if request.prompt is not None or request.prompt_token_ids is not None else "messages"
        if request.prompt_token_ids is not None:
            raise ContextLengthExceeded(over_context(model.max_context, least, max_tokens, what))
        why = f"{model.name}'s tokens stand for at most {model.max_token_bytes} bytes each"
        raise ContextLengthExceeded(over_context(model.max_context, least, max_tokens, what, at_least=why))


def logit_bias_problem(request: JobRequest, vocab_size: int) -> str | None:
    """What is wrong with a request's `logit_bias` for a model of `vocab_size` tokens (None: fine)."""
    bad = sorted(t for t in request.logit_bias or {} if t >= vocab_size)
    if not bad:
        return None
    shown = ", ".join(map(str, bad[:5])) + (" ..." if len(bad) > 5 else "")
    return f"logit_bias names tokens outside the model's vocabulary of {vocab_size}: {shown}"


def token_ids_problem(request: JobRequest, vocab_size: int) -> str | None:
    """What is wrong with a `prompt_token_ids` prompt for a model of `vocab_size` tokens (None: fine);
    the API refuses it at submit and the worker checks again before the ids reach the embedding."""
    ids = request.prompt_token_ids
    if ids is None:
        return None
    bad = [(i, t) for i, t in enumerate(ids) if t >= vocab_size]
    if not bad:
        return None
    where = ", ".join(f"prompt_token_ids[{i}]={t}" for i, t in bad[:5]) + (" ..." if len(bad) > 5 else "")
    return f"token ids must be below the model's vocabulary size {vocab_size}: {where}"


def rows_for(positions: str, prompt_tokens: int, new_tokens: int) -> int:
    """Rows in each `[T, H]` tensor for a positions choice."""
    start, stop = span(positions, prompt_tokens, new_tokens)
    return stop - start


class MemoryEstimate(NamedTuple):
    """What a job holds on its worker beyond the model's weights, in bytes."""

    capture: int  # the kept rows (also what is stored)
    working: int  # KV cache and the forward pass's activations

    @property
    def total(self) -> int:
        return self.capture + self.working


def capture_bytes(
    capture: CaptureSpec | None, points: list[CapturePoint], model: ModelInfo, prompt_tokens: int, max_tokens: int
) -> int:
    """Bytes of a capture: rows x (sum of the points' widths) x dtype bytes."""
    if capture is None:
        return 0
    if capture.reduce != "none":
        rows = 1
    elif max_tokens == 0 and capture.positions in ("prompt", "completion"):
        rows = prompt_tokens  # a trace's turn boundary is only known once tokenized: at most all
    else:
        rows = rows_for(capture.positions, prompt_tokens, max_tokens)
    width = 0
    for point in points:
        info = model.modules[model.module_index[point.module]]
        full = info.width(point.hook) or 0
        kept = capture.feature_indices(full)
        width += full if kept is None else len(kept)
    return rows * width * ITEM_BYTES[capture.dtype]


SCORE_ROWS = 256  # positions whose log-probabilities the worker computes at once


def working_bytes(model: ModelInfo, prompt_tokens: int, max_tokens: int, all_logits: bool = False) -> int:
    """What a job holds beyond its capture while it runs: the KV cache of every token, plus what
    one forward pass over its text holds at once (the worker feeds a text longer than the
    published `prefill_chunk_tokens` in chunks of that many positions): one layer's activations,
    the attention scores against every earlier position where they are materialised, and, when
    the pass computes every position's logits (`all_logits`), those logits (float32) and the
    log-softmax of SCORE_ROWS of them. The API checks a request with this before it is queued and
    the worker's scheduler budgets a batch with it (worker/batch/served.py), with the same figures."""
    fed = min(prompt_tokens, model.prefill_chunk_tokens or prompt_tokens)  # positions in one pass
    kv = (model.kv_bytes_per_token or 0) * (prompt_tokens + max_tokens)
    activations = (model.activation_bytes_per_token or 0) * fed
    logits = 4 * model.vocab_size * (fed + 2 * min(fed, SCORE_ROWS)) if all_logits else 0
    return kv + activations + logits + model.attention_bytes_per_token_pair * fed * prompt_tokens


def all_logits(
    trace: bool, logprobs: bool, modules: Iterable[str], model: ModelInfo, prompt_logprobs: bool = False
) -> bool:
    """Whether a job's passes compute the vocabulary projection at every position: a trace that
    asks for log-probabilities or captures a module generation runs at the last position only
    (`lm_head`), and a generation whose prefill scores its prompt (`prompt_logprobs`). Other
    jobs' passes compute it at the last position alone."""
    if prompt_logprobs:
        return True
    if not trace:
        return False
    return logprobs or any(not model.modules[model.module_index[m]].all_positions for m in modules)


def job_memory(
    capture: CaptureSpec | None,
    points: list[CapturePoint],
    model: ModelInfo,
    prompt_tokens: int,
    max_tokens: int,
    all_logits: bool = False,
) -> MemoryEstimate:
    captured = capture_bytes(capture, points, model, prompt_tokens, max_tokens)
    return MemoryEstimate(captured, working_bytes(model, prompt_tokens, max_tokens, all_logits))


def estimate(request: JobRequest, points: list[CapturePoint], model: ModelInfo, max_tokens: int) -> MemoryEstimate:
    """The worst case for a request, before any tokenizer ran: the prompt at its upper bound
    (never more than the context leaves, since a longer one is refused before it is run)."""
    prompt_tokens = prompt_tokens_upper_bound(request, model)
    if model.max_context:
        prompt_tokens = max(1, min(prompt_tokens, model.max_context - max_tokens))
    every = all_logits(request.trace, request.logprobs, [p.module for p in points], model, request.prompt_logprobs)
    return job_memory(request.capture, points, model, prompt_tokens, max_tokens, every)


def check_budget(estimate: MemoryEstimate, capture_budget: int, memory_budget: int) -> None:
    if estimate.capture > capture_budget:
        raise CaptureTooLarge(
            f"estimated capture size {estimate.capture:,} bytes exceeds the budget of {capture_budget:,} bytes "
            "(ACTQ_CAPTURE_BUDGET_BYTES); capture fewer modules, fewer positions, a 2-byte dtype "
            "or fewer max_tokens"
        )
    if estimate.total > memory_budget:
        raise JobTooLarge(
            f"this job needs an estimated {estimate.total:,} bytes of worker memory (capture {estimate.capture:,}, "
            f"KV cache and activations {estimate.working:,}), over the budget of {memory_budget:,} bytes "
            "(ACTQ_JOB_MEMORY_BUDGET_BYTES); use a shorter prompt, fewer max_tokens or a smaller capture"
        )
