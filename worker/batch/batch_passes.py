"""What every running batch shares (worker/batch/running_batch.py: the compacting one, the slots, the
solo one): the prompt passes, the trace passes, prompts fed in chunks, and each row's next token
and end once a pass has its logits.

A prefill runs the prompts of its sequences in one left-padded pass (`admit_many`; a batch of one
is exactly a solo job's), or, when longer than `chunk_tokens`, in chunks with a cache of their
own between decoding steps (`feed`); then each decoder's `_join` takes the prefilled rows into its
batch. A trace runs one forward pass over each text, no cache, nothing generated. Model inputs
are built by the model's own `prepare_inputs_for_generation`, as `generate` does, and the next
token by the one sampler (worker/model/sampling.py, `_choose`: every row's settings in a table of
the pass's rows); a greedy batch of one therefore computes exactly what `generate` computes for
that sequence (tested bit for bit). A sampled row's draw is a function of its seed and how many
tokens it has generated, so a seeded job gets the same draws whatever else shares its batch and
whichever kind of batch runs it (the slots draw inside their own step, with the same sampler).

Each row's rules once its token is picked (EOS, max_tokens, a complete grammar, a stop string
after `min_tokens`, cancel and time limits) are the output stage's: worker/batch/row_rules.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from worker.batch.row_rules import RowRules
from worker.batch.sequence import Feeding, Sequence, Undo, score_rows
from worker.hooks.capture_hooks import BatchHooks
from worker.hooks.edits import BatchEdits
from worker.hooks.paths import PassRows
from worker.model import kvcache
from worker.model.runner import allowed_tokens
from worker.model.sampling import Features, RowSampling, SamplingTable, sample, token_counts
from worker.rules.constrained import fill_bitmask
from worker.rules.failures import failure_of

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class BatchPasses:
    """The passes and row rules every running batch shares (see the module). Not thread-safe: one
    thread drives it (the engine core)."""

    def __init__(self, model: Any, tokenizer: PreTrainedTokenizerBase, pad_id: int) -> None:
        self.model, self.tokenizer, self.pad_id = model, tokenizer, pad_id
        eos = model.generation_config.eos_token_id
        self.rules = RowRules(tokenizer, set(eos if isinstance(eos, list) else [eos]) if eos is not None else set())
        self.logits_to_keep = model._supports_logits_to_keep()
        self.hooks = BatchHooks(model)
        self.edits = BatchEdits(model)
        self.rows: list[Sequence] = []
        self.most_rows: int | None = None  # lowered when a step ran out of memory
        # Prompts longer than this are fed in chunks between decoding steps (`feed`); None: never
        # (the engine core sets it when it runs batches: a batch of one stays exactly `generate`).
        self.chunk_tokens: int | None = None
        out = model.get_output_embeddings()
        self.lm_head = next((path for path, module in model.named_modules() if module is out), None)
        self._table: SamplingTable | None = None  # the sampler's table of a pass's rows (`_choose`)

    @property
    def eos_ids(self) -> set[int]:
        """The model's end-of-sequence ids (`rules` ends a row on one)."""
        return self.rules.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: set[int]) -> None:
        self.rules.eos_ids = ids

    def close(self) -> None:
        self.hooks.__exit__()
        self.edits.close()

    # -- the KV cache's memory (the slots' decoder sizes its cache; the others' follows their rows) --

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
        echo: bool = False,  # a prefill whose rows that ask for it score their prompts
    ) -> torch.Tensor:
        """The last position's logits `[B, V]` (float32) of feeding `new` positions; each row's
        capture gets its rows. `generate` drops an all-ones mask, and so does this (`padded`
        says whether any row has padding, from the host's count: asking the mask would sync).
        With `echo`, every position's logits are computed and each echo row's prompt scored."""
        if first:  # a prompt pass: every row's prompt, right-aligned in `new` columns
            at = PassRows([(0, row.prompt_tokens) for row in rows], new)
        else:  # a decoding step: each row's newest token
            at = PassRows.step([row.prompt_tokens + len(row.generated) - 1 for row in rows])
        self.hooks.begin([row.capture for row in rows], at)
        self.edits.begin([row.edits for row in rows], at)
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
        with self.edits.record(at), self.hooks.record(at):
            out = self.model(**inputs, return_dict=True)
        logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)
        if echo:
            for index, row in enumerate(rows):
                if row.echo and row.scores is not None:
                    self._score_chunk(row, out.logits[index, new - row.prompt_tokens :], 0, row.prompt_tokens)
        failures = self.hooks.finish()  # last: this pass's staged rows count once the pass cannot fail any more
        self.edits.finish()
        for index, failure in failures.items():
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
        logits = self._forward(ids, mask, pos, cache, width, seqs, True, padded, echo)
        self._advance(seqs, logits, lambda i: seqs[i].prompt_ids)
        return cache, ids, mask, pos, [width - n for n in lengths]

    def _admit_many(self, seqs: list[Sequence]) -> None:
        """The prompt pass of `seqs` (`_prompt_pass`), then the rows it did not end into the batch."""
        raise NotImplementedError

    def _join(self, joining: list[Sequence], cache: Any, ids, mask, pos, pads: list[int]) -> None:
        """Add prefilled sequences (their first token chosen) to the running batch: `ids`, `mask`
        and `pos` `[n, width]` cover their prompts (`pads` leading padding columns each) and
        `cache` holds those `width` positions. All or nothing."""
        raise NotImplementedError

    def reset(self) -> None:
        """Drop the running batch (after a step failed: its rows were answered with the failure)."""
        self.hooks.discard()
        self.rows = []

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
        at = PassRows([(0, n) for n in lengths], width)
        self.hooks.begin([s.capture for s in seqs], at)
        self.edits.begin([s.edits for s in seqs], at)
        try:
            with self.edits.record(at), self.hooks.record(at):
                out = self.model(**inputs, use_cache=False, return_dict=True)
        finally:
            self.hooks.lengths = None
        failures = self.hooks.finish()
        self.edits.finish()
        for index, seq in enumerate(seqs):
            seq.failure = seq.failure or failures.get(index)
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
        at = PassRows([(start, end - start)], end - start)
        self.hooks.begin([seq.capture], at)
        self.edits.begin([seq.edits], at)
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
            with self.edits.record(at), self.hooks.record(at):
                out = self.model(**inputs, return_dict=True)
        finally:
            if seq.capture is not None:
                seq.capture.chunk = None
        failures = self.hooks.finish()
        self.edits.finish()
        if (failure := failures.get(0)) is not None:
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

    # -- each row's next token and end ------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Every running row's next token; returns the rows that ended (out of `rows`)."""
        raise NotImplementedError

    def _advance(
        self, rows: list[Sequence], logits: torch.Tensor, ids_of: Callable[[int], torch.Tensor] | None = None
    ) -> None:
        """Each running row's next token from `logits` `[B, V]`, its log-probabilities when asked,
        and whether it ended. One transfer to the host for the tokens and one for the scores,
        whatever the batch size; a failure in one row's own sampling or scoring fails that row."""
        self.rules.settle(rows)
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
        self.rules.take_all([rows[i] for i in live], [tokens[i] for i in live])

    def _row_ids(self, index: int) -> torch.Tensor:
        """Row `index`'s tokens so far `[1, n]` (its padding left out), for the sampler's penalties."""
        raise NotImplementedError

    def _choose(
        self, rows: list[Sequence], logits: torch.Tensor, live: list[int], ids_of: Callable[[int], torch.Tensor]
    ) -> list[int]:
        """The next token of every row (garbage for rows not in `live`), from the one sampler
        (worker/model/sampling.py) over a table of the pass's rows: each row's settings, its
        tokens so far (`ids_of(i)`, `[1, n]`: penalties and `min_tokens` read them; its draw is a
        function of its seed and how many tokens it has generated) and its grammar's mask (a mask
        that fails fails the rows it served); one argmax when every row is greedy and free, then
        a single transfer to the host."""
        features = Features()
        for i in live:
            features = features | self._settings(rows[i]).features
        constrained = [i for i in live if rows[i].constraint is not None]
        if features == Features() and not constrained:
            return logits.argmax(dim=-1).tolist()  # greedy rows: the batch's one argmax
        table = self._table_for(len(rows), logits)
        for i in live:
            table.set_row(i, self._settings(rows[i]))
        device = logits.device
        generated = torch.tensor([len(row.generated) for row in rows], dtype=torch.int64, device=device)
        penalties = None
        if features.penalties:  # each live row's tokens so far, left-padded: prompt seen, generated counted
            held = {i: ids_of(i)[0] for i in live}
            width = max(len(ids) for ids in held.values())
            ids = torch.zeros(len(rows), width, dtype=torch.int64, device=device)
            seen_from = torch.full((len(rows),), width, dtype=torch.int64, device=device)  # none: a row not live
            for i, tokens in held.items():
                ids[i, width - len(tokens) :] = tokens.to(device)
                seen_from[i] = width - len(tokens)
            last = torch.full_like(seen_from, width - 1)
            penalties = token_counts(ids, seen_from, last, width - generated, logits.shape[1])
        allowed = None
        if constrained:
            try:
                bits = fill_bitmask([rows[i].constraint for i in constrained])  # type: ignore[misc]
                allowed = torch.ones_like(logits, dtype=torch.bool)
                index = torch.tensor(constrained, device=device)
                allowed[index] = allowed_tokens(bits.to(device), logits.shape[1])
            except Exception as exc:  # noqa: BLE001 - the mask failed: the rows it served fail
                failure = failure_of(exc)
                for i in constrained:
                    rows[i].failure, rows[i].ended = failure, "failed"
                allowed = None
        return sample(logits, table, generated, penalties, allowed, features=features).tolist()

    @staticmethod
    def _settings(seq: Sequence) -> RowSampling:
        """A sequence's sampling settings (greedy when it has none: a sequence built by hand;
        `row_sampling` in worker/model/sampling.py makes a job's)."""
        return seq.sampling if seq.sampling is not None else RowSampling()

    def _table_for(self, rows: int, logits: torch.Tensor) -> SamplingTable:
        """A sampling table for a pass's rows (kept for the next pass, grown when too small)."""
        if self._table is None or self._table.slots < rows or self._table.vocab != logits.shape[1]:
            self._table = SamplingTable(rows, logits.shape[1], self.eos_ids, logits.device)
        return self._table
