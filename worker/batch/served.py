"""The served model: the one loaded copy of the weights as the worker serves it. Its description
(modules in forward order, widths, context, template tokens: what the API checks requests
against), the decoder that runs its jobs together (in slots, worker/batch/slot_decoding.py; in a
compacted batch, worker/batch/decoding.py; or one at a time, worker/batch/solo.py), what a job holds while it
runs (the scheduler's memory budget), and a job alone (`run`). Jobs are prepared in
worker/batch/job_prep.py and their results assembled in worker/batch/generation.py; the engine core
(worker/engine/core.py) drives the decoder.

It knows nothing of Celery or Redis and can be driven directly (tests, benchmarks).
"""

from __future__ import annotations

import logging
import platform
import threading

import torch

from shared.capture_spec import all_logits, working_bytes
from shared.edit_refs import References
from shared.interventions import EditPoint
from shared.schemas import CapturePoint, JobRequest, ModelInfo
from worker.batch import generation, job_prep
from worker.batch.decoding import Decoder
from worker.batch.gate import Gate
from worker.batch.generation import Generation
from worker.batch.running_batch import RunningBatch
from worker.batch.sequence import Sequence, Watch
from worker.batch.slot_decoding import SlotDecoder
from worker.batch.solo import SoloDecoder
from worker.batch.state_decoding import StateDecoder
from worker.hooks.capturable import describe_modules
from worker.model.footprint import footprint
from worker.model.kvcache import check_supported, new_cache
from worker.model.loading import LoadedModel, installed_version
from worker.model.presets import resolve_presets
from worker.model.slot_sizing import CacheLimits
from worker.model.slots import slides, unsupported
from worker.model.state_slots import unsupported as state_unsupported
from worker.rules.constrained import Grammars
from worker.rules.prompts import PromptEncoder

log = logging.getLogger(__name__)


def _required(config: object, name: str) -> int:
    """A setting the worker cannot go on without: a clear error rather than a silent 0."""
    value = getattr(config, name, None)
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"the model's configuration ({type(config).__name__}) has no usable {name}: {value!r}")
    return value


class ServedModel:
    """The loaded model (one copy of the weights), its jobs' preparation and results, and the
    decoder that runs them together (`decoder`). One thread drives the model at a time: the
    engine core's thread, or `run` for a job alone, holds `lock`. A model whose cache rows cannot
    move between batches (`solo_reason`) batches in state slots when its layers are recurrent states
    and full attention (`state_slots`, worker/batch/state_decoding.py), else decodes one job at a time
    (worker/batch/solo.py)."""

    def __init__(
        self,
        loaded: LoadedModel,
        allow_special_tokens: bool = False,
        cuda_graphs: bool = True,
        cache_limits: CacheLimits | None = None,
    ) -> None:
        self.loaded = loaded
        self.cache_limits = cache_limits or CacheLimits()  # the slots' KV cache: its cap, its shrinking
        self.tokenizer = loaded.tokenizer
        self.prompts = PromptEncoder(loaded.tokenizer, allow_special_tokens)
        self.hf = loaded.model
        self.lock = threading.Lock()
        self.gate = Gate()  # shut while trusted code runs on this model (worker/batch/gate.py)
        self.info = self._describe()
        self.module_paths = {m.path for m in self.info.modules}
        # Why this model's cache rows cannot move between batches (None: they can): it then runs in
        # state slots (below) or one job at a time with its own cache (worker/batch/solo.py).
        self.solo_reason = check_supported(new_cache(self.hf.config))
        # Why its cache cannot live in slots (None: batches decode in slots, worker/batch/slot_decoding.py;
        # else in one compacted timeline, worker/batch/decoding.py).
        self.slot_reason = self.solo_reason or unsupported(self.hf.config)
        # A sliding-window layer in slots sums over a ring of its window, in another order than
        # `generate`: a batch of one takes the compacting decoder, bit for bit (worker/model/slots.py)
        self.slides = self.slot_reason is None and slides(self.hf.config)
        # A recurrent or hybrid model (every cache layer a recurrent state or full attention) batches
        # all the same: each sequence's state in a slot (worker/batch/state_decoding.py).
        self.state_slots = self.solo_reason is not None and state_unsupported(self.hf.config) is None
        # A model a device map spreads over several devices (or offloads) runs its steps eagerly:
        # one CUDA graph records one device's stream, and offloading moves weights on the host.
        places = {str(d) for d in (getattr(self.hf, "hf_device_map", None) or {}).values()}
        self.graphs_reason = f"a device map places it on {sorted(places)}" if len(places) > 1 else None
        if places & {"cpu", "disk"}:
            self.graphs_reason = f"a device map offloads it ({sorted(places)})"
        self.cuda_graphs = cuda_graphs and self.graphs_reason is None
        self.info.decoding = self.describe_decoder()  # published with the model (GET /models)
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
            nnsight_version=installed_version("nnsight"),
            python_version=platform.python_version(),
            attention=getattr(self.hf.config, "_attn_implementation", None),
            hub_id=self.loaded.hub_id,
            fingerprint=self.loaded.fingerprint,
            packages={p: v for p in ("nnsight", "torch", "transformers") if (v := installed_version(p)) is not None},
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

    def prepare(
        self,
        request: JobRequest,
        points: list[CapturePoint],
        max_tokens: int,
        watch: Watch | None = None,
        edit_points: list[EditPoint] | None = None,
        references: References | None = None,
    ) -> Sequence:
        """A job's sequence, ready to join a batch (worker/batch/job_prep.py); raises the job's failure.
        Never while trusted code runs on this model (`gate`): it renders with the tokenizer."""
        with self.gate.reading():
            return job_prep.prepare(self, request, points, max_tokens, watch, edit_points, references)

    def finish(self, seq: Sequence, request: JobRequest) -> Generation:
        """The job's result once its sequence left the batch (worker/batch/generation.py); a failed one
        raises its failure. Never while trusted code runs on this model (`gate`): it decodes."""
        with self.gate.reading():
            return generation.finish(seq, request, self.tokenizer, self.eos_ids, self.info.tool_format)

    @property
    def eos_ids(self) -> set[int]:
        """The model's end-of-sequence tokens (its generation config's), which end a turn."""
        eos = self.hf.generation_config.eos_token_id
        return set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()

    def max_batch(self, wanted: int) -> int:
        """`wanted`, or 1 when this model's cache rows cannot move between batches."""
        if self.solo_reason is not None and not self.state_slots and wanted > 1:
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

    def decoder(self, slots: int = 16) -> RunningBatch:
        """The running batch of up to `slots` sequences (the scheduler's ACTQ_MAX_BATCH): in slots
        (worker/batch/slot_decoding.py); for a model whose cache cannot live in slots (`slot_reason`),
        or a sliding-window model asked for one slot (`slides`: bit for bit `generate`), in one
        compacted timeline; for a recurrent or hybrid model (`state_slots`), each sequence's state
        in a slot (worker/batch/state_decoding.py); for one whose cache cannot be batched at all
        (`solo_reason`), or such a model asked for one slot, one job at a time with the model's own
        cache (bit for bit `generate`)."""
        pad = self._pad()["pad_token_id"]
        if self.state_slots and slots > 1:  # a batch of one stays exactly `generate`: the solo decoder's
            return StateDecoder(self.hf, self.tokenizer, pad, slots)
        if self.solo_reason is not None:
            return SoloDecoder(self.hf, self.tokenizer, pad)
        if self.slot_reason is not None or (slots == 1 and self.slides):  # a batch of one: `generate`'s sums
            return Decoder(self.hf, self.tokenizer, pad)
        return SlotDecoder(
            self.hf,
            self.tokenizer,
            pad,
            slots,
            self.info.max_context,
            graphs=self.cuda_graphs,
            limits=self.cache_limits,
            position_bytes=self.info.kv_bytes_per_token or 0,
        )

    def describe_decoder(self) -> str:
        """How this model's batches decode (said at worker start)."""
        if self.state_slots:
            return "batched, each job's recurrent state in a slot (every decoding step one pass over all jobs)"
        if self.solo_reason is not None:
            return f"one job at a time ({self.solo_reason})"
        if self.slot_reason is not None:
            return f"in a compacted batch, not in slots ({self.slot_reason})"
        graphs = self.cuda_graphs and self.loaded.device.startswith("cuda")
        how = "replayed as CUDA graphs" if graphs else "run eagerly"
        if self.graphs_reason is not None and self.loaded.device.startswith("cuda"):
            how += f" ({self.graphs_reason})"
        return "in slots, decoding steps " + how

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
                    decoder.admit_many([seq])
                while decoder.rows:
                    decoder.step()
            finally:
                decoder.close()
        return self.finish(seq, request)
