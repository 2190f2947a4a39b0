"""The served model's gate: trusted code (an nnsight job on the shared engine) runs with it shut,
and every other thread that reads the model's tokenizer or description for a job (preparing a
job, decoding its result or its streamed text, the API's tokenizer calls) passes it open. So no
thread reads what the code may be changing while it runs: its guard (worker/nnsight/guard.py) puts
back the chat template it replaced before anyone renders a prompt with it. Readers share the
gate; a waiting exclusive run goes before readers that come after it, so they cannot starve it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Gate:
    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._readers = 0
        self._shut = False  # an exclusive run holds the gate
        self._waiting = 0  # exclusive runs waiting for the readers in to leave

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Read the model's tokenizer or description for a job (shared with other readers)."""
        with self._changed:
            self._changed.wait_for(lambda: not self._shut and not self._waiting)
            self._readers += 1
        try:
            yield
        finally:
            with self._changed:
                self._readers -= 1
                self._changed.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Run trusted code: no reader is in, and none enters until it is over."""
        with self._changed:
            self._waiting += 1
            self._changed.wait_for(lambda: not self._shut and not self._readers)
            self._waiting -= 1
            self._shut = True
        try:
            yield
        finally:
            with self._changed:
                self._shut = False
                self._changed.notify_all()
