"""The capture engine: chat template -> nnsight generate -> per-step tensors on the CPU -> [T, H].

It knows nothing of Celery or Redis and can be driven directly (tests, benchmarks).

Positions. A generation of N new tokens from a P-token prompt runs N forward steps over the
P + N - 1 tokens fed to the model (the last new token is never fed back). Row i of an `all`
tensor is the activation at fed position i, i.e. while reading token_ids[i] and predicting
token_ids[i + 1]. Each tensor records `start`/`stop`, the token_ids indices of its first row
and one past its last:
  all       [0, P + N - 1)    every fed token
  prompt    [0, P)            the prompt tokens
  generated [P - 1, P + N - 1) one row per new token: row j is where completion token j was predicted
  last      [P + N - 2, P + N - 1)  the last fed position
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from shared.capture_spec import check_prompt_fits, span
from shared.errors import ContextLengthExceeded, JobFailure
from shared.schemas import CapturePoint, JobRequest, ModelInfo, ModuleInfo
from worker.models import LoadedModel
from worker.prompts import PromptEncoder

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class CapturedTensor:
    point: CapturePoint
    tensor: torch.Tensor  # [T, H] on the CPU, contiguous
    start: int
    stop: int


@dataclass
class Generation:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    token_ids: torch.Tensor  # int64 [P + N]
    captured: list[CapturedTensor] = field(default_factory=list)
    stopped_by: str | None = None  # what the watch answered when it ended generation early


# Asked after each decoding step with the number of new tokens so far; a reason string stops.
Watch = Callable[[int], str | None]


class _StopWhen(StoppingCriteria):
    """A transformers stopping criterion around a Watch: generate calls it after every step."""

    def __init__(self, watch: Watch, prompt_tokens: int) -> None:
        super().__init__()
        self.watch, self.prompt_tokens = watch, prompt_tokens
        self.reason: str | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **_: object) -> torch.Tensor:
        if self.reason is None:
            self.reason = self.watch(input_ids.shape[1] - self.prompt_tokens)
        return torch.full((input_ids.shape[0],), self.reason is not None, dtype=torch.bool, device=input_ids.device)


class _StopStrings(StoppingCriteria):
    """Ends generation once the generated text contains one of `stops`.

    transformers' own `stop_strings` criterion first walks the whole vocabulary in Python for each
    new set of stop strings (seconds per job, cached per set: a job with unusual stops held a worker
    for 17 s and its memory grew with every set). This one decodes only the tail of the generated
    tokens that could hold a stop string, after each step: a few hundred microseconds."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: list[str], prompt_tokens: int) -> None:
        super().__init__()
        self.tokenizer, self.stops, self.prompt_tokens = tokenizer, stops, prompt_tokens
        # A token decodes to at least one character except for pieces of a multi-byte character
        # (at most 4 bytes each): this many tokens always cover the longest stop string.
        self.window = 4 * max(len(stop) for stop in stops) + 4

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **_: object) -> torch.Tensor:
        start = max(self.prompt_tokens, input_ids.shape[1] - self.window)
        done = [any(stop in self.tokenizer.decode(row[start:]) for stop in self.stops) for row in input_ids]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def _first_tensor(value: object) -> torch.Tensor | None:
    """A module's value if it is one tensor, or a tuple whose only tensor comes first."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        if not any(isinstance(v, torch.Tensor) for v in value[1:]):
            return value[0]
    return None


def _per_step(view, attr: str) -> list:
    """One value per forward step. nnsight unwraps a single visit to the bare value; undo that."""
    values = getattr(view, attr)
    return [values] if len(view) == 1 else list(values)


def _row_dim(value: object, seq: int) -> tuple[int | None, bool]:
    """(last dim, covers every position) for a [1, S, H] value, (None, False) otherwise."""
    tensor = _first_tensor(value)
    if tensor is None or tensor.dim() != 3 or tensor.shape[0] != 1 or not tensor.is_floating_point():
        return None, False
    if tensor.shape[1] == seq:
        return int(tensor.shape[2]), True
    if tensor.shape[1] == 1:
        return int(tensor.shape[2]), False
    return None, False


class CaptureEngine:
    """Wraps the loaded model once with nnsight (same weights, no second copy) and runs one
    generate at a time: nnsight is not thread-safe, so every run holds `lock`."""

    def __init__(self, loaded: LoadedModel, allow_special_tokens: bool = False) -> None:
        from nnsight import TransformersModel

        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.prompts = PromptEncoder(loaded.tokenizer, allow_special_tokens)
        self.hf = loaded.model
        self.nn = TransformersModel(self.hf, task="text-generation", tokenizer=self.tokenizer)
        self.lock = threading.Lock()
        self.info = self._describe()
        self._module_paths = {m.path for m in self.info.modules}

    # -- describing the model ------------------------------------------------------------

    def _describe(self) -> ModelInfo:
        """A one-token generate over a 3-token input with every module cached: gives the modules
        in forward-execution order, their widths, and which see every position."""
        ids = torch.tensor([[1, 2, 3]], device=self.loaded.device) % self.hf.config.vocab_size
        prompt = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        with self.lock, self.nn.generate(prompt, max_new_tokens=1, do_sample=False, **self._pad()) as tracer:
            cache = tracer.cache(include_inputs=True)
        root = self.nn.path + "."
        modules: list[ModuleInfo] = []
        for key in cache.keys():
            if not key.startswith(root) or ".generator" in key:
                continue
            entry = cache[key]
            out_dim, out_all = _row_dim(_per_step(entry, "output")[0], ids.shape[1])
            in_dim, in_all = _row_dim(_per_step(entry, "input")[0], ids.shape[1])
            if out_dim is None and in_dim is None:
                continue
            all_positions = out_all if out_dim is not None else in_all
            if out_dim is not None and in_dim is not None and out_all != in_all:
                in_dim = None  # keep one row layout per module
            modules.append(
                ModuleInfo(path=key[len(root) :], output_dim=out_dim, input_dim=in_dim, all_positions=all_positions)
            )
        config = self.hf.config
        return ModelInfo(
            name=self.loaded.name,
            source=self.loaded.source,
            architecture=type(self.hf).__name__,
            num_layers=int(getattr(config, "num_hidden_layers", 0)),
            hidden_size=int(getattr(config, "hidden_size", 0)),
            vocab_size=int(config.vocab_size),
            max_context=int(getattr(config, "max_position_embeddings", 0) or 0),
            dtype=self.loaded.dtype,
            device=self.loaded.device,
            modules=modules,
            max_token_bytes=self.prompts.max_token_bytes(),
            **self.prompts.template_tokens(),
        )

    def _pad(self) -> dict:
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id
        return {"pad_token_id": pad}

    # -- running a job -------------------------------------------------------------------

    def encode(self, request: JobRequest) -> dict[str, torch.Tensor]:
        return {k: v.to(self.loaded.device) for k, v in self.prompts.encode(request).items()}

    def generation_kwargs(self, request: JobRequest, max_tokens: int, prompt_tokens: int) -> dict:
        """What `generate` gets for this request (shared with benchmarks' plain arm)."""
        kwargs: dict = {"max_new_tokens": max_tokens, **self._pad()}
        if request.samples:
            kwargs.update(do_sample=True, temperature=request.temperature, top_p=request.top_p)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        criteria = StoppingCriteriaList()
        if request.stop:
            criteria.append(_StopStrings(self.tokenizer, list(request.stop), prompt_tokens))
        kwargs["stopping_criteria"] = criteria
        return kwargs

    def run(
        self, request: JobRequest, points: list[CapturePoint], max_tokens: int, watch: Watch | None = None
    ) -> Generation:
        """Generate (and capture). `watch`, when given, is asked after every decoding step whether
        to stop early (a cancel flag, a deadline); the generation then ends within one step and
        `Generation.stopped_by` says why. What was generated and captured until then is kept."""
        unknown = [p.module for p in points if p.module not in self._module_paths]
        if unknown:
            raise JobFailure(f"modules not in this model's capturable list: {', '.join(unknown)}")
        check_prompt_fits(request, self.info, max_tokens)  # before tokenizing megabytes of text
        prompt = self.encode(request)
        prompt_tokens = int(prompt["input_ids"].shape[1])
        limit = self.info.max_context
        if limit and prompt_tokens + max_tokens > limit:
            raise ContextLengthExceeded(
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model's context of {limit}"
            )
        kwargs = self.generation_kwargs(request, max_tokens, prompt_tokens)
        criterion = None
        if watch is not None:
            criterion = _StopWhen(watch, prompt_tokens)
            kwargs["stopping_criteria"].append(criterion)
        with self.lock:
            if request.seed is not None:
                torch.manual_seed(request.seed)
            if points:
                ids, steps = self._generate_with_capture(prompt, points, request, kwargs)
            else:
                with torch.inference_mode():
                    ids, steps = self.hf.generate(**prompt, **kwargs), {}  # type: ignore[operator]  # generate is GenerationMixin's, not PreTrainedModel's
        token_ids = ids[0].to("cpu", torch.int64)
        generated = token_ids[prompt_tokens:]
        text, finish_reason = self._finish(generated, request, max_tokens)
        captured = [self._select(p, steps[p.name], request, prompt_tokens, len(generated)) for p in points]
        return Generation(
            text=text,
            finish_reason=finish_reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=len(generated),
            token_ids=token_ids,
            captured=captured,
            stopped_by=criterion.reason if criterion else None,
        )

    def _generate_with_capture(self, prompt, points, request, kwargs):
        dtype = getattr(torch, request.capture.dtype)
        outputs = [self.nn.get(p.module) for p in points if p.hook == "output"]
        inputs = [self.nn.get(p.module) for p in points if p.hook == "input"]
        with self.nn.generate(prompt, **kwargs) as tracer:
            out_cache = tracer.cache(modules=outputs, device="cpu", dtype=dtype) if outputs else None
            in_cache = (
                tracer.cache(modules=inputs, device="cpu", dtype=dtype, include_output=False, include_inputs=True)
                if inputs
                else None
            )
            ids = tracer.result.save()
        steps: dict[str, list] = {}
        root = self.nn.path + "."
        for p in points:
            cache = out_cache if p.hook == "output" else in_cache
            assert cache is not None  # a point's hook has its cache: built for every hook some point uses
            view = cache[root + p.module]
            steps[p.name] = _per_step(view, p.hook)
        return ids, steps

    def _finish(self, generated: torch.Tensor, request: JobRequest, max_tokens: int) -> tuple[str, str]:
        text = cast(str, self.tokenizer.decode(generated, skip_special_tokens=True))  # one sequence: one str
        eos = self.hf.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        cuts = [text.find(s) for s in request.stop if s in text]
        if cuts:
            return text[: min(cuts)], "stop"
        if len(generated) and int(generated[-1]) in eos_ids:
            return text, "stop"
        return text, "length" if len(generated) >= max_tokens else "stop"

    def _select(self, point, steps, request, prompt_tokens: int, new_tokens: int) -> CapturedTensor:
        if len(steps) != new_tokens:
            raise JobFailure(f"{point.name}: captured {len(steps)} steps for {new_tokens} new tokens")
        rows = torch.cat([cast(torch.Tensor, _first_tensor(s))[0] for s in steps], dim=0)  # [rows, H]
        all_positions = rows.shape[0] == prompt_tokens + new_tokens - 1
        first = 0 if all_positions else prompt_tokens - 1  # token_ids index of rows[0]
        start, stop = span(request.capture.positions, prompt_tokens, new_tokens)
        if start < first:
            raise JobFailure(f"{point.name} only has positions from {first}; use 'generated' or 'last'")
        if (start - first, stop - first) == (0, rows.shape[0]):
            tensor = rows  # already a fresh contiguous tensor: no second copy
        else:
            tensor = rows[start - first : stop - first].clone()
        return CapturedTensor(point=point, tensor=tensor, start=start, stop=stop)
