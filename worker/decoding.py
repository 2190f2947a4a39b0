"""Iteration-level batched decoding: a sequence joins the running batch after its own prefill and
leaves it at the step it ends, so a finished sequence frees its slot for the next one at once.

Each step feeds every sequence's newest token in one forward pass of `[B, 1]`. A new sequence's
prompt is run alone (batch of one, exactly as a solo job), then its cache rows are moved into the
batch (worker/kvcache.py), left-padded to the batch's timeline. The batch keeps, per sequence,
the token ids, the attention mask (0 on padding) and position ids (each sequence counts its own
tokens from 0), all `[B, L]` with L = cached positions + 1 (the last column is the token the next
step feeds). Model inputs are built by the model's own `prepare_inputs_for_generation`, and the
next token by the model's own logits processors, as `generate` does; a batch of one therefore
computes exactly what `generate` computes for that sequence (tested bit for bit).

Sampling draws from a generator per sequence (seeded by the job's `seed`), so a seeded job gets
the same draws whatever else shares its batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from shared.errors import JobFailure, OutOfMemory
from worker import kvcache
from worker.capture import BatchHooks, JobCapture

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

OUT_OF_MEMORY = "the model ran out of memory on this job; ask for fewer tokens or capture less"
# Asked after each decoding step with the number of new tokens so far; a reason string stops.
Watch = Callable[[int], str | None]


def is_oom(exc: BaseException) -> bool:
    text = str(exc).lower()
    return (
        isinstance(exc, (torch.OutOfMemoryError, MemoryError))
        or "out of memory" in text
        or ("can't allocate memory" in text)
    )


class Sampler:
    """The next token of one sequence from its logits: the model's own logits processors (as
    `generate` builds them for these settings), then argmax or a draw from this sequence's own
    generator."""

    def __init__(self, model: Any, settings: dict, prompt_tokens: int, seed: int | None) -> None:
        config, _ = model._prepare_generation_config(None, **settings)  # what generate would use
        self.processors = model._get_logits_processor(
            generation_config=config, input_ids_seq_length=prompt_tokens, device=str(model.device), model_kwargs={}
        )
        self.do_sample = bool(config.do_sample)
        self.generator: torch.Generator | None = None
        if self.do_sample:
            self.generator = torch.Generator(device=model.device)
            if seed is not None:
                self.generator.manual_seed(seed)
            else:
                self.generator.seed()

    def __call__(self, ids: Callable[[], torch.Tensor], logits: torch.Tensor) -> int:
        """`ids()` gives the sequence's tokens so far `[1, n]` (only built when a processor needs
        them); `logits` is `[1, V]` float32."""
        scores = self.processors(ids(), logits) if len(self.processors) else logits
        if self.do_sample:
            probs = torch.nn.functional.softmax(scores, dim=-1)
            return int(torch.multinomial(probs, num_samples=1, generator=self.generator)[0, 0])
        return int(torch.argmax(scores, dim=-1)[0])


def stop_window(stops: list[str]) -> int:
    """Tokens that always cover the longest stop string: a token decodes to at least one character
    except for pieces of a multi-byte character (at most 4 bytes each)."""
    return 4 * max(len(stop) for stop in stops) + 4 if stops else 0


@dataclass
class TokenScores:
    """Log-probabilities of scored tokens: `values[i]` is the log-probability of `tokens[i]` (None:
    nothing predicted it, a trace's first token), `top_ids[i]`/`top_values[i]` the `k` likeliest
    tokens at that position; from the raw logits (log_softmax in float32, before any sampling
    setting)."""

    k: int
    tokens: list[int] = field(default_factory=list)
    values: list[float | None] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_values: list[list[float]] = field(default_factory=list)

    def add(self, logits: torch.Tensor, tokens: torch.Tensor) -> None:
        """Score `tokens` `[n]` against the logits `[n, V]` of the positions that predicted them."""
        # a token the model rules out (-inf) as the lowest finite float32: JSON has no infinity
        logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1).clamp(min=torch.finfo(torch.float32).min)
        chosen = logprobs.gather(1, tokens.view(-1, 1).to(logprobs.device))[:, 0]
        self.tokens += [int(t) for t in tokens.tolist()]
        self.values += [float(v) for v in chosen.tolist()]
        if self.k:
            top = torch.topk(logprobs, self.k, dim=-1)
            self.top_ids += top.indices.tolist()
            self.top_values += top.values.tolist()
        else:
            self.top_ids += [[] for _ in range(len(tokens))]
            self.top_values += [[] for _ in range(len(tokens))]


@dataclass(eq=False)  # a sequence is itself: compared by identity
class Sequence:
    """One job's sequence. `ended` says why it left the batch: eos, length, stop, watch, failed,
    trace (a trace job: one forward pass over its text, nothing generated)."""

    prompt_ids: torch.Tensor  # [1, P] on the model's device
    max_tokens: int  # 0 for a trace job
    sampler: Sampler | None  # None for a trace job
    capture: JobCapture | None = None
    stops: list[str] = field(default_factory=list)
    watch: Watch | None = None
    tag: object = None  # the caller's handle
    scores: TokenScores | None = None  # log-probabilities, when the job asked for them
    completion: tuple[int, int] | None = None  # a trace's final assistant turn, [start, stop)
    generated: list[int] = field(default_factory=list)
    ended: str | None = None
    stopped_by: str | None = None  # what the watch answered
    failure: JobFailure | None = None

    @property
    def trace(self) -> bool:
        return self.max_tokens == 0

    @property
    def prompt_tokens(self) -> int:
        return int(self.prompt_ids.shape[1])

    def all_ids(self) -> torch.Tensor:
        new = torch.tensor([self.generated], dtype=self.prompt_ids.dtype, device=self.prompt_ids.device)
        return torch.cat([self.prompt_ids, new], dim=1)


class Decoder:
    """The running batch of one model. Not thread-safe: one thread drives it (the scheduler)."""

    def __init__(self, model: Any, tokenizer: PreTrainedTokenizerBase, pad_id: int) -> None:
        self.model, self.tokenizer, self.pad_id = model, tokenizer, pad_id
        eos = model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        self.logits_to_keep = model._supports_logits_to_keep()
        self.hooks = BatchHooks(model)
        self.rows: list[Sequence] = []
        self.cache: Any = None
        self.ids = self.mask = self.pos = torch.empty(0, 0, dtype=torch.long)
        self.most_rows: int | None = None  # lowered when a step ran out of memory

    def close(self) -> None:
        self.hooks.__exit__()

    # -- one forward pass ----------------------------------------------------------------

    def _forward(self, ids, mask, pos, cache, new: int, rows: list[Sequence], first: bool) -> torch.Tensor:
        """The last position's logits `[B, V]` (float32) of feeding `new` positions; each row's
        capture gets its rows. `generate` drops an all-ones mask, and so does this."""
        self.hooks.use([row.capture for row in rows])
        extra = {"logits_to_keep": 1} if self.logits_to_keep else {}
        inputs = self.model.prepare_inputs_for_generation(
            ids,
            next_sequence_length=new,
            past_key_values=cache,
            attention_mask=None if bool(mask.all()) else mask,
            position_ids=pos,
            use_cache=True,
            is_first_iteration=first,
            **extra,
        )
        out = self.model(**inputs, return_dict=True)
        for index, failure in self.hooks.failures.items():
            rows[index].failure = failure
        return out.logits[:, -1].to(copy=True, dtype=torch.float32)

    # -- joining ---------------------------------------------------------------------------

    def admit(self, seq: Sequence) -> None:
        """Run `seq`'s prompt alone, pick its first token, and add it to the batch (unless that
        first token already ended it: then `seq.ended` is set and it never joins)."""
        prompt = seq.prompt_ids
        length = prompt.shape[1]
        cache = kvcache.new_cache(self.model.config)
        mask = torch.ones_like(prompt)
        pos = torch.arange(length, device=prompt.device).unsqueeze(0)
        logits = self._forward(prompt, mask, pos, cache, length, [seq], first=True)
        self._take(seq, logits[0:1], prompt)
        if seq.ended:
            return
        token = torch.tensor([[seq.generated[-1]]], dtype=prompt.dtype, device=prompt.device)
        ids = torch.cat([prompt, token], 1)
        mask = torch.ones_like(ids)
        pos = torch.arange(length + 1, device=prompt.device).unsqueeze(0)
        if not self.rows:
            self.rows, self.cache, self.ids, self.mask, self.pos = [seq], cache, ids, mask, pos
            return
        timeline = self.ids.shape[1]
        self.cache, _ = kvcache.concat([self.cache, cache], [timeline - 1, length])
        width = max(timeline, length + 1)
        self.ids = torch.cat([self._pad(self.ids, width, self.pad_id), self._pad(ids, width, self.pad_id)])
        self.mask = torch.cat([self._pad(self.mask, width, 0), self._pad(mask, width, 0)])
        self.pos = torch.cat([self._pad(self.pos, width, 0), self._pad(pos, width, 0)])
        self.rows.append(seq)

    @staticmethod
    def _pad(tensor: torch.Tensor, width: int, value: int) -> torch.Tensor:
        missing = width - tensor.shape[1]
        if missing <= 0:
            return tensor
        return torch.cat([tensor.new_full((tensor.shape[0], missing), value), tensor], dim=1)

    # -- trace jobs ------------------------------------------------------------------------

    def trace(self, seqs: list[Sequence]) -> None:
        """One forward pass over the whole text of each trace sequence, left-padded to the longest
        (position ids count each sequence's own tokens from 0, padding is masked): captures and
        log-probabilities, no cache, nothing generated. A lone sequence is the plain forward pass
        `model(input_ids)`. Each sequence ends "trace" (or "failed", with its failure)."""
        lengths = [s.prompt_tokens for s in seqs]
        width = max(lengths)
        device = seqs[0].prompt_ids.device
        ids = torch.cat([self._pad(s.prompt_ids, width, self.pad_id) for s in seqs])
        inputs: dict[str, Any] = {"input_ids": ids}
        if min(lengths) < width:
            mask = torch.cat([self._pad(torch.ones_like(s.prompt_ids), width, 0) for s in seqs])
            inputs["attention_mask"] = mask
            inputs["position_ids"] = (mask.cumsum(dim=1) - 1).clamp(min=0)
        if self.logits_to_keep and not any(s.scores is not None for s in seqs):
            inputs["logits_to_keep"] = 1  # no log-probabilities asked for: skip the vocabulary projection
        self.hooks.use([s.capture for s in seqs], lengths)
        try:
            out = self.model(**inputs, use_cache=False, return_dict=True)
        finally:
            self.hooks.lengths = None
        for index, seq in enumerate(seqs):
            seq.failure = seq.failure or self.hooks.failures.get(index)
            if seq.failure is None and seq.scores is not None:
                first = width - lengths[index]
                seq.scores.values.append(None)  # the first token: nothing predicts it
                seq.scores.tokens.append(int(seq.prompt_ids[0, 0]))
                seq.scores.top_ids.append([])
                seq.scores.top_values.append([])
                seq.scores.add(out.logits[index, first : width - 1], seq.prompt_ids[0, 1:].to(device))
            seq.ended = "failed" if seq.failure is not None else "trace"

    # -- one decoding step -----------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Feed every row's newest token; returns the rows that ended (already removed)."""
        if not self.rows:
            return []
        timeline = self.ids.shape[1] - 1
        logits, self.cache, _ = self._run(self.rows, self.ids, self.mask, self.pos, self.cache, timeline, top=True)
        for row, row_logits in zip(self.rows, logits, strict=True):
            if row.ended is None and row_logits is not None:
                self._take(row, row_logits, None)
        tokens = [row.generated[-1] if row.generated else self.pad_id for row in self.rows]
        device = self.ids.device
        self.ids = torch.cat([self.ids, torch.tensor(tokens, dtype=self.ids.dtype, device=device)[:, None]], 1)
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.rows), 1)], 1)
        self.pos = torch.cat([self.pos, self.pos[:, -1:] + 1], 1)
        return self._remove_ended()

    def _run(self, rows, ids, mask, pos, cache, timeline: int, top: bool = False):
        """One step for `rows`: (each row's logits `[1, V]` or None, the cache, its timeline). On
        running out of memory the rows are split in halves run one after the other, down to one
        row, which then fails alone; batches are capped at the half from then on."""
        saved = kvcache.snapshot(cache)
        marks = [row.capture.mark() if row.capture else None for row in rows]
        try:
            logits = self._forward(ids, mask, pos, cache, 1, rows, first=False)
            return list(logits.split(1)), cache, timeline + 1
        except Exception as exc:
            if not is_oom(exc):
                raise
        kvcache.restore(cache, saved)  # undo what the failed pass wrote, cache and captures alike
        for row, mark in zip(rows, marks, strict=True):
            if row.capture is not None:
                row.capture.reset(mark)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if len(rows) == 1:
            rows[0].failure = OutOfMemory(
                "the model ran out of memory on this job; ask for fewer tokens or capture less"
            )
            rows[0].ended = "failed"
            return [None], cache, timeline
        half = len(rows) // 2
        if top:  # the next batches stay at the half
            self.most_rows = min(self.most_rows or len(rows), half)
            log.warning("out of memory at a batch of %d: running it in halves; batches now at most %d", len(rows), half)
        logits_out, caches, timelines = [], [], []
        for part in (slice(0, half), slice(half, len(rows))):
            indices = list(range(len(rows)))[part]
            sub = kvcache.select(cache, indices, timeline)
            got, sub, after = self._run(rows[part], ids[part], mask[part], pos[part], sub, timeline)
            logits_out += got
            caches.append(sub)
            timelines.append(after)
        merged, after = kvcache.concat(caches, timelines)
        return logits_out, merged, after

    def _take(self, row: Sequence, logits: torch.Tensor, prompt: torch.Tensor | None) -> None:
        """Pick `row`'s next token and decide whether it ended."""
        if row.failure is not None:
            row.ended = "failed"
            return
        assert row.sampler is not None  # only trace sequences have none, and they never decode
        row.generated.append(row.sampler(row.all_ids if prompt is None else (lambda: prompt), logits))
        if row.scores is not None:
            row.scores.add(logits, torch.tensor(row.generated[-1:]))
        count = len(row.generated)
        if row.generated[-1] in self.eos_ids:
            row.ended = "eos"
        elif count >= row.max_tokens:
            row.ended = "length"
        elif row.stops and self._hit_stop(row):
            row.ended = "stop"
        elif row.watch is not None and (why := row.watch(count)) is not None:
            row.ended, row.stopped_by = "watch", why

    def _hit_stop(self, row: Sequence) -> bool:
        """transformers' own `stop_strings` criterion walks the whole vocabulary per set of stop
        strings (seconds per job); this decodes only the tail that could hold one."""
        tail = self.tokenizer.decode(row.generated[-stop_window(row.stops) :])
        return any(stop in tail for stop in row.stops)

    def _remove_ended(self) -> list[Sequence]:
        ended = [row for row in self.rows if row.ended is not None]
        if not ended:
            return []
        keep = [i for i, row in enumerate(self.rows) if row.ended is None]
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache, self.ids, self.mask, self.pos = None, self.ids[:0], self.mask[:0], self.pos[:0]
            return ended
        timeline = self.ids.shape[1] - 1
        self.cache = kvcache.select(self.cache, keep, timeline)
        self.ids, self.mask, self.pos = self.ids[keep], self.mask[keep], self.pos[keep]
        drop = int((self.mask == 0).sum(dim=1).min())  # padding every remaining row has
        if drop:
            kvcache.crop_left(self.cache, drop, timeline)
            self.ids, self.mask, self.pos = self.ids[:, drop:], self.mask[:, drop:], self.pos[:, drop:]
        return ended
