"""Iteration-level batched decoding in one compacted timeline: a sequence joins the running batch
after its own prefill and leaves it at the step it ends, so a finished sequence frees its place for
the next one at once. Models whose cache lives in slots decode in worker/slot_decoding.py, which
reuses this class's prompt passes, trace passes and chunked prompts; this timeline is kept for the
caches slots do not hold (sliding windows). Also here: the `Sequence` of a job, its log-probability
records and the failure helpers both decoders share.

Each step feeds every sequence's newest token in one forward pass of `[B, 1]`. New sequences'
prompts run in one left-padded pass (`admit_many`; a batch of one is exactly a solo job's), or, when
longer than `chunk_tokens`, in chunks with a cache of their own between decoding steps (`feed`);
then their cache rows are moved into the batch (worker/kvcache.py), left-padded to the batch's
timeline. The batch keeps, per sequence,
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
from typing import TYPE_CHECKING, Any, cast

import torch

from shared.capture_spec import SCORE_ROWS
from shared.errors import InternalError, JobFailure
from worker import kvcache
from worker.capture import JobCapture, Mark
from worker.capture_hooks import BatchHooks
from worker.constrained import Constraint, masked_rows
from worker.edits import BatchEdits, JobEdits
from worker.failures import failure_of, is_oom, out_of_memory
from worker.sampling import RowSampling
from worker.stop_strings import checked_from, stop_cut

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

# Asked after each decoding step with the number of new tokens so far; a reason string stops.
Watch = Callable[[int], str | None]


class Sampler:
    """The next token of one sequence from its logits: the model's own logits processors (as
    `generate` builds them for these settings), then argmax or a draw from this sequence's own
    generator."""

    def __init__(self, model: Any, settings: dict, prompt_tokens: int, seed: int | None, device: str) -> None:
        config, _ = model._prepare_generation_config(None, **settings)  # what generate would use
        self.processors = model._get_logits_processor(
            generation_config=config, input_ids_seq_length=prompt_tokens, device=device, model_kwargs={}
        )
        self.do_sample = bool(config.do_sample)
        self.generator: torch.Generator | None = None
        if self.do_sample:
            self.generator = torch.Generator(device=device)
            if seed is not None:
                self.generator.manual_seed(seed)
            else:
                self.generator.seed()

    @property
    def plain(self) -> bool:
        """Greedy with no logits processor: the batch's one argmax picks this row's token."""
        return not self.do_sample and not len(self.processors)

    def pick(self, ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The next token as a 0-d tensor on the logits' device (no host synchronisation).
        `ids` is the sequence's tokens so far `[1, n]` (a view: never rebuilt), `logits` `[1, V]`
        float32."""
        scores = self.processors(ids, logits) if len(self.processors) else logits
        if self.do_sample:
            probs = torch.nn.functional.softmax(scores, dim=-1)
            return torch.multinomial(probs, num_samples=1, generator=self.generator)[0, 0]
        return torch.argmax(scores, dim=-1)[0]


def stop_window(stops: list[str]) -> int:
    """Tokens that always cover the longest stop string: a token decodes to at least one character
    except for pieces of a multi-byte character (at most 4 bytes each)."""
    return 4 * max(len(stop) for stop in stops) + 4 if stops else 0


@dataclass
class TokenScores:
    """Log-probabilities of scored tokens: `values[i]` is the log-probability of `tokens[i]` (None:
    nothing predicted it, a trace's first token), `top_ids[i]`/`top_values[i]` the `k` likeliest
    tokens at that position, `ranks[i]` the rank of `tokens[i]` there (how many tokens are at
    least as likely, itself included: 1 for the likeliest; vLLM's count); from the raw logits
    (log_softmax in float32, before any sampling setting)."""

    k: int
    tokens: list[int] = field(default_factory=list)
    values: list[float | None] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_values: list[list[float]] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)

    def unpredicted(self, token: int) -> None:
        """A text's first token: nothing predicts it."""
        self.tokens.append(token)
        self.values.append(None)
        self.top_ids.append([])
        self.top_values.append([])
        self.ranks.append(None)

    def truncate(self, entries: int) -> None:
        """Keep the first `entries` entries (a rolled-back step's are dropped)."""
        for column in (self.tokens, self.values, self.top_ids, self.top_values, self.ranks):
            del column[entries:]

    def add(self, logits: torch.Tensor, tokens: torch.Tensor) -> None:
        """Score `tokens` `[n]` against the logits `[n, V]` of the positions that predicted them,
        SCORE_ROWS positions at a time: the float32 log-softmax of a block is the most this holds
        beside the logits, never a copy of all `[n, V]`."""
        for start in range(0, int(tokens.shape[0]), SCORE_ROWS):
            self._add(logits[start : start + SCORE_ROWS], tokens[start : start + SCORE_ROWS])

    def _add(self, logits: torch.Tensor, tokens: torch.Tensor) -> None:
        # a token the model rules out (-inf) as the lowest finite float32: JSON has no infinity
        logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1).clamp_(min=torch.finfo(torch.float32).min)
        chosen = logprobs.gather(1, tokens.view(-1, 1).to(logprobs.device))
        self.tokens += [int(t) for t in tokens.tolist()]
        self.values += [float(v) for v in chosen[:, 0].tolist()]
        self.ranks += [int(r) for r in (logprobs >= chosen).sum(dim=-1).tolist()]
        if self.k:
            top = torch.topk(logprobs, self.k, dim=-1)
            self.top_ids += top.indices.tolist()
            self.top_values += top.values.tolist()
        else:
            self.top_ids += [[] for _ in range(len(tokens))]
            self.top_values += [[] for _ in range(len(tokens))]


def score_rows(scores: list[TokenScores], logits: torch.Tensor, tokens: list[int]) -> None:
    """`TokenScores.add` for many rows at once: row i of `logits` `[n, V]` predicted `tokens[i]`
    for `scores[i]`; one log-softmax over the rows and one transfer of the results to the host."""
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1).clamp_(min=torch.finfo(torch.float32).min)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device).view(-1, 1))
    k = max(s.k for s in scores)
    ranks = (logprobs >= chosen).sum(dim=-1, keepdim=True)
    parts = [chosen.to(torch.float64), ranks.to(torch.float64)]
    if k:
        top = torch.topk(logprobs, k, dim=-1)
        parts += [top.values.to(torch.float64), top.indices.to(torch.float64)]  # ids < 2**53: exact
    host = torch.cat(parts, dim=1).tolist()
    for row, token, line in zip(scores, tokens, host, strict=True):
        row.tokens.append(token)
        row.values.append(line[0])
        row.ranks.append(int(line[1]))
        row.top_ids.append([int(i) for i in line[2 + k : 2 + k + row.k]])
        row.top_values.append(line[2 : 2 + row.k])


@dataclass(eq=False)  # a sequence is itself: compared by identity
class Sequence:
    """One job's sequence. `ended` says why it left the batch: eos, length, stop (a stop string,
    or the reply's grammar is complete), watch, failed, trace (a trace job: one forward pass over
    its text, nothing generated)."""

    prompt_ids: torch.Tensor  # [1, P] on the model's device
    max_tokens: int  # 0 for a trace job
    sampler: Sampler | None  # None for a trace job
    capture: JobCapture | None = None
    stops: list[str] = field(default_factory=list)
    min_tokens: int = 0  # no stop string counts before this many tokens (worker/stop_strings.py)
    watch: Watch | None = None
    tag: object = None  # the caller's handle
    scores: TokenScores | None = None  # log-probabilities, when the job asked for them
    completion: tuple[int, int] | None = None  # a trace's final assistant turn, [start, stop)
    edits: JobEdits | None = None  # its interventions (worker/edits.py)
    echo: bool = False  # a generation that also scores its prompt (its prefill keeps every position's logits)
    constraint: Constraint | None = None  # the grammar its reply follows (worker/constrained.py)
    sampling: RowSampling | None = None  # its settings for the vectorised sampler (the slots' decoder)
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
    """The running batch of one model. Not thread-safe: one thread drives it (the engine core)."""

    def __init__(self, model: Any, tokenizer: PreTrainedTokenizerBase, pad_id: int) -> None:
        self.model, self.tokenizer, self.pad_id = model, tokenizer, pad_id
        eos = model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        self.logits_to_keep = model._supports_logits_to_keep()
        self.hooks = BatchHooks(model)
        self.edits = BatchEdits(model)
        self.rows: list[Sequence] = []
        self.cache: Any = None
        self.ids = self.mask = self.pos = torch.empty(0, 0, dtype=torch.long)
        self.pads: list[int] = []  # each row's leading padding columns (kept on the host: no sync to ask)
        self.most_rows: int | None = None  # lowered when a step ran out of memory
        # Prompts longer than this are fed in chunks between decoding steps (`feed`); None: never
        # (the engine core sets it when it runs batches: a batch of one stays exactly `generate`).
        self.chunk_tokens: int | None = None
        out = model.get_output_embeddings()
        self.lm_head = next((path for path, module in model.named_modules() if module is out), None)

    def close(self) -> None:
        self.hooks.__exit__()
        self.edits.close()

    # -- the KV cache's memory (the slots' decoder sizes its cache; this one's follows its rows) --

    def must_wait(self, joining: list[Sequence]) -> bool:
        """Whether `joining` must wait for running rows to leave (a cap on the KV cache's bytes)."""
        return False

    def idle(self) -> None:
        """Nothing runs: a chance to give memory back."""

    def cache_size(self) -> tuple[int, int, int]:
        """The KV cache held between steps: (bytes, slots, positions per slot); zeros when none is kept."""
        return (0, 0, 0)

    # -- one forward pass ----------------------------------------------------------------

    def _forward(
        self,
        ids,
        mask,
        pos,
        cache,
        new: int,
        rows: list[Sequence],
        first: bool,
        padded: bool,
        lengths: list[int] | None = None,  # a left-padded prefill: each row's own prompt length
        echo: bool = False,  # a prefill whose rows that ask for it score their prompts
    ) -> torch.Tensor:
        """The last position's logits `[B, V]` (float32) of feeding `new` positions; each row's
        capture gets its rows. `generate` drops an all-ones mask, and so does this (`padded`
        says whether any row has padding, from the host's count: asking the mask would sync).
        With `echo`, every position's logits are computed and each echo row's prompt scored."""
        self.hooks.use([row.capture for row in rows], lengths, decoding=not first and new == 1)
        edits = [row.edits for row in rows]
        spans: list[tuple[int, int]] = []
        if any(e is not None for e in edits):
            if first:  # a prompt pass: every row's prompt, right-aligned in `new` columns
                spans = [(0, row.prompt_tokens) for row in rows]
            else:  # a decoding step: each row's newest token
                spans = [(row.prompt_tokens + len(row.generated) - 1, 1) for row in rows]
        self.edits.use(edits, spans, new)
        extra = {"logits_to_keep": 0 if echo else 1} if self.logits_to_keep else {}
        inputs = self.model.prepare_inputs_for_generation(
            ids,
            next_sequence_length=new,
            past_key_values=cache,
            attention_mask=mask if padded else None,
            position_ids=pos,
            use_cache=True,
            is_first_iteration=first,
            **extra,
        )
        out = self.model(**inputs, return_dict=True)
        logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)
        if echo:
            for index, row in enumerate(rows):
                if row.echo and row.scores is not None:
                    self._score_chunk(row, out.logits[index, new - row.prompt_tokens :], 0, row.prompt_tokens)
        self.hooks.flush()  # last: this pass's staged rows count once the pass cannot fail any more
        self.edits.flush()
        for index, failure in self.hooks.failures.items():
            rows[index].failure = failure
        return logits

    # -- joining ---------------------------------------------------------------------------

    def admit(self, seq: Sequence) -> None:
        """`admit_many` for one sequence: its prompt runs alone, exactly as a solo job's."""
        self.admit_many([seq])

    def admit_many(self, seqs: list[Sequence]) -> None:
        """Run the prompts of `seqs` in one pass (left-padded to the longest, each position id
        counting its own tokens; one sequence: the plain pass), pick each one's first token, and
        add those it did not end to the batch. All or nothing: on any failure the batch is as it
        was and each sequence as before the call (captures, scores, sampler state), so the
        caller may run them again one at a time."""
        saved = [Undo.of(seq) for seq in seqs]
        try:
            self._admit_many(seqs)
        except BaseException:
            for undo in saved:
                undo.apply()
            raise

    def _prompt_pass(self, seqs: list[Sequence]) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """The prompts of `seqs` in one left-padded pass and each one's first token: (the pass's
        cache, its ids, mask and positions `[n, width]`, each row's padding)."""
        lengths = [seq.prompt_tokens for seq in seqs]
        width = max(lengths)
        ids = torch.cat([self._pad(seq.prompt_ids, width, self.pad_id) for seq in seqs])
        mask = torch.cat([self._pad(torch.ones_like(seq.prompt_ids), width, 0) for seq in seqs])
        pos = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = kvcache.new_cache(self.model.config)
        padded = min(lengths) < width
        echo = any(seq.echo for seq in seqs)  # the scheduler groups echo prefills apart
        logits = self._forward(ids, mask, pos, cache, width, seqs, True, padded, lengths if padded else None, echo)
        self._advance(seqs, logits, lambda i: seqs[i].prompt_ids)
        return cache, ids, mask, pos, [width - n for n in lengths]

    def _admit_many(self, seqs: list[Sequence]) -> None:
        cache, ids, mask, pos, pads = self._prompt_pass(seqs)
        width = ids.shape[1]
        going = [i for i, seq in enumerate(seqs) if not seq.ended]
        if not going:
            return
        if len(going) < len(seqs):  # some ended with their first token: only the others join
            cache = kvcache.select(cache, going, width)
            ids, mask, pos = ids[going], mask[going], pos[going]
        self._join([seqs[i] for i in going], cache, ids, mask, pos, [pads[i] for i in going])

    def _join(self, joining: list[Sequence], cache: Any, ids, mask, pos, pads: list[int]) -> None:
        """Add prefilled sequences (their first token chosen) to the running batch: `ids`, `mask`
        and `pos` `[n, width]` cover their prompts (`pads` leading padding columns each) and
        `cache` holds those `width` positions. All or nothing."""
        width = ids.shape[1]
        tokens = torch.tensor([[seq.generated[-1]] for seq in joining], dtype=ids.dtype, device=ids.device)
        ids = torch.cat([ids, tokens], 1)
        mask = torch.cat([mask, mask.new_ones(len(joining), 1)], 1)
        pos = torch.cat([pos, pos[:, -1:] + 1], 1)
        if not self.rows:
            self.rows, self.cache, self.ids, self.mask, self.pos, self.pads = joining, cache, ids, mask, pos, pads
            return
        # All or nothing: the new tensors first, then the cache (kvcache.concat puts every layer
        # back if it fails), then the swap; a failure leaves the running batch as it was.
        timeline = self.ids.shape[1]
        columns = max(timeline, width + 1)
        new_ids = torch.cat([self._pad(self.ids, columns, self.pad_id), self._pad(ids, columns, self.pad_id)])
        new_mask = torch.cat([self._pad(self.mask, columns, 0), self._pad(mask, columns, 0)])
        new_pos = torch.cat([self._pad(self.pos, columns, 0), self._pad(pos, columns, 0)])
        self.cache, _ = kvcache.concat([self.cache, cache], [timeline - 1, width])
        self.ids, self.mask, self.pos = new_ids, new_mask, new_pos
        self.pads = [pad + columns - timeline for pad in self.pads] + [pad + columns - (width + 1) for pad in pads]
        self.rows += joining

    def reset(self) -> None:
        """Drop the running batch (after a step failed: its rows were answered with the failure)."""
        self.hooks.discard()
        self.rows, self.cache, self.pads = [], None, []
        self.ids, self.mask, self.pos = self.ids[:0], self.mask[:0], self.pos[:0]

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
        if self.logits_to_keep and not any(self.wants_logits(s) for s in seqs):
            inputs["logits_to_keep"] = 1  # nobody needs every position's logits: skip the vocabulary projection
        self.hooks.use([s.capture for s in seqs], lengths)
        self.edits.use([s.edits for s in seqs], [(0, n) for n in lengths], width)
        try:
            out = self.model(**inputs, use_cache=False, return_dict=True)
        finally:
            self.hooks.lengths = None
        self.edits.flush()
        for index, seq in enumerate(seqs):
            seq.failure = seq.failure or self.hooks.failures.get(index)
            if seq.failure is None and seq.scores is not None:
                first = width - lengths[index]
                seq.scores.unpredicted(int(seq.prompt_ids[0, 0]))
                seq.scores.add(out.logits[index, first : width - 1], seq.prompt_ids[0, 1:].to(device))
            seq.ended = "failed" if seq.failure is not None else "trace"

    def wants_logits(self, seq: Sequence) -> bool:
        """Whether a sequence's prompt pass needs the logits of every position: a generation that
        scores its prompt (`echo`); a trace that asked for log-probabilities, or captures the
        vocabulary projection (which then runs on every position, not only the last). The
        scheduler never puts it in a pass with sequences that do not (what one job costs never
        depends on its batch-mates)."""
        if not seq.trace:
            return seq.echo
        if seq.scores is not None:
            return True
        return seq.capture is not None and any(module == self.lm_head for module, _ in seq.capture.wanted)

    # -- prompts in chunks -----------------------------------------------------------------

    def feed(self, item: Feeding, most: int) -> bool:
        """Feed the next `most` positions of `item`'s prompt (or trace text) through the model,
        with the sequence's own cache: its captures and log-probabilities get their rows. True
        once the whole text is fed: a trace has then ended ("trace"), and a generation has its
        first token and joined the running batch (or ended with it). Raises on failure: the
        sequence alone fails, the running batch is untouched."""
        seq = item.seq
        total, start = seq.prompt_tokens, item.fed
        end = min(total, start + most)
        if item.cache is None:
            item.cache = kvcache.new_cache(self.model.config)
        whole = self.wants_logits(seq)  # every position's logits, this chunk's only
        extra = {"logits_to_keep": 0 if whole else 1} if self.logits_to_keep else {}
        ids = seq.prompt_ids[:, :end]
        pos = torch.arange(end, device=ids.device).unsqueeze(0)
        self.hooks.use([seq.capture], None)
        self.edits.use([seq.edits], [(start, end - start)], end - start)
        if seq.capture is not None:
            seq.capture.chunk = (start, end - start)
        try:
            inputs = self.model.prepare_inputs_for_generation(
                ids,
                next_sequence_length=end - start,
                past_key_values=item.cache,
                attention_mask=None,
                position_ids=pos,
                use_cache=True,
                is_first_iteration=start == 0,
                **extra,
            )
            out = self.model(**inputs, return_dict=True)
        finally:
            if seq.capture is not None:
                seq.capture.chunk = None
        self.edits.flush()
        if (failure := self.hooks.failures.get(0)) is not None:
            seq.failure, seq.ended = failure, "failed"
            return True
        item.fed = end
        if seq.scores is not None and (seq.trace or seq.echo):
            self._score_chunk(seq, out.logits[0], start, end)
        if seq.trace:
            if end == total:
                seq.ended = "trace"
            return end == total
        if end < total:
            return False
        logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)
        self._advance([seq], logits, lambda _: seq.prompt_ids)
        if seq.ended is None:
            ones = torch.ones_like(seq.prompt_ids)
            self._join([seq], item.cache, seq.prompt_ids, ones, pos, [0])
        item.cache = None
        return True

    @staticmethod
    def _score_chunk(seq: Sequence, logits: torch.Tensor, start: int, end: int) -> None:
        """The log-probabilities of the prompt (a trace's text) tokens that positions [start, end)
        predict, from those positions' logits."""
        scores = seq.scores
        assert scores is not None
        if start == 0:
            scores.unpredicted(int(seq.prompt_ids[0, 0]))
        last = min(end, seq.prompt_tokens - 1)  # the text's last position predicts nothing
        if last > start:
            scores.add(logits[: last - start], seq.prompt_ids[0, start + 1 : last + 1].to(logits.device))

    # -- one decoding step -----------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Feed every row's newest token; returns the rows that ended (already removed)."""
        if not self.rows:
            return []
        timeline = self.ids.shape[1] - 1
        logits, self.cache, _ = self._run(self.rows, self.ids, self.mask, self.pos, self.cache, timeline, top=True)
        if logits is not None:
            self._advance(self.rows, logits)
        ending = {i for i, row in enumerate(self.rows) if row.ended is not None and row.ended != VACANT}
        if ending:
            self.hooks.drain(ending, [row.capture for row in self.rows])  # the ending rows take their steps
            for row in self.rows:
                if row.failure is None and row.capture is not None and row.capture.failure is not None:
                    row.failure = row.capture.failure
                    row.ended = row.ended if row.ended is not None else "failed"
        tokens = [row.generated[-1] if row.generated else self.pad_id for row in self.rows]
        device = self.ids.device
        try:
            ids = append_column(self.ids, torch.tensor(tokens, dtype=self.ids.dtype, device=device))
            mask = append_column(self.mask, 1)
            pos = append_column(self.pos, self.pos[:, -1] + 1)
        except Exception as exc:  # noqa: BLE001 - rows that ended keep their results; the others cannot go on
            failure = failure_of(exc)
            for row in self.rows:
                if row.ended is None:
                    row.failure, row.ended = failure, "failed"
            ended = [row for row in self.rows if row.ended != VACANT]
            self.reset()
            return ended
        self.ids, self.mask, self.pos = ids, mask, pos
        return self._remove_ended()

    def _run(self, rows, ids, mask, pos, cache, timeline: int, top: bool = False):
        """One step for `rows`: (their logits `[B, V]`, or None when every row failed; the cache;
        its timeline). On running out of memory the rows are split in halves run one after the
        other, down to one row, which then fails alone (its logits row is zeros, unread); batches
        are capped at the half from then on."""
        self.hooks.settle([row.capture for row in rows])  # staged steps of another batch, before the marks
        saved = kvcache.snapshot(cache)
        marks = [row.capture.mark() if row.capture else None for row in rows]
        pads = self.pads if top else [int(p) for p in (mask == 0).sum(dim=1).tolist()]  # halves: rare
        try:
            logits = self._forward(ids, mask, pos, cache, 1, rows, first=False, padded=any(pads))
            return logits, cache, timeline + 1
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
            if rows[0].ended is None:  # not a vacancy (nobody's row)
                rows[0].failure = out_of_memory()
                rows[0].ended = "failed"
            return None, cache, timeline
        half = len(rows) // 2
        if top:  # the next batches stay at the half
            self.most_rows = min(self.most_rows or len(rows), half)
            log.warning("out of memory at a batch of %d: running it in halves; batches now at most %d", len(rows), half)
        parts: list[tuple[torch.Tensor | None, int]] = []
        caches, timelines = [], []
        for part in (slice(0, half), slice(half, len(rows))):
            indices = list(range(len(rows)))[part]
            sub = kvcache.select(cache, indices, timeline)
            got, sub, after = self._run(rows[part], ids[part], mask[part], pos[part], sub, timeline)
            parts.append((got, len(indices)))
            caches.append(sub)
            timelines.append(after)
        merged, after = kvcache.concat(caches, timelines)
        present = [got for got, _ in parts if got is not None]
        if not present:
            return None, merged, after
        width = present[0].shape[1]
        return (
            torch.cat([got if got is not None else present[0].new_zeros(n, width) for got, n in parts]),
            merged,
            after,
        )

    def _advance(
        self, rows: list[Sequence], logits: torch.Tensor, ids_of: Callable[[int], torch.Tensor] | None = None
    ) -> None:
        """Each running row's next token from `logits` `[B, V]`, its log-probabilities when asked,
        and whether it ended. One transfer to the host for the tokens and one for the scores,
        whatever the batch size; a failure in one row's own sampling or scoring fails that row."""
        for row in rows:
            if row.failure is None and row.capture is not None:
                row.failure = row.capture.failure  # rows handed over late that did not fit
            if row.ended is None and row.failure is not None:
                row.ended = "failed"
        live = [i for i, row in enumerate(rows) if row.ended is None]
        if not live:
            return
        try:
            tokens = self._choose(rows, logits, live, ids_of or self._row_ids)
            self.hooks.synced(logits.device)  # the tokens' read waited for this step's staged copies too
        except Exception as exc:  # noqa: BLE001 - the batch's argmax failed: the rows it served fail
            failure = failure_of(exc)
            for i in live:
                rows[i].failure, rows[i].ended = failure, "failed"
            return
        scored = [i for i in live if rows[i].scores is not None and rows[i].ended is None]
        if scored:
            try:
                index = torch.tensor(scored, device=logits.device)
                score_rows([rows[i].scores for i in scored], logits[index], [tokens[i] for i in scored])  # type: ignore[misc]
            except Exception as exc:  # noqa: BLE001 - scoring failed: the rows that asked for it fail
                failure = failure_of(exc)
                for i in scored:
                    rows[i].failure, rows[i].ended = failure, "failed"
        for i in live:
            if rows[i].ended is None:
                try:
                    self._take(rows[i], tokens[i])
                except Exception as exc:  # noqa: BLE001 - one row's stop check or watch fails that row only
                    rows[i].failure, rows[i].ended = failure_of(exc), "failed"

    def _row_ids(self, index: int) -> torch.Tensor:
        """Row `index`'s tokens so far `[1, n]`: a view of the batch's ids, without its padding."""
        return self.ids[index : index + 1, self.pads[index] :]

    def _choose(
        self, rows: list[Sequence], logits: torch.Tensor, live: list[int], ids_of: Callable[[int], torch.Tensor]
    ) -> list[int]:
        """The next token of every row (garbage for rows not in `live`): one argmax over the batch
        for greedy rows, each sampled row's own processors and generator on its row of logits,
        the rows with a constraint from a masked copy of theirs (`_constrain`), then a single
        transfer to the host."""
        picks = torch.argmax(logits, dim=-1)
        constrained = [i for i in live if rows[i].constraint is not None]
        masked = self._constrain(rows, logits, picks, constrained) if constrained else {}
        for i in live:
            sampler = rows[i].sampler
            assert sampler is not None  # only trace sequences have none, and they never decode
            if sampler.plain or rows[i].ended is not None:  # greedy: picked above; or its mask failed
                continue
            try:
                picks[i] = sampler.pick(ids_of(i), masked[i] if i in masked else logits[i : i + 1])
            except Exception as exc:  # noqa: BLE001 - this row's sampling fails this row only
                rows[i].failure = failure_of(exc)
                rows[i].ended = "failed"
        return picks.tolist()

    @staticmethod
    def _constrain(
        rows: list[Sequence], logits: torch.Tensor, picks: torch.Tensor, constrained: list[int]
    ) -> dict[int, torch.Tensor]:
        """Rows `constrained` with every token their grammar forbids masked out: a masked copy of
        those rows (one bitmask fill for all of them), whose argmax is the greedy ones' pick;
        returns each row's masked logits `[1, V]` for its sampler. `logits` itself stays the
        model's (log-probabilities score it). If the mask fails, the rows it served fail."""
        try:
            index = torch.tensor(constrained, device=logits.device)
            masked = masked_rows(logits, index, [rows[i].constraint for i in constrained])  # type: ignore[misc]
            picks[index] = torch.argmax(masked, dim=-1)
        except Exception as exc:  # noqa: BLE001 - the mask failed: the rows it served fail
            failure = failure_of(exc)
            for i in constrained:
                rows[i].failure, rows[i].ended = failure, "failed"
            return {}
        return {i: masked[j : j + 1] for j, i in enumerate(constrained)}

    def _take(self, row: Sequence, token: int) -> None:
        """Add `row`'s next token and decide whether it ended. A row with a constraint takes the
        token into its matcher too, and ends ("stop") once its grammar is complete: the mask
        would allow nothing but EOS, so the step that would pick it is saved."""
        row.generated.append(token)
        count = len(row.generated)
        constraint = row.constraint
        if constraint is not None and not constraint.consume(token):
            row.failure, row.ended = InternalError(constraint.error or "the grammar refused a token"), "failed"
        elif token in self.eos_ids:
            row.ended = "eos"
        elif count >= row.max_tokens:
            row.ended = "length"
        elif constraint is not None and constraint.done:
            row.ended = "stop"
        elif row.stops and count > row.min_tokens and self._hit_stop(row):
            row.ended = "stop"
        elif row.watch is not None and (why := row.watch(count)) is not None:
            row.ended, row.stopped_by = "watch", why

    def _hit_stop(self, row: Sequence) -> bool:
        """transformers' own `stop_strings` criterion walks the whole vocabulary per set of stop
        strings (seconds per job); this decodes only the tail that could hold one. A stop string
        must end beyond the text of the first `min_tokens` tokens (worker/stop_strings.py)."""
        lo = max(len(row.generated) - stop_window(row.stops), 0)

        def decode(ids: list[int]) -> str:
            return cast(str, self.tokenizer.decode(ids))  # one sequence: one str

        held = checked_from(decode, row.generated[lo:], row.min_tokens - lo)
        return stop_cut(decode(row.generated[lo:]), row.stops, held) is not None

    def _remove_ended(self) -> list[Sequence]:
        """The rows that ended this step, out of the batch. Never raises: the ended rows are the
        answer whatever happens; if the smaller batch cannot be built (out of memory while copying
        the cache), each ended row's place is taken by a vacancy, a row that feeds padding and
        belongs to no job, and the next step tries again."""
        ended = [row for row in self.rows if row.ended is not None and row.ended != VACANT]
        if not ended:
            return []
        keep = [i for i, row in enumerate(self.rows) if row.ended is None]
        try:
            self._keep(keep)
        except Exception as exc:  # noqa: BLE001 - the batch goes on with vacancies
            log.warning(
                "could not shrink the batch (%s: %s): %d vacant rows ride along", type(exc).__name__, exc, len(ended)
            )
            self.rows = [row if row.ended is None or row.ended == VACANT else vacancy(self.pad_id) for row in self.rows]
        return ended

    def _keep(self, keep: list[int]) -> None:
        """The batch of rows `keep` only, built first and swapped in whole."""
        if not keep:
            self.reset()
            return
        timeline = self.ids.shape[1] - 1
        cache = kvcache.select(self.cache, keep, timeline)
        ids, mask, pos = self.ids[keep], self.mask[keep], self.pos[keep]
        pads = [self.pads[i] for i in keep]
        drop = min(pads)  # padding every remaining row has
        if drop:
            kvcache.crop_left(cache, drop, timeline)
            ids, mask, pos = ids[:, drop:], mask[:, drop:], pos[:, drop:]
        self.hooks.compact([row.capture for row in self.rows], keep)  # last before the swap: all or nothing
        self.rows = [self.rows[i] for i in keep]
        self.cache, self.ids, self.mask, self.pos = cache, ids, mask, pos
        self.pads = [pad - drop for pad in pads]


@dataclass
class Undo:
    """What a prefill changes in a sequence, to put back when the prefill fails."""

    seq: Sequence
    mark: Mark | None
    scores: int
    generator: torch.Tensor | None
    edits: list[int] | None = None
    constrained: int = 0  # tokens its constraint had taken

    @classmethod
    def of(cls, seq: Sequence) -> Undo:
        generator = seq.sampler.generator if seq.sampler is not None else None
        return cls(
            seq,
            seq.capture.mark() if seq.capture is not None else None,
            len(seq.scores.values) if seq.scores is not None else 0,
            generator.get_state() if generator is not None else None,
            seq.edits.saved() if seq.edits is not None else None,
            seq.constraint.consumed if seq.constraint is not None else 0,
        )

    def apply(self) -> None:
        seq = self.seq
        if seq.capture is not None and self.mark is not None:
            seq.capture.reset(self.mark)
            seq.capture.failure = None
        if seq.scores is not None:
            seq.scores.truncate(self.scores)
        if self.generator is not None and seq.sampler is not None and seq.sampler.generator is not None:
            seq.sampler.generator.set_state(self.generator)
        if seq.edits is not None and self.edits is not None:
            seq.edits.restore(self.edits)
        if seq.constraint is not None:
            seq.constraint.rollback_to(self.constrained)
        seq.generated.clear()
        seq.ended = seq.stopped_by = seq.failure = None


COLUMN_ROOM = 64  # spare columns allocated with the batch's ids, mask and positions


def append_column(view: torch.Tensor, column: torch.Tensor | int) -> torch.Tensor:
    """`view` `[B, L]` with one more column: written into spare room of its storage when it has
    some (a view of a wider allocation: no copy of the L columns, no allocation), else into a
    new allocation with COLUMN_ROOM spare columns. What `view` shows never changes."""
    rows, width = view.shape
    stride = view.stride(0)
    last = view.storage_offset() + (rows - 1) * stride + width  # the element the new column ends at
    room = rows and width and view.stride(1) == 1 and view.storage_offset() % stride + width < stride
    if room and view.untyped_storage().nbytes() > last * view.element_size():
        grown = view.as_strided((rows, width + 1), view.stride())
    else:
        grown = view.new_empty((rows, width + COLUMN_ROOM))[:, : width + 1]
        grown[:, :width] = view
    grown[:, width] = column
    return grown


@dataclass(eq=False)
class Feeding:
    """A sequence whose prompt is being fed in chunks (`Decoder.feed`): its own cache so far and
    how many positions it holds."""

    seq: Sequence
    cache: Any = None
    fed: int = 0


VACANT = "vacant"  # `Sequence.ended` of a vacancy


def vacancy(pad_id: int) -> Sequence:
    """A batch row that belongs to no job: it feeds `pad_id`, nothing reads its logits, and it
    leaves with the next rows that end."""
    return Sequence(
        prompt_ids=torch.empty(1, 0, dtype=torch.long), max_tokens=1, sampler=None, generated=[pad_id], ended=VACANT
    )
