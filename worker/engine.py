"""The capture engine: chat template -> generate with capture hooks -> kept rows on the CPU -> [T, H].

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

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from shared.capture_spec import check_prompt_fits
from shared.errors import ContextLengthExceeded, JobFailure
from shared.schemas import CapturePoint, JobRequest, ModelInfo
from worker.capture import StepCapture, describe_modules
from worker.footprint import footprint
from worker.models import LoadedModel
from worker.presets import resolve_presets
from worker.prompts import PromptEncoder

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


def _required(config: object, name: str) -> int:
    """A setting the worker cannot go on without: a clear error rather than a silent 0."""
    value = getattr(config, name, None)
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"the model's configuration ({type(config).__name__}) has no usable {name}: {value!r}")
    return value


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


class CaptureEngine:
    """Runs generations on the loaded model (one copy of the weights) with capture hooks for the
    duration of each job. One generate at a time: the hooks of two jobs on one model would see
    each other's steps, so every run holds `lock`."""

    def __init__(self, loaded: LoadedModel, allow_special_tokens: bool = False) -> None:
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.prompts = PromptEncoder(loaded.tokenizer, allow_special_tokens)
        self.hf = loaded.model
        self.lock = threading.Lock()
        self.info = self._describe()
        self._module_paths = {m.path for m in self.info.modules}

    # -- describing the model ------------------------------------------------------------

    def _describe(self) -> ModelInfo:
        """A two-step generate over a short input with hooks on every module: gives the modules
        in forward-execution order, their widths, and which see every position."""
        text = self.hf.config.get_text_config()  # a multimodal config keeps these in text_config
        vocab = _required(text, "vocab_size")

        def run_forward(seq: int, steps: int) -> None:
            ids = torch.arange(1, seq + 1, device=self.loaded.device).unsqueeze(0) % vocab
            with self.lock, torch.inference_mode():
                self.hf.generate(  # type: ignore[operator]  # generate is GenerationMixin's
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=steps,
                    min_new_tokens=steps,
                    do_sample=False,
                    **self._pad(),
                )

        modules, not_capturable = describe_modules(self.hf, run_forward)
        hidden = _required(text, "hidden_size")
        layers = _required(text, "num_hidden_layers")
        return ModelInfo(
            name=self.loaded.name,
            source=self.loaded.source,
            architecture=type(self.hf).__name__,
            num_layers=layers,
            hidden_size=hidden,
            vocab_size=vocab,
            max_context=self._max_context(text),
            dtype=self.loaded.dtype,
            device=self.loaded.device,
            modules=modules,
            not_capturable=not_capturable,
            max_token_bytes=self.prompts.max_token_bytes(),
            chat_template=self.prompts.has_chat_template,
            presets=resolve_presets(self.hf, modules, hidden, layers),
            **self.prompts.template_tokens(),
            **footprint(self.hf.config, self.hf.dtype),
        )

    def _max_context(self, text: object) -> int:
        """The context length from the config, else the tokenizer's; 0 (no check) with a warning."""
        found = getattr(text, "max_position_embeddings", None)
        if isinstance(found, int) and found > 0:
            return found
        found = getattr(self.tokenizer, "model_max_length", None)
        if isinstance(found, int) and 0 < found < 10**8:  # transformers' "unset" is a huge number
            return found
        log.warning("%s states no context length: prompts are not checked against one", self.loaded.name)
        return 0

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
        dtype = getattr(torch, request.capture.dtype) if request.capture else torch.float32
        positions = request.capture.positions if request.capture else "all"
        widths = [self._width(p) for p in points]
        capture = StepCapture(self.hf, points, widths, positions, prompt_tokens, max_tokens, dtype)
        with self.lock, torch.inference_mode(), capture:
            if request.seed is not None:
                torch.manual_seed(request.seed)
            ids = self.hf.generate(**prompt, **kwargs)  # type: ignore[operator]  # generate is GenerationMixin's
        token_ids = ids[0].to("cpu", torch.int64)
        generated = token_ids[prompt_tokens:]
        text, finish_reason = self._finish(generated, request, max_tokens)
        captured = [
            CapturedTensor(point=point, tensor=rows, start=start, stop=stop)
            for point, rows, start, stop in capture.tensors(len(generated))
        ]
        return Generation(
            text=text,
            finish_reason=finish_reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=len(generated),
            token_ids=token_ids,
            captured=captured,
            stopped_by=criterion.reason if criterion else None,
        )

    def _width(self, point: CapturePoint) -> int:
        info = self.info.modules[self.info.module_index[point.module]]
        width = info.width(point.hook)
        if width is None:
            raise JobFailure(f"module {point.module!r} has no capturable {point.hook}")
        return width

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
