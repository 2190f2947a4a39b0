"""Capture at the slots' decoding steps, recorded inside the step: one device ring per captured
(module, hook), written by one `index_copy_` at a device cursor, so a step that captures is
graph-safe and replays as a CUDA graph like one that does not.

A ring is `[steps, slots, W]` on the module's device, in the module's dtype: step k of the ring
holds every slot's value at that step (slots whose row captures nothing write rows nobody reads:
one copy of the whole batch costs less than choosing rows). The cursor is a one-element device
tensor that the step moves on (`advance`), so neither the hook nor the graph reads the host's
count; the host keeps its own copy (`pos`).

Draining, away from the decoding loop. The steps recorded since the last hand-over are a window
of ring rows `[pos - count, pos)`. The loop hands a window over (`hand_over`) when the cursor
reaches half the ring or its end, when a capturing row leaves, before the slots are resized and
before a ring is made. Handing over gathers the rings' rows side by side into one block `[count, slots in
use, sum of W]` and enqueues one copy of it to the host (pinned memory, on a side stream that waits
for the steps that wrote it), and gives the copy, with who each slot's rows are for, to the capture
writer thread. That thread waits for the copy (an event: the loop never waits) and hands each job
its rows, one copy per job whatever the number of points (`JobCapture.keep_block`: positions,
features, dtype, reductions). The next steps write the other half of the ring meanwhile; before a
step writes a ring row whose copy may still be running, the loop's stream waits on that copy's
event (on the device, not the host). A job's result waits for its last window (`JobCapture.settle`).
On the CPU the copy is a clone and the thread does the rest.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from shared.errors import JobFailure
from worker.hooks.capture import Block, JobCapture
from worker.hooks.module_rows import first_input, first_tensor, step_rows
from worker.hooks.paths import PassRows
from worker.hooks.row_identity import remember, remember_all, same, same_all
from worker.rules.failures import failure_of

log = logging.getLogger(__name__)
Key = tuple[str, str]  # (module path, "output" | "input")
WINDOWS_AHEAD = 8  # windows handed over and not yet kept before the loop waits for the writer

# The rings of decoding steps, both kinds: the slots' device rings here and the host staging rings
# of worker/hooks/capture_hooks.py. A ring holds RING_STEPS steps of one (module, hook) for every row it
# serves (handed over at half of it here, the other half written meanwhile) and at most RING_BYTES:
# 32 MiB holds all 32 steps of 64 rows (32 slots, or a staging ring's room for 32 jobs twice) of an
# 8192-wide bfloat16 value (a 70B model's residual stream); only a wider value (lm_head's logits)
# holds fewer steps, and at least one.
RING_STEPS = 32
RING_BYTES = 32 << 20


def ring_depth(row_bytes: int) -> int:
    """Steps a ring holds when one step of it (every row it serves) takes `row_bytes`."""
    return max(1, min(RING_STEPS, RING_BYTES // max(1, row_bytes)))


@dataclass
class Window:
    """Steps handed to the writer: the rings' rows `[count, used, sum of W]` on the host (being
    copied until `copied`), each slot's capture and its steps [since, until) in the window."""

    block: Block | None  # every ring's rows side by side (None: no ring)
    copied: Any  # a torch.cuda.Event, or None (copied already)
    owners: list[JobCapture | None]
    since: list[int]
    until: list[int]
    unfit: dict[Key, str]
    done: threading.Event


def keep_window(window: Window) -> None:
    """The writer's work for one window: each slot's rows to its capture. Never raises for a job:
    one whose rows do not fit (or whose key had no row per slot) gets its capture's `failure`."""
    try:
        if window.copied is not None:
            window.copied.synchronize()  # this window's copy only; the decoding stream goes on
        for slot, capture in enumerate(window.owners):
            if capture is None or capture.failure is not None:
                continue
            since, until = window.since[slot], window.until[slot]
            try:
                for key in capture.wanted:
                    if key in window.unfit:
                        raise JobFailure(window.unfit[key])
                if since < until and window.block is not None:
                    capture.keep_block(window.block, slot, since, until)
            except Exception as exc:  # noqa: BLE001 - that job's failure, never the batch's
                capture.failure = failure_of(exc, "keeping a window of captured steps")
    except Exception as exc:  # noqa: BLE001 - the copy itself failed: every job in the window fails
        for capture in window.owners:
            if capture is not None and capture.failure is None:
                capture.failure = failure_of(exc, "keeping a window of captured steps")
    finally:
        for capture in {id(c): c for c in window.owners if c is not None}.values():
            capture.release()
        window.done.set()


class Writer:
    """The capture writer: one daemon thread per process, keeping windows in the order given."""

    _lock = threading.Lock()
    _queue: queue.Queue[Window] | None = None

    @classmethod
    def put(cls, window: Window) -> None:
        with cls._lock:
            if cls._queue is None:
                cls._queue = queue.Queue()
                threading.Thread(target=cls._run, args=(cls._queue,), name="actq-capture-writer", daemon=True).start()
        cls._queue.put(window)

    @staticmethod
    def _run(windows: queue.Queue[Window]) -> None:
        while True:
            window = windows.get()
            try:
                with torch.inference_mode():  # thread-local: the engine thread's jobs may hold inference tensors
                    keep_window(window)
            except BaseException:
                log.exception("keeping a window of captured steps failed")


def wanted(captures: list[JobCapture | None]) -> frozenset[Key]:
    """The (module, hook) keys some of `captures` keep."""
    return frozenset(key for capture in captures if capture is not None for key in capture.wanted)


class StepRings:
    """The rings of the decoding steps of one persistent batch of `slots` slots (see the module)."""

    def __init__(self, model: torch.nn.Module, slots: int, device: torch.device) -> None:
        self.model, self.slots = model, slots
        self.cursor = torch.zeros(1, dtype=torch.int64, device=device)  # the ring step the next step writes
        self.rings: dict[Key, torch.Tensor] = {}
        self.pos = 0  # the host's copy of the cursor
        self.count = 0  # steps recorded since the last hand-over: ring rows [pos - count, pos)
        self.depth = ring_depth(0)  # steps the rings hold: the least over the rings
        self.unfit: dict[Key, str] = {}  # keys whose value is not one row per slot: why
        self._owner: list[weakref.ref | None] = [None] * slots  # the capture each slot's rows are for
        self._since = [0] * slots  # its first step in the window
        self._until: list[int | None] = [None] * slots  # one past its last (None: the window's end)
        self._copying: list[tuple[int, int, Any]] = []  # ring rows [lo, hi) being copied: their event
        self._ahead: list[threading.Event] = []  # windows handed over, not yet kept
        self._stream: Any = None  # the side stream the copies run on (CUDA)
        self._live: tuple[int, int] | None = None  # (lo, rows) while a step records (`recording`)
        self._rows_slots: list[int] | None = None  # and each row's slot, when not lo + its index
        self._at: dict[torch.device, torch.Tensor] = {}  # the recording step's ring rows, per device
        self._flat: dict[Key, torch.Tensor] = {}  # each ring as [steps * slots, W]
        self._arranged: tuple[tuple, dict[Key, tuple[int, int]]] | None = None  # `_layout`'s last
        self._hooked: frozenset[Key] = frozenset()
        self._handles: dict[Key, Any] = {}
        self._asked: tuple = ()  # `keys`'s last question (remembered, worker/hooks/row_identity.py) and answer
        self._answer: frozenset[Key] = frozenset()
        self._begun: tuple[frozenset[Key], tuple[weakref.ref | None, ...]] = (frozenset(), ())  # `begin`'s step

    def begin(self, rows: list[JobCapture | None], at: PassRows) -> None:
        """`CapturePath.begin` (worker/hooks/paths.py) of a decoding step over slots [0, n): the
        recorded steps handed over first when a ring is to be made (from ring step 0) or half the
        ring is written, and the step's stream waits for a copy still reading its ring row."""
        assert at.decoding and at.lo == 0, "the rings record a decoding step of the slots from slot 0"
        keys = self.keys(rows)
        self._begun = (keys, remember_all(rows))  # weakly: a row that leaves frees its capture
        if keys and not self.ready(keys):
            self.hand_over(rewind=True)
        elif keys and self.due:
            self.hand_over()
        if keys:
            self.before_step()

    @contextmanager
    def record(self, at: PassRows) -> Iterator[None]:
        """`CapturePath.record` of an eager step: the rings' hooks write slots [at.lo, at.lo +
        at.rows)' values at the cursor, which moves on once a pass over every slot of the step
        returned. (A step run in parts, halves after running out of memory, moves it with
        `advance` after its parts; a graph's replay moves it inside itself, worker/model/runner.py.)"""
        keys = self._begun[0]
        with self.recording(keys, at.lo, at.rows):
            yield
        if keys and at.lo == 0 and at.rows >= len(self._begun[1]):
            self.advance()

    def finish(self) -> dict[int, JobFailure]:
        """`CapturePath.finish`: the step counts for the rows that recorded it. A row whose rows do
        not fit fails later, when its window is kept (its capture's `failure`): none fails here."""
        keys, rows = self._begun
        if keys:
            self.stepped([None if ref is None else ref() for ref in rows])
        return {}

    def keys(self, captures: list[JobCapture | None]) -> frozenset[Key]:
        """What the rows' captures want at a decoding step (the last answer again while the rows
        hold the same captures: most steps change nothing)."""
        if not same_all(self._asked, captures):
            self._answer = wanted(captures)
            self._asked = remember_all(captures)
        return self._answer

    def ready(self, keys: frozenset[Key]) -> bool:
        """Whether every key has its ring (a new one is made at a write at ring step 0: its depth
        may be less than the cursor)."""
        return all(key in self.rings or key in self.unfit for key in keys)

    @property
    def due(self) -> bool:
        """Whether the recorded steps are to be handed over before the next step: the cursor is
        at half the ring or at its end."""
        half = max(1, self.depth // 2)
        return self.count > 0 and (self.pos % half == 0 or self.pos >= self.depth)

    @contextmanager
    def recording(self, keys: frozenset[Key], lo: int, rows: int, slots: list[int] | None = None):
        """The rings' hooks write slots [lo, lo + rows)' values of `keys` at the cursor during this
        forward pass (at a graph's capture, the writes become part of the graph); with `slots`,
        row b's value goes to slot `slots[b]` instead (a batch whose rows keep their slots in
        another order: worker/batch/state_decoding.py). The hooks stay on their modules between
        steps, doing nothing outside this context: registering and removing one per module at
        every step cost more than the writes (`close` removes them)."""
        self._hook(keys)
        self._live = (lo, rows)
        self._rows_slots = slots
        self._at = {}
        try:
            yield
        finally:
            self._live = None
            self._rows_slots = None

    def _hook(self, keys: frozenset[Key]) -> None:
        if keys == self._hooked:
            return
        for key in self._hooked - keys:
            self._handles.pop(key).remove()
        rings = weakref.ref(self)  # a hook left on a module keeps nothing alive
        for key in sorted(keys - self._hooked):
            module_path, hook = key
            module = self.model.get_submodule(module_path)
            if hook == "output":

                def on_output(_module, _args, output, key=key):
                    live = rings()
                    if live is not None and live._live is not None:
                        live._write(key, first_tensor(output), *live._live)

                self._handles[key] = module.register_forward_hook(on_output)
            else:

                def on_input(_module, args, kwargs, key=key):
                    live = rings()
                    if live is not None and live._live is not None:
                        live._write(key, first_tensor(first_input(args, kwargs)), *live._live)

                self._handles[key] = module.register_forward_pre_hook(on_input, with_kwargs=True)
        self._hooked = keys

    def close(self) -> None:
        """The hooks off the model's modules (the decoder that held these rings let go of them)."""
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()
        self._hooked = frozenset()

    def _write(self, key: Key, value: torch.Tensor | None, lo: int, rows: int) -> None:
        step = step_rows(value, rows)
        if step is None:
            shape = None if value is None else list(value.shape)
            self.unfit[key] = f"{key[0]} ({key[1]}): a decoding step's value {shape} is not one row per sequence"
            return
        flat = self._flat.get(key)
        if flat is None or flat.shape[1] != step.shape[1] or flat.dtype != step.dtype or flat.device != step.device:
            flat = self._ring(key, step)
        at = self._at.get(step.device)
        if at is None:  # this step's ring rows, computed once per device for every key
            cursor = self.cursor.to(step.device)
            if self._rows_slots is None:
                index = torch.arange(lo, lo + rows, device=step.device)
            else:
                index = torch.tensor(self._rows_slots, dtype=torch.int64, device=step.device)
            at = self._at[step.device] = cursor * self.slots + index
        flat.index_copy_(0, at, step)

    def _ring(self, key: Key, step: torch.Tensor) -> torch.Tensor:
        """A ring for `key` (at its first write: the warm-up before a graph's capture, or an eager
        step), as deep as `ring_depth` allows the slots' rows of this width, at least one step; its
        rows as one `[steps * slots, W]` view (what `_write` indexes)."""
        width = int(step.shape[1])
        depth = ring_depth(self.slots * width * step.element_size())
        ring = torch.zeros((depth, self.slots, width), dtype=step.dtype, device=step.device)
        self.rings[key] = ring
        self._flat[key] = ring.view(depth * self.slots, width)
        self.depth = min(ring.shape[0] for ring in self.rings.values())
        return self._flat[key]

    def advance(self) -> None:
        """After a step's forward pass (inside its graph): the cursor moves on."""
        self.cursor.add_(1)

    def before_step(self) -> None:
        """Before a step writes ring row `pos`: the decoding stream waits (on the device) for a
        copy of that row still running, from an earlier turn of the ring."""
        waiting = [(lo, hi, event) for lo, hi, event in self._copying if lo <= self.pos < hi]
        for item in waiting:
            torch.cuda.current_stream(self.cursor.device).wait_event(item[2])
            self._copying.remove(item)

    def stepped(self, owners: list[Any]) -> None:
        """The host's side of a step that recorded: who each slot's rows are for, and one step
        more. `owners`: each running slot's capture (None: nothing; slots past it: nothing)."""
        for slot in range(self.slots):
            capture = owners[slot] if slot < len(owners) else None
            if not same(self._owner[slot], capture):
                self._owner[slot] = remember(capture)
                self._since[slot] = self.count
                self._until[slot] = None
        self.count += 1
        self.pos += 1

    def ended(self, slot: int, extra: int) -> None:
        """`slot`'s row ended `extra` recorded steps ago (a step launched before its end was known,
        SlotDecoder's overlap): those steps' rows are not its."""
        if extra:
            self._until[slot] = max(self._since[slot], self.count - extra)

    def hand_over(self, rewind: bool = False) -> None:
        """The window of recorded steps to the capture writer (see the module): one copy per ring
        is enqueued, nothing is waited for. The cursor goes back to the ring's start at its end,
        or with `rewind` (before a ring is made: a new ring starts at step 0). Should the copy
        fail, nothing is reset: the running rows' recorded steps stay for the next hand-over
        (a failed join must not take steps from the rows already running)."""
        if self.count:
            self._window(self.count)
        self.count = 0
        self._since = [0] * self.slots
        self._until = [None] * self.slots
        if rewind or self.pos >= self.depth:
            self.pos = 0
            self.cursor.zero_()

    def _window(self, count: int) -> None:
        lo, hi = self.pos - count, self.pos
        owners = [ref() if ref is not None else None for ref in self._owner]
        used = max((slot + 1 for slot, c in enumerate(owners) if c is not None), default=0)
        keys = wanted(owners)
        rings = {key: ring for key, ring in sorted(self.rings.items()) if key in keys}
        columns, layout = self._layout(rings)
        copied, block = None, None
        device = self.cursor.device
        if rings and used:
            if device.type == "cuda" and all(ring.device == device for ring in rings.values()):
                copied, rows = self._copy(list(rings.values()), lo, hi, used)
            else:  # the CPU; or rings a device map put on several devices (eager steps): a plain copy
                rows = torch.cat([ring[lo:hi, :used].to("cpu") for ring in rings.values()], dim=2)
            block = Block(rows, columns, layout)
        held = {id(c): c for c in owners[:used] if c is not None}.values()
        for capture in held:
            capture.hold()
        done = threading.Event()
        until = [count if end is None else end for end in self._until[:used]]
        window = Window(block, copied, owners[:used], self._since[:used], until, dict(self.unfit), done)
        self._ahead = [event for event in self._ahead if not event.is_set()]
        if len(self._ahead) >= WINDOWS_AHEAD:  # the writer is behind: wait for it rather than pile up memory
            self._ahead.pop(0).wait()
        self._ahead.append(done)
        Writer.put(window)

    def _layout(self, rings: dict[Key, torch.Tensor]) -> tuple[dict[Key, tuple[int, int]], object]:
        """Where each ring's rows sit in a window's block, and the arrangement's one object (the
        same while the same rings are handed over: what each job keeps its gather index by)."""
        arrangement = tuple((key, int(ring.shape[2])) for key, ring in rings.items())
        if self._arranged is None or self._arranged[0] != arrangement:
            columns, offset = {}, 0
            for key, width in arrangement:
                columns[key] = (offset, width)
                offset += width
            self._arranged = (arrangement, columns)
        return self._arranged[1], self._arranged[0]

    def _copy(self, rings: list[torch.Tensor], lo: int, hi: int, used: int) -> tuple[Any, torch.Tensor]:
        """The rings' rows [lo, hi) side by side, to pinned host memory on the side stream after
        the steps that wrote them (one gather on the device, one copy); its event."""
        device = self.cursor.device
        main = torch.cuda.current_stream(device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        self._stream.wait_stream(main)
        with torch.cuda.stream(self._stream):
            # made on the side stream, its memory that stream's: freed after the copy, in stream order
            side_by_side = torch.cat([ring[lo:hi, :used] for ring in rings], dim=2)
            host = torch.empty(side_by_side.shape, dtype=side_by_side.dtype, pin_memory=True)
            host.copy_(side_by_side, non_blocking=True)
            for ring in rings:
                ring.record_stream(self._stream)  # kept alive for the gather if the slots are resized meanwhile
            copied = torch.cuda.Event()
            copied.record(self._stream)
        self._copying.append((lo, hi, copied))
        return copied, host

    def wait(self) -> None:
        """Until every window handed over has been kept (tests; the end of a batch)."""
        for event in self._ahead:
            event.wait()
        self._ahead = []

    def discard(self) -> None:
        """Forget recorded steps (their batch was failed as a whole)."""
        self.count = 0
        self._since = [0] * self.slots
        self._until = [None] * self.slots
        self._owner = [None] * self.slots
        self.pos = 0
        self.cursor.zero_()

    def resized(self, slots: int) -> None:
        """Another number of slots (after `hand_over`): rings are made anew at their next write.
        Fewer slots only when no row runs past them: their owners are forgotten."""
        self.slots = slots
        self.rings.clear()
        self._flat.clear()
        self._copying = []  # copies from the old rings: nothing writes those rows again
        self.depth = ring_depth(0)
        self._owner = (self._owner + [None] * slots)[:slots]
        self._since = [0] * slots
        self._until = [None] * slots
        self.pos = 0
        self.cursor.zero_()
