"""Which job a batch row belonged to, remembered without keeping the job's buffers alive.

A decoder keeps what it built for a batch (capture rings, edit hooks, edit table rows) while the
same jobs hold the same rows. It remembers each row's job by a weak reference, and a row is "the
same" only when both are empty or the reference still points at that very object. A reference
whose job was freed matches nothing, not even an empty row: a job that ended and was freed must
not hand what it set up (a steering vector in its slot's table row, its capture ring) to the row
that comes next.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any


def remember(row: object | None) -> weakref.ref[Any] | None:
    return None if row is None else weakref.ref(row)


def remember_all(rows: Sequence[object | None]) -> tuple[weakref.ref[Any] | None, ...]:
    return tuple(remember(row) for row in rows)


def same(ref: weakref.ref[Any] | None, row: object | None) -> bool:
    """Whether `row` is the object `ref` remembers (None: no object). A dead reference is never
    the same as anything."""
    if ref is None:
        return row is None
    return row is not None and ref() is row


def same_all(refs: Sequence[weakref.ref[Any] | None], rows: Sequence[object | None]) -> bool:
    return len(refs) == len(rows) and all(same(ref, row) for ref, row in zip(refs, rows, strict=True))
