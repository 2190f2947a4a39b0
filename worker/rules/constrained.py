"""Constrained decoding with llguidance: a job's grammar (shared/grammars.py) as a matcher that
says, before each token, which tokens keep the reply inside the grammar.

- `Grammars`, one per model: llguidance's view of the tokenizer (built on first use: it walks
  the whole vocabulary, see bench/bench_constrained.py for what that costs) and one executor
  that fills many rows' masks in parallel. `constraint(request, fmt)` compiles a job's grammar.
- `Constraint`, one per job: its matcher, and how many tokens it consumed (so a failed prefill
  can put it back, `Undo` in worker/batch/sequence.py).
- `fill_bitmask(constraints)`: the rows' masks as one bitmask, which the sampler unpacks
  (worker/model/runner.py `allowed_tokens`) and applies to the scores it picks from; the step's
  logits themselves are untouched, so log-probabilities keep the model's own distribution.

The mask is a bitmask (one bit per token, int32 words) filled on the host by llguidance, moved
to the logits' device and unpacked there; nothing waits for the device. The matcher's EOS is
the model's (its generation config's `eos_token_id`, e.g. `<|im_end|>` for SmolLM2-Instruct,
not the tokenizer's `<|endoftext|>`): once the grammar is complete, EOS is the only token allowed.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import torch

from shared.errors import JobFailure
from shared.grammars import allows_a_value, grammar_for

if TYPE_CHECKING:
    import llguidance
    from transformers import PreTrainedTokenizerBase

    from shared.schemas import JobRequest
    from shared.tools import ToolFormat

log = logging.getLogger(__name__)

BITS = 32  # tokens per bitmask word


class Grammars:
    """Compiles jobs' grammars for one model. Thread-safe: jobs are prepared on other threads
    than the one that decodes."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_ids: set[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, eos_ids
        self._lock = threading.Lock()
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self.tokenizer_seconds: float | None = None  # what building llguidance's tokenizer took

    @property
    def words(self) -> int:
        """int32 words in one row of the bitmask."""
        return (self.vocab_size + BITS - 1) // BITS

    def lltokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer, built once (the first constrained job pays for it)."""
        with self._lock:
            if self._lltokenizer is None:
                import llguidance
                import llguidance.hf

                started = time.perf_counter()
                eos = sorted(self.eos_ids) or None
                try:
                    self._lltokenizer = llguidance.hf.from_tokenizer(
                        self.tokenizer,  # type: ignore[arg-type]  # a slow one raises the ValueError below
                        n_vocab=self.vocab_size,
                        eos_token=eos,
                    )
                except ValueError as exc:  # llguidance reads fast (Rust) tokenizers only
                    raise JobFailure(
                        f"constrained decoding is not available for this model's tokenizer: {exc}"
                    ) from None
                self._executor = llguidance.LLExecutor()
                self.tokenizer_seconds = time.perf_counter() - started
                log.info("llguidance tokenizer built in %.2f s", self.tokenizer_seconds)
            return self._lltokenizer

    @property
    def executor(self) -> llguidance.LLExecutor:
        self.lltokenizer()
        assert self._executor is not None
        return self._executor

    def constraint(self, request: JobRequest, fmt: ToolFormat | None) -> Constraint | None:
        """The job's constraint, or None when its reply is free. JobFailure when the grammar does
        not compile (the API checks it at submit: this is a request that got past that check)."""
        try:
            grammar = grammar_for(request, fmt)
        except ValueError as exc:
            raise JobFailure(str(exc)) from None
        if grammar is None:
            return None
        return self.compile(grammar)

    def compile(self, grammar: str) -> Constraint:
        """A constraint on llguidance grammar text."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self.lltokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise JobFailure(f"the reply's grammar does not compile: {matcher.get_error()[:500]}")
        if not allows_a_value(matcher, self.vocab_size, self.eos_ids):  # the API refuses these: never "" + "stop"
            raise JobFailure("the reply's grammar allows no value (a `$ref` cycle with no base case?)")
        return Constraint(self, grammar, matcher)


class Constraint:
    """One job's matcher: the tokens its reply may take next, and the tokens it took."""

    def __init__(self, grammars: Grammars, grammar: str, matcher: llguidance.LLMatcher) -> None:
        self.grammars, self.grammar, self.matcher = grammars, grammar, matcher
        self.tokens: list[int] = []  # the tokens taken so far
        self.error: str | None = None  # why the matcher refused a token (a bug: the mask allowed it)

    @property
    def consumed(self) -> int:
        return len(self.tokens)

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but EOS may follow."""
        return bool(self.matcher.is_stopped())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of `bitmask` (`[n, words]` int32, host)."""
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, bitmask, row)

    def consume(self, token: int) -> bool:
        """Take `token` (one the mask allowed); False, with `error` set, if the matcher refuses it
        (the matcher then refuses everything: llguidance's error state is final)."""
        if self.matcher.consume_token(token):
            self.tokens.append(token)
            return True
        reason = (self.matcher.get_error() or "").splitlines()
        self.error = f"token {token} is outside the reply's grammar ({reason[0][:300] if reason else 'refused'})"
        return False

    def rollback_to(self, consumed: int) -> None:
        """Back to the state after the first `consumed` tokens (a prefill that failed is undone).
        A matcher in its error state cannot go back: a new one takes those tokens again."""
        if self.error is not None:
            from llguidance import LLMatcher

            self.matcher = LLMatcher(self.grammars.lltokenizer(), self.grammar, log_level=0)
            self.matcher.consume_tokens(self.tokens[:consumed])
            self.error = None
        elif consumed == 0:
            self.matcher.reset()
        elif consumed < self.consumed:
            self.matcher.rollback(self.consumed - consumed)
        del self.tokens[consumed:]


def fill_bitmask(constraints: list[Constraint]) -> torch.Tensor:
    """The bitmask `[n, words]` (int32, host) of the next tokens each constraint allows, row i for
    `constraints[i]`; many rows are filled in parallel by the model's executor."""
    grammars = constraints[0].grammars
    bitmask = torch.empty((len(constraints), grammars.words), dtype=torch.int32)
    if len(constraints) == 1:
        constraints[0].fill(bitmask, 0)
    else:
        from llguidance.torch import fill_next_token_bitmask_par

        fill_next_token_bitmask_par(grammars.executor, [(c.matcher, i) for i, c in enumerate(constraints)], bitmask)
    return bitmask
