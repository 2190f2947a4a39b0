"""Generation one job at a time, for models whose cache rows cannot move between batches.

worker/model/kvcache.py moves rows of a `DynamicCache` made of attention layers only. State-space,
recurrent, linear-attention and convolution layers (Mamba, Mamba-2, Jamba, RecurrentGemma,
GraniteMoeHybrid, Qwen3-Next, LFM2), static and quantized caches keep a state per sequence that it
cannot pad, split or join, and some models keep that state in their own modules (RecurrentGemma).
Those whose layers are recurrent states, full and sliding-window attention batch in state slots all
the same (worker/batch/state_decoding.py, which runs a job's prompt here); a job alone (one slot) and
the others (static and quantized caches) run `SoloDecoder`: the job's
prompt, then one decoding step at a time, with the model's own cache object built and carried as
`generate` does it (`_sample`): the cache from
`_prepare_cache_for_generation`, the inputs of every pass from `prepare_inputs_for_generation`, and
the cache, positions and mask carried to the next pass by `_update_model_kwargs_for_generation`.
Nothing here reads or rewrites the cache, so whatever state it holds is the model's business, and
a greedy job computes exactly what `generate` computes for it (tested against `generate` with
forward hooks).

Everything else is every batch's (worker/batch/batch_passes.py, worker/batch/row_rules.py): the
next token from the one sampler (worker/model/sampling.py), under the job's grammar when it has
one (`Undo` rolls its matcher back after a failed prefill: worker/rules/constrained.py), the end of
a sequence (EOS, max_tokens, stop strings, a complete grammar, the watch callback),
log-probabilities and the capture hooks (`BatchHooks`, a batch of one).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch

from shared.errors import JobFailure
from worker.batch.batch_passes import BatchPasses
from worker.batch.columns import append_column
from worker.batch.oom import release_cached
from worker.batch.sequence import Feeding, Sequence, Undo
from worker.rules.failures import failure_of, is_oom, out_of_memory

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class SoloDecoder(BatchPasses):
    """The running "batch" of a model whose cache cannot be batched: at most one sequence, and the
    model kwargs `generate` would carry between its forward passes (`state`). Same interface as
    every running batch (worker/batch/running_batch.py): `admit_many` (one sequence), `step`, `trace`, `rows`,
    `most_rows` (1), `reset`, `close`, `hooks`. Not thread-safe: one thread drives it."""

    def __init__(self, model: Any, tokenizer: PreTrainedTokenizerBase, pad_id: int) -> None:
        super().__init__(model, tokenizer, pad_id)
        self.chunk_tokens = None  # a prompt always runs in one pass, as `generate` runs it
        self.most_rows = 1  # the scheduler never takes a second job in beside the running one
        self.state: dict[str, Any] = {}  # the running sequence's model kwargs: its cache, positions, mask
        self.ids = torch.empty(0, 0, dtype=torch.long)  # the running sequence's tokens `[1, n]`: no padding, ever
        params = inspect.signature(model.forward).parameters
        self._takes_mask = "attention_mask" in params
        self._takes_positions = "position_ids" in params

    # -- joining ---------------------------------------------------------------------------

    def admit_many(self, seqs: list[Sequence]) -> None:
        """Run the prompt of the one sequence in `seqs` and pick its first token; it becomes the
        running row unless that token ended it. All or nothing, as `BatchPasses.admit_many`: on
        failure the sequence is as before the call (captures, scores, sampler state) and nothing
        runs. Refuses a second sequence, in the same call or beside a running one."""
        if len(seqs) != 1 or self.rows:
            running = f" while {len(self.rows)} runs" if self.rows else ""
            raise ValueError(
                f"{type(self).__name__} generates one sequence at a time: asked to admit {len(seqs)}{running}"
            )
        seq = seqs[0]
        undo = Undo.of(seq)
        try:
            self._prefill(seq)
        except BaseException:
            undo.apply()
            self.reset()
            raise

    def _prefill(self, seq: Sequence) -> None:
        """The prompt's pass (`generate`'s `_prefill`: every prompt position, a fresh cache), then
        its first token."""
        state = self._start(seq)
        ids = seq.prompt_ids
        inputs = self.model.prepare_inputs_for_generation(
            ids, next_sequence_length=ids.shape[1], is_first_iteration=True, **state
        )
        logits, state = self._pass(seq, inputs, state, decoding=False)
        self._advance([seq], logits, lambda _: seq.prompt_ids)
        if seq.ended is not None:  # its first token ended it: it never runs a step
            return
        self.ids = append_column(ids, seq.generated[-1])
        self.rows, self.state = [seq], state

    def _start(self, seq: Sequence) -> dict[str, Any]:
        """The model kwargs `generate` hands its decoding loop for this prompt (a batch of one,
        no padding): position ids where the model takes them, no attention mask (an all-ones mask
        is dropped, as `generate` drops it, where the model takes one), logits of the last
        position only, and the cache `generate` would make for this model and length."""
        model, ids = self.model, seq.prompt_ids
        config, state = model._prepare_generation_config(None, max_new_tokens=seq.max_tokens, use_cache=True)
        config.prefill_chunk_size = None  # one prompt pass: the captures see every prompt position at once
        state["attention_mask"] = torch.ones_like(ids)
        if self._takes_positions:
            state["position_ids"] = model._prepare_position_ids_for_generation(ids, state)
        if self._takes_mask:
            state["attention_mask"] = None
        if self.logits_to_keep:
            state["logits_to_keep"] = 1
        mode = config.get_generation_mode()
        model._prepare_cache_for_generation(config, state, mode, 1, ids.shape[1] + seq.max_tokens - 1)
        state["use_cache"] = True
        return state

    def _pass(
        self, seq: Sequence, inputs: dict[str, Any], state: dict[str, Any], decoding: bool
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """One forward pass with the sequence's captures: its last position's logits `[1, V]`
        (float32) and the model kwargs for the next pass. The hooks' rows count once the pass
        cannot fail any more (`flush` last), as in `BatchPasses._forward`."""
        self.hooks.use([seq.capture], None, decoding=decoding)
        if decoding:
            span, width = (seq.prompt_tokens + len(seq.generated) - 1, 1), 1
        else:
            span, width = (0, seq.prompt_tokens), seq.prompt_tokens
        self.edits.use([seq.edits], [span], width)
        out = self.model(**inputs, return_dict=True)
        logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)
        state = self.model._update_model_kwargs_for_generation(out, state, is_encoder_decoder=False)
        del out  # the prompt's logits and hidden states go now, not at the next pass
        self.hooks.flush()
        self.edits.flush()
        if (failure := self.hooks.failures.get(0)) is not None:
            seq.failure = failure
        return logits, state

    # -- one decoding step -----------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Feed the running sequence's newest token; returns it once it ended (out of `rows`).
        Out of memory, that sequence fails alone (`OutOfMemory`) and the decoder is empty and
        ready for the next job; any other error propagates (the engine core fails the job)."""
        if not self.rows:
            return []
        seq = self.rows[0]
        try:
            inputs = self.model.prepare_inputs_for_generation(self.ids, next_sequence_length=1, **self.state)
            logits, self.state = self._pass(seq, inputs, self.state, decoding=True)
        except Exception as exc:
            if not is_oom(exc):
                raise
            return self._fail(seq, out_of_memory())
        self._advance([seq], logits)
        if seq.ended is None:
            try:
                self.ids = append_column(self.ids, seq.generated[-1])
            except Exception as exc:  # noqa: BLE001 - this job's failure, never the engine's
                return self._fail(seq, failure_of(exc))
            return []
        self.hooks.drain()  # the staged steps are this sequence's: all of them before it leaves
        if seq.failure is None and seq.capture is not None and seq.capture.failure is not None:
            seq.failure, seq.ended = seq.capture.failure, "failed"
        self.reset()
        return [seq]

    def _fail(self, seq: Sequence, failure: JobFailure) -> list[Sequence]:
        """End the running sequence with `failure` and drop its state (cache, staged captures)."""
        seq.failure, seq.ended = failure, "failed"
        self.reset()
        release_cached()
        return [seq]

    def _row_ids(self, index: int) -> torch.Tensor:
        return self.ids

    def reset(self) -> None:
        """Drop the running sequence and its model kwargs (its cache)."""
        super().reset()
        self.state, self.ids = {}, self.ids[:0]

    # -- what this decoder does not do -----------------------------------------------------

    def trace(self, seqs: list[Sequence]) -> None:
        """`BatchPasses.trace` (one forward pass, no cache), never beside a running generation: a
        model that keeps its recurrent state in its own modules (RecurrentGemma) would have it
        wiped by the pass."""
        if self.rows:
            raise ValueError(f"{type(self).__name__}: a trace pass while a generation runs")
        super().trace(seqs)

    def feed(self, item: Feeding, most: int) -> bool:
        """A prompt handed over to be fed in chunks (a scheduler that set `chunk_tokens`) runs
        whole, as `admit_many` or `trace` runs it: a chunk's cache would have to join a running
        batch, which this model's cache cannot, and with at most one job at a time (`most_rows`)
        nothing decodes beside it to interleave with."""
        seq = item.seq
        if seq.trace:
            self.trace([seq])
        else:
            self.admit_many([seq])
        item.fed = seq.prompt_tokens
        return True
