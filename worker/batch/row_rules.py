"""The output stage: each row's rules once a pass has picked its next token, the same for every
kind of running batch (in slots, in state slots, compacted, one job at a time) and for the first
token a prompt pass picks (vLLM v1's `update_from_output` with its output processor's stop checks).

In order, for a row that has not ended: its own failure so far (its capture's rows that did not
fit) ends it "failed"; the token is taken and advances the row's grammar (a token the grammar
refuses fails the row); then EOS, `max_tokens`, a complete grammar (its mask would allow nothing
but EOS: the step that would pick it is saved), a stop string once past `min_tokens`
(worker/rules/stop_strings.py, on the tail that can hold one), and the job's watch (cancel and time
limits) end it. A rule that raises fails its row and only its row. A new stop rule goes in `take`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

from shared.errors import InternalError
from worker.rules.failures import failure_of
from worker.rules.stop_strings import checked_from, stop_cut

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from worker.batch.sequence import Sequence


def stop_window(stops: list[str]) -> int:
    """Tokens that always cover the longest stop string: a token decodes to at least one character
    except for pieces of a multi-byte character (at most 4 bytes each)."""
    return 4 * max(len(stop) for stop in stops) + 4 if stops else 0


class RowRules:
    """Each row's rules (see the module) for one model: its EOS ids and its tokenizer (stop strings
    are decoded from the row's newest tokens)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_ids: set[int]) -> None:
        self.tokenizer, self.eos_ids = tokenizer, eos_ids

    @staticmethod
    def settle(rows: Iterable[Sequence | None]) -> None:
        """Before a pass's tokens are read: a row whose capture failed (rows handed over late that
        did not fit) takes that failure, and a row with a failure ends "failed"."""
        for row in rows:
            if row is None:
                continue
            if row.failure is None and row.capture is not None:
                row.failure = row.capture.failure
            if row.ended is None and row.failure is not None:
                row.ended = "failed"

    def take_all(self, rows: list[Sequence | None], tokens: list[int]) -> None:
        """`take` each running row's token (`tokens[i]` is row i's; None: no row there); a rule that
        raises fails that row only."""
        for row, token in zip(rows, tokens, strict=True):
            if row is not None and row.ended is None:
                try:
                    self.take(row, token)
                except Exception as exc:  # noqa: BLE001 - one row's stop check or watch fails that row only
                    row.failure, row.ended = failure_of(exc), "failed"

    def take(self, row: Sequence, token: int) -> None:
        """Add `row`'s next token and decide whether it ended (the rules, in order: see the module)."""
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
        must end beyond the text of the first `min_tokens` tokens (worker/rules/stop_strings.py)."""
        lo = max(len(row.generated) - stop_window(row.stops), 0)

        def decode(ids: list[int]) -> str:
            return cast(str, self.tokenizer.decode(ids))  # one sequence: one str

        held = checked_from(decode, row.generated[lo:], row.min_tokens - lo)
        return stop_cut(decode(row.generated[lo:]), row.stops, held) is not None
