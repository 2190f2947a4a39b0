"""How large the slots' KV cache is (worker/model/slots.py): how many slots of how many positions, for
the rows that run. Decided here, from what the rows need; applied by the running batch
(worker/batch/slot_decoding.py), which copies every live row over and drops the graphs of the old shape.

- Grown when a sequence joins that needs more: more slots (up to the batch's), or longer ones (its
  prompt and max_tokens), each to the next power of two, slots at least FIRST_SLOT_TOKENS long,
  never past the model's context unless a sequence needs it. Its memory then follows the most rows
  that ran at once and the longest one, never more than about twice each.
- Shrunk when the rows that needed it have left: once the running rows (none, when idle) fit a
  smaller shape, the powers of two of what they need, and have for `shrink_seconds`
  (ACTQ_KV_CACHE_SHRINK_SECONDS), so that a stream of long jobs does not resize at every join.
- Capped at `max_bytes` (ACTQ_KV_CACHE_MAX_BYTES, 0: no cap): a shape over it is cut to what the
  rows need exactly; a join that would still pass it waits for rows to leave (the scheduler asks
  the batch first, `must_wait`), and a sequence that would pass it alone is refused at its join
  with an error naming the setting.

Nothing here touches a tensor: shapes are (slots, positions) pairs, sizes are bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.errors import OutOfMemory
from worker.model.runner import bucket

FIRST_SLOT_TOKENS = 256  # the slots' least length
Shape = tuple[int, int]  # (slots, positions per slot)


@dataclass(frozen=True)
class CacheLimits:
    """The settings that bound the slots' cache: its bytes (0: no cap) and how long it stays
    larger than its rows need before it shrinks."""

    max_bytes: int = 0
    shrink_seconds: float = 30.0


class SlotSizing:
    """The cache's shape for a batch of at most `most_slots` rows of a model with `context`
    positions (0: unknown), under `limits` (see the module)."""

    def __init__(self, most_slots: int, context: int, limits: CacheLimits | None = None) -> None:
        self.most_slots, self.context = most_slots, context
        self.limits = limits or CacheLimits()

    def bucketed(self, need: Shape) -> Shape:
        """The powers of two that hold `need` (see the module)."""
        slots, tokens = need
        limit = self.context or max(tokens, FIRST_SLOT_TOKENS)
        return bucket(max(slots, 1), self.most_slots), bucket(tokens, max(limit, tokens), FIRST_SLOT_TOKENS)

    def joined(self, current: Shape | None, need: Shape, position_bytes: int, beside: int) -> Shape | None:
        """The shape for rows that need `need` (the running ones and those joining, `beside` of
        them already running), from `current` (None: no cache yet); None: `current` holds them.
        Raises the join's refusal when even their exact need is over the cap."""
        if current is not None and need[0] <= current[0] and need[1] <= current[1]:
            return None
        grown = self.bucketed(need)
        if current is not None:  # grow, never shrink, at a join: what runs was sized for a reason
            grown = (max(grown[0], current[0]), max(grown[1], current[1]))
        for shape in (grown, self.bucketed(need), need):
            if self.fits(shape, position_bytes):
                return shape
        raise OutOfMemory(self.refusal(need, position_bytes, beside))

    def smaller(self, current: Shape, need: Shape) -> Shape | None:
        """A shape smaller than `current` that still holds `need` (what the running rows need), or
        None when there is nothing to give back."""
        slots, tokens = self.bucketed(need)
        shape = (min(slots, current[0]), min(tokens, current[1]))
        return shape if shape != current else None

    def fits(self, shape: Shape, position_bytes: int) -> bool:
        cap = self.limits.max_bytes
        return not cap or shape[0] * shape[1] * position_bytes <= cap

    def must_wait(self, need: Shape, alone: int, position_bytes: int) -> bool:
        """Whether a join that needs `need` beside the running rows must wait for some to leave:
        over the cap now, and its newest sequence, needing `alone` positions, fits it alone (one
        that does not is let through, to be refused at once rather than after the batch drained)."""
        if not position_bytes or self.fits(need, position_bytes):
            return False
        return self.fits((1, alone), position_bytes)

    def refusal(self, need: Shape, position_bytes: int, beside: int) -> str:
        slots, tokens = need
        size = slots * tokens * position_bytes
        who = f"this job and the {beside} running beside it" if beside else "this job alone"
        return (
            f"the KV cache for {who} needs {size:,} bytes ({slots} slots of {tokens} positions), over the "
            f"worker's cap of {self.limits.max_bytes:,} bytes (ACTQ_KV_CACHE_MAX_BYTES); ask for fewer "
            "max_tokens or a shorter prompt"
        )
