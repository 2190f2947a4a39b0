"""The capture engine: the model's description, a job's sequence (chat template, tokens, capture
buffers, edits, sampler settings) and its result (text, [T, H] tensors); the decoders it makes run
the sequences, many at once (worker/slot_decoding.py, worker/decoding.py) or one at a time
(worker/solo.py), on the engine thread (worker/scheduler.py).

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
import secrets
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch

from shared.capture_spec import all_logits, check_prompt_fits, token_ids_problem, working_bytes
from shared.edit_refs import References
from shared.errors import ContextLengthExceeded, InterventionError, JobFailure
from shared.interventions import EditPoint, EditReport
from shared.schemas import CapturePoint, CaptureSpec, JobRequest, ModelInfo
from worker.capture import JobCapture, describe_modules
from worker.constrained import Grammars
from worker.decoding import Decoder, Sampler, Sequence, TokenScores, Watch
from worker.edits import JobEdits, build
from worker.footprint import footprint
from worker.kvcache import check_supported, new_cache
from worker.models import LoadedModel
from worker.presets import resolve_presets
from worker.prompts import PromptEncoder
from worker.sampling import RowSampling
from worker.slot_decoding import SlotDecoder
from worker.slots import unsupported
from worker.solo import SoloDecoder
from worker.tool_calls import Parsed, parse_tool_calls

if TYPE_CHECKING:
    pass

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
    features: list[int] | None = None  # the kept indices of the last dimension (None: all)


@dataclass
class Generation:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    token_ids: torch.Tensor  # int64 [P + N]
    captured: list[CapturedTensor] = field(default_factory=list)
    stopped_by: str | None = None  # what the watch answered when it ended generation early
    scores: TokenScores | None = None  # log-probabilities, when asked for
    completion: tuple[int, int] | None = None  # a trace's final assistant turn, [start, stop)
    prompt_entries: int | None = None  # prompt_logprobs: the first this many `scores` are the prompt's
    interventions: list[EditReport] | None = None  # per edit and module, positions touched per step
    parsed: Parsed | None = None  # a job with tools: the calls read from the text (worker/tool_calls.py)


class CaptureEngine:
    """Prepares and finishes the jobs of the loaded model (one copy of the weights) and makes the
    decoder that runs them together (`decoder`). One thread drives the model at a time: the
    scheduler's engine thread, or `run` for a job alone, holds `lock`. A model whose cache cannot
    be batched (`solo_reason`) decodes one job at a time (worker/solo.py)."""

    def __init__(self, loaded: LoadedModel, allow_special_tokens: bool = False, cuda_graphs: bool = True) -> None:
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.prompts = PromptEncoder(loaded.tokenizer, allow_special_tokens)
        self.hf = loaded.model
        self.lock = threading.Lock()
        self.info = self._describe()
        self._module_paths = {m.path for m in self.info.modules}
        # Why this model's cache rows cannot move between batches (None: they can): it then runs
        # one job at a time with its own cache (worker/solo.py).
        self.solo_reason = check_supported(new_cache(self.hf.config))
        # Why its cache cannot live in slots (None: batches decode in slots, worker/slot_decoding.py;
        # else in one compacted timeline, worker/decoding.py).
        self.slot_reason = self.solo_reason or unsupported(self.hf.config)
        # A model a device map spreads over several devices (or offloads) runs its steps eagerly:
        # one CUDA graph records one device's stream, and offloading moves weights on the host.
        places = {str(d) for d in (getattr(self.hf, "hf_device_map", None) or {}).values()}
        self.graphs_reason = f"a device map places it on {sorted(places)}" if len(places) > 1 else None
        if places & {"cpu", "disk"}:
            self.graphs_reason = f"a device map offloads it ({sorted(places)})"
        self.cuda_graphs = cuda_graphs and self.graphs_reason is None
        # tool_choice and response_format: each such job's grammar, over the model's logits
        self.grammars = Grammars(self.tokenizer, self.info.vocab_size, self.eos_ids)

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
            tool_format=self.prompts.tool_format,
            tool_template=self.prompts.tool_template,
            special_tokens=self.prompts.refused_specials,
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

    def sampling(self, request: JobRequest) -> dict:
        """The generation settings that pick tokens for this request (shared with benchmarks)."""
        if request.samples:
            return {"do_sample": True, "temperature": request.temperature, "top_p": request.top_p}
        return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}

    def prepare(
        self,
        request: JobRequest,
        points: list[CapturePoint],
        max_tokens: int,
        watch: Watch | None = None,
        edit_points: list[EditPoint] | None = None,
        references: References | None = None,
    ) -> Sequence:
        """A job's sequence, ready to join a batch: checked, tokenized, with its capture buffers
        and its edits (`edit_points`, as the API resolved them; `references` reads the stored
        values they name). Raises the job's failure (unknown module, context too long)."""
        unknown = [p.module for p in points if p.module not in self._module_paths]
        if unknown:
            raise JobFailure(f"modules not in this model's capturable list: {', '.join(unknown)}")
        if request.trace:
            max_tokens = 0
        check_prompt_fits(request, self.info, max_tokens)  # before tokenizing megabytes of text
        if (problem := token_ids_problem(request, self.info.vocab_size)) is not None:
            raise JobFailure(problem)
        if request.prompt_logprobs and self.solo_reason is not None:
            raise JobFailure(
                f"prompt_logprobs (echo with generation) is not supported for {self.info.name}, which runs one job at "
                f"a time ({self.solo_reason}); score the prompt with a trace job (echo with max_tokens 0)"
            )
        completion = None
        if request.trace:
            prompt, completion = self.prompts.encode_trace(request, self.eos_ids)
            prompt = prompt.to(self.loaded.device)
        else:
            prompt = self.encode(request)["input_ids"]
        prompt_tokens = int(prompt.shape[1])
        limit = self.info.max_context
        if limit and prompt_tokens + max_tokens > limit:
            what = "the text" if request.trace else "prompt"
            raise ContextLengthExceeded(
                f"{what} ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model's context of {limit}"
            )
        capture = None
        if points:
            spec = request.capture or CaptureSpec(modules=[p.module for p in points])
            widths = [self._width(p) for p in points]
            capture = JobCapture(
                points,
                widths,
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
            edits = self._edits(request, edit_points, references, prompt_tokens, max_tokens)
        return Sequence(
            prompt_ids=prompt,
            edits=edits,
            max_tokens=max_tokens,
            sampler=None
            if request.trace
            else Sampler(self.hf, self.sampling(request), prompt_tokens, request.seed, self.loaded.device),
            capture=capture,
            stops=list(request.stop),
            watch=watch,
            scores=TokenScores(request.top_k) if request.logprobs else None,
            completion=completion,
            echo=request.prompt_logprobs,
            constraint=self.grammars.constraint(request, self.info.tool_format),
            sampling=None if request.trace else self.row_sampling(request),
        )

    @staticmethod
    def row_sampling(request: JobRequest) -> RowSampling:
        """The request's settings for the vectorised sampler; a job without a seed gets a random
        one (its draws are then its own, as with a fresh generator)."""
        if not request.samples:
            return RowSampling()
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        return RowSampling(temperature=request.temperature, top_p=request.top_p, seed=seed)

    def _edits(
        self,
        request: JobRequest,
        edit_points: list[EditPoint],
        references: References | None,
        prompt_tokens: int,
        max_tokens: int,
    ) -> JobEdits:
        """The job's edits with their values on the model's device (float32)."""
        assert request.interventions is not None
        unknown = [p.module for p in edit_points if p.module not in self._module_paths]
        if unknown:
            raise JobFailure(f"modules not in this model's list: {', '.join(unknown)}")
        device = self.loaded.device
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

    @property
    def eos_ids(self) -> set[int]:
        """The model's end-of-sequence tokens (its generation config's), which end a turn."""
        eos = self.hf.generation_config.eos_token_id
        return set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()

    def max_batch(self, wanted: int) -> int:
        """`wanted`, or 1 when this model's cache rows cannot move between batches."""
        if self.solo_reason is not None and wanted > 1:
            log.warning(
                "%s runs one job at a time (ACTQ_MAX_BATCH=%d ignored): %s", self.info.name, wanted, self.solo_reason
            )
            return 1
        return wanted

    def estimate(self, seq: Sequence) -> int:
        """Bytes a sequence holds while it runs (what the scheduler's memory budget counts): the
        API's estimate (shared/capture_spec.working_bytes, from the figures this worker
        publishes) for its real token count, and its capture buffers as allocated."""
        return self.trace_cost(seq, seq.prompt_tokens)

    def trace_cost(self, seq: Sequence, padded_tokens: int) -> int:
        """`estimate` for a pass in which the sequence is left-padded to `padded_tokens`."""
        modules = [b.point.module for b in seq.capture.buffers] if seq.capture is not None else []
        every = all_logits(seq.trace, seq.scores is not None, modules, self.info, seq.echo)
        working = working_bytes(self.info, padded_tokens, seq.max_tokens, every)
        return working + (seq.capture.nbytes if seq.capture is not None else 0)

    def decoder(self, slots: int = 16) -> Decoder:
        """The running batch of up to `slots` sequences (the scheduler's ACTQ_MAX_BATCH): in slots
        (worker/slot_decoding.py); for a model whose cache cannot live in slots (`slot_reason`),
        in one compacted timeline; for one whose cache cannot be batched at all (`solo_reason`),
        one job at a time with the model's own cache."""
        pad = self._pad()["pad_token_id"]
        if self.solo_reason is not None:
            return SoloDecoder(self.hf, self.tokenizer, pad)
        if self.slot_reason is not None:
            return Decoder(self.hf, self.tokenizer, pad)
        return SlotDecoder(self.hf, self.tokenizer, pad, slots, self.info.max_context, graphs=self.cuda_graphs)

    def describe_decoder(self) -> str:
        """How this model's batches decode (said at worker start)."""
        if self.solo_reason is not None:
            return f"one job at a time ({self.solo_reason})"
        if self.slot_reason is not None:
            return f"in a compacted batch, not in slots ({self.slot_reason})"
        graphs = self.cuda_graphs and self.loaded.device.startswith("cuda")
        how = "replayed as CUDA graphs" if graphs else "run eagerly"
        if self.graphs_reason is not None and self.loaded.device.startswith("cuda"):
            how += f" ({self.graphs_reason})"
        return "in slots, decoding steps " + how

    def finish(self, seq: Sequence, request: JobRequest) -> Generation:
        """The job's result once its sequence left the batch (a failed one raises its failure)."""
        if seq.failure is not None:
            raise seq.failure
        if seq.capture is not None and seq.capture.failure is not None:
            raise seq.capture.failure
        token_ids = seq.all_ids()[0].to("cpu", torch.int64)
        generated = token_ids[seq.prompt_tokens :]
        text, finish_reason = self._finish(generated, request, seq.max_tokens)
        captured = []
        if seq.capture is not None:
            captured = [
                CapturedTensor(point=point, tensor=rows, start=start, stop=stop, features=features)
                for point, rows, start, stop, features in seq.capture.tensors(len(generated))
            ]
        reports = None
        if seq.edits is not None and request.interventions:
            steps = 1 if seq.trace else len(generated)
            reports = seq.edits.reports([e.op for e in request.interventions], steps)
        parsed = None
        if request.parses_tool_calls and self.info.tool_format is not None:
            names = {tool.function.name for tool in request.tools or []}
            parsed = parse_tool_calls(text, self.info.tool_format, names)
            finish_reason = "tool_calls" if parsed.calls and finish_reason == "stop" else finish_reason
        return Generation(
            interventions=reports,
            parsed=parsed,
            text=text,
            finish_reason=finish_reason,
            prompt_tokens=seq.prompt_tokens,
            completion_tokens=len(generated),
            token_ids=token_ids,
            captured=captured,
            stopped_by=seq.stopped_by,
            scores=seq.scores,
            completion=seq.completion,
            prompt_entries=seq.prompt_tokens if seq.echo else None,
        )

    def run(
        self,
        request: JobRequest,
        points: list[CapturePoint],
        max_tokens: int,
        watch: Watch | None = None,
        edit_points: list[EditPoint] | None = None,
        references: References | None = None,
    ) -> Generation:
        """One job alone (a batch of one): generate and capture. `watch`, when given, is asked
        after every decoding step whether to stop early (a cancel flag, a deadline); the
        generation then ends within one step and `Generation.stopped_by` says why. What was
        generated and captured until then is kept."""
        seq = self.prepare(request, points, max_tokens, watch, edit_points, references)
        with self.lock, torch.inference_mode():
            decoder = self.decoder(1)
            try:
                if seq.trace:
                    decoder.trace([seq])
                else:
                    decoder.admit(seq)
                while decoder.rows:
                    decoder.step()
            finally:
                decoder.close()
        return self.finish(seq, request)

    def _width(self, point: CapturePoint) -> int:
        info = self.info.modules[self.info.module_index[point.module]]
        width = info.width(point.hook)
        if width is None:
            raise JobFailure(f"module {point.module!r} has no capturable {point.hook}")
        return width

    def _finish(self, generated: torch.Tensor, request: JobRequest, max_tokens: int) -> tuple[str, str]:
        if request.trace:  # nothing generated, as a completion with max_tokens 0 ends
            return "", "length"
        text = cast(str, self.tokenizer.decode(generated, skip_special_tokens=True))  # one sequence: one str
        eos = self.hf.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        cuts = [text.find(s) for s in request.stop if s in text]
        if cuts:
            return text[: min(cuts)], "stop"
        if len(generated) and int(generated[-1]) in eos_ids:
            return text, "stop"
        return text, "length" if len(generated) >= max_tokens else "stop"
