"""Capture with per-module forward hooks: each pass's value split into the batch's sequences and
each job handed its own rows (worker/hooks/capture.py `JobCapture` keeps them); a decoding step's rows staged in
host rings and handed over in windows.

The fallback capture path. The slots' decoding steps capture through worker/hooks/step_capture.py
(device rings written inside the step, graph-safe); these hooks serve the passes that are not a
slot step: every prefill pass (whole or chunked, a batch of prompts left-padded), the compacted
batch's passes (worker/batch/decoding.py `Decoder`) and the solo decoder's (worker/batch/solo.py).
"""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from shared.errors import JobFailure
from worker.hooks.capture import JobCapture
from worker.hooks.device import home_device
from worker.hooks.module_rows import first_input, first_tensor, split_rows, step_rows
from worker.hooks.pass_block import PassBlock
from worker.hooks.paths import PassRows
from worker.hooks.row_identity import remember_all, same_all
from worker.hooks.step_capture import ring_depth
from worker.rules.failures import failure_of


class BatchHooks:
    """One forward hook per (module, hook) that any job of the running batch captures; at each
    forward pass it splits the module's value into the batch's sequences and hands each job its
    own rows. `rows` is the batch in order (None for a sequence that captures nothing); a job
    whose rows do not fit gets its failure recorded in `failures` and the others go on.

    At a decoding step (`use(..., decoding=True)`: one new position per sequence) the work does not
    grow with the batch: per (module, hook), one gather of the rows the batch keeps into a slot of
    its staging ring (host memory, pinned on a GPU, written `non_blocking` and completed by the
    step's own transfer of its tokens: see `flush`). A ring holds `ring_depth` steps; its
    rows are handed to the jobs when it is full, when a job ends or the batch otherwise changes
    (`drain`): one copy per job and point for all those steps. Jobs that join at the end of the
    batch become more targets of the same rings (room for twice the rows is allocated), so a join
    hands nothing over.

    Use as a context manager around the decoding of one batch (hooks are removed on exit)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.rows: list[JobCapture | None] = []
        self.lengths: list[int] | None = None  # a left-padded pass: each row's real positions (the last ones)
        self.failures: dict[int, JobFailure] = {}  # index in `rows` -> why that job's capture failed
        self.decoding = False
        self._handles: dict[tuple[str, str], object] = {}
        self._rings: dict[tuple[str, str], _Ring] = {}  # (module, hook) -> its staged steps
        self._rings_for: tuple[weakref.ref | None, ...] = ()  # the batch the rings were built for
        self._written: list[tuple[str, str]] = []  # rings this pass wrote a slot of
        self._in_flight: set[torch.device] = set()  # GPUs whose staged copies may not be complete
        self._wanted: set[tuple[str, str]] = set()  # what the batch of `_wanted_for` captures
        self._wanted_for: tuple[weakref.ref | None, ...] = ()
        self._block: PassBlock | None = None  # a prompt pass's rows of every job, gathered per key

    def __enter__(self) -> BatchHooks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def begin(self, rows: list[JobCapture | None], at: PassRows) -> None:
        """`CapturePath.begin` (worker/hooks/paths.py): `use`, each row's own positions its last ones;
        a prompt pass of several jobs gathers their rows per key (worker/hooks/pass_block.py)."""
        self.use(rows, at.lengths, at.decoding)
        self._block = PassBlock.plan(rows, at)

    def record(self, at: PassRows) -> AbstractContextManager[object]:
        """`CapturePath.record`: nothing to add, the hooks stay on their modules from `begin`."""
        return nullcontext()

    def finish(self) -> dict[int, JobFailure]:
        """`CapturePath.finish`: `flush`, a prompt pass's gathered rows to their jobs; the rows whose
        capture failed."""
        self.flush()
        block, self._block = self._block, None
        if block is not None:
            block.apply(self.failures)
        return dict(self.failures)

    def hand_over(self) -> None:
        """`CapturePath.hand_over`: every staged step to its job (`drain`)."""
        self.drain()

    def close(self) -> None:
        """`CapturePath.close`: the hooks removed (`release`)."""
        self.release()

    def release(self) -> None:
        """The hooks removed (until the next `use`): the slots' decoding steps capture through
        worker/hooks/step_capture.py, and no hook of a prefill may run inside them."""
        for handle in self._handles.values():
            handle.remove()  # type: ignore[attr-defined]  # a torch RemovableHandle
        self._handles.clear()
        self._wanted_for = ()

    def use(self, rows: list[JobCapture | None], lengths: list[int] | None = None, decoding: bool = False) -> None:
        """The sequences of the next forward pass, in batch order: hooks for what they capture.
        `lengths`: the pass is left-padded and row b's own positions are its last `lengths[b]`.
        `decoding`: every sequence feeds one position (batched gathers, see the class)."""
        self.settle(rows, decoding)
        self._block = None  # `begin` plans one for its pass
        self.rows, self.lengths, self.decoding = rows, lengths, decoding
        # a job whose staged rows did not fit (in `settle`) has failed already: the pass says so too
        self.failures = {i: c.failure for i, c in enumerate(rows) if c is not None and c.failure is not None}
        self._written = []
        if not same_all(self._wanted_for, rows):  # the same batch as the last pass (most steps): the same keys
            self._wanted = {key for capture in rows if capture is not None for key in capture.wanted}
            self._wanted_for = remember_all(rows)
        wanted = self._wanted
        for key in list(self._handles):
            if key not in wanted:
                self._handles.pop(key).remove()  # type: ignore[attr-defined]
        for key in wanted - self._handles.keys():
            module_path, hook = key
            module = self.model.get_submodule(module_path)
            if hook == "output":

                def on_output(_module, _args, output, key=key):
                    self._dispatch(key, first_tensor(output))

                self._handles[key] = module.register_forward_hook(on_output)
            else:

                def on_input(_module, args, kwargs, key=key):
                    self._dispatch(key, first_tensor(first_input(args, kwargs)))

                self._handles[key] = module.register_forward_pre_hook(on_input, with_kwargs=True)
        if decoding:
            self._plan(wanted)

    def settle(self, rows: list[JobCapture | None], decoding: bool = True) -> None:
        """Before a pass over `rows`: staged steps of another batch go to the jobs that ran them
        (so that a job's buffers hold every step before anyone marks or resets them, and before
        a decoding pass of another batch rebuilds the rings). A pass that is not a decoding step
        and concerns none of those jobs (a prompt chunk of a job that joins later) leaves them
        staged. The staged steps belong to the rings' batch (`_rings_for`). A full ring goes to
        its jobs first: the pass needs its slot."""
        for key, ring in self._rings.items():
            if ring.full:
                self._drain_ring(key, ring, {})
        if not any(r.count for r in self._rings.values()):
            return
        known = len(self._rings_for)
        if same_all(self._rings_for, rows[:known]) and (
            len(rows) == known or (decoding and self._room_for(rows[known:]))
        ):
            return  # the same batch, or jobs joined at its end: the staged rows stay where they are
        staged = [ref() for ref in self._rings_for if ref is not None]
        if decoding or any(c is not None and any(c is s for s in staged) for c in rows):
            self.drain()

    def _room_for(self, joined: list[JobCapture | None]) -> bool:
        """Whether every ring has room for the rows of jobs that joined (`_extend`)."""
        for key, ring in self._rings.items():
            if ring.buffer is not None:
                more = sum(1 for c in joined if c is not None and key in c.wanted)
                if len(ring.targets) + more > ring.buffer.shape[1]:
                    return False
        return True

    def _plan(self, wanted: set[tuple[str, str]]) -> None:
        """Which rows keep each (module, hook), as a device index; rebuilt when the batch changes,
        extended when jobs joined at its end. All or nothing: the new rings are built first."""
        known = len(self._rings_for)
        if known and same_all(self._rings_for, self.rows[:known]):  # the same batch, maybe with jobs joined
            if known == len(self.rows) and wanted == self._rings.keys():
                return
            self._extend(wanted, known)
            return
        device = home_device(self.model)
        rings = {}
        for key in wanted:
            rows = [b for b, capture in enumerate(self.rows) if capture is not None and key in capture.wanted]
            rings[key] = _Ring(rows, torch.tensor(rows, dtype=torch.long, device=device))
        self._rings, self._rings_for = rings, remember_all(self.rows)

    def _extend(self, wanted: set[tuple[str, str]], known: int) -> None:
        """Jobs joined at the end of the batch: their rows become new targets of the rings (their
        staged steps start at the next slot), so a join hands nothing over. The new indices are
        built before anything changes (a failure leaves the rings as they were). (`settle`, which
        runs before a pass marks its jobs' captures, has already handed a ring without room for
        them to its jobs; the drains here are a fallback that then finds nothing staged.)"""
        device = home_device(self.model)
        plans: list[tuple[tuple[str, str], _Ring | None, list[int], torch.Tensor]] = []
        for key in wanted:
            ring = self._rings.get(key)
            if ring is None:
                rows = [b for b, capture in enumerate(self.rows) if capture is not None and key in capture.wanted]
                plans.append((key, None, rows, torch.tensor(rows, dtype=torch.long, device=device)))
                continue
            joined = [b for b in range(known, len(self.rows)) if (c := self.rows[b]) is not None and key in c.wanted]
            if joined:
                targets = ring.targets + joined
                plans.append((key, ring, joined, torch.tensor(targets, dtype=torch.long, device=device)))
        for key, ring, rows, where in plans:  # nothing below allocates on the device or raises
            if ring is None:
                self._rings[key] = _Ring(rows, where)
                continue
            if ring.buffer is not None and len(ring.targets) + len(rows) > ring.buffer.shape[1]:
                if ring.count:
                    self._drain_ring(key, ring, {})
                ring.buffer = None
            ring.since = ring.since + [ring.count] * len(rows)
            ring.targets, ring.where = ring.targets + rows, where
        for key in [k for k in self._rings if k not in wanted]:
            ring = self._rings.pop(key)
            if ring.count:
                self._drain_ring(key, ring, {})
        self._rings_for = remember_all(self.rows)

    def _dispatch(self, key: tuple[str, str], value: torch.Tensor | None) -> None:
        if self.decoding:
            rows = step_rows(value, len(self.rows))
            if rows is not None:
                self._rings[key].stage(rows)
                self._written.append(key)
                return
        elif self._block is not None and self._block.take(key, value):
            return
        for index, (capture, rows) in enumerate(zip(self.rows, split_rows(value, len(self.rows)), strict=True)):
            if capture is None or index in self.failures:
                continue
            if self.lengths is not None and rows is not None:
                rows = rows[max(0, rows.shape[0] - self.lengths[index]) :]
            try:
                capture.keep(key, rows)
            except JobFailure as exc:
                self.failures[index] = exc

    def flush(self) -> None:
        """After a decoding step's forward pass: its staged rows count. On a GPU the copies may
        still be in flight; nothing waits for them here. The step's tokens, read on the host next
        (`synced`), complete them on their device's stream; a ring is read only after that, or
        after `_wait`. (A full ring goes to its jobs before the next pass, in `settle`.)"""
        written, self._written = self._written, []
        for key in written:
            ring = self._rings[key]
            ring.count += 1  # no tensor is touched here: nothing can fail half-way
            if ring.pinned and ring.device is not None:
                self._in_flight.add(ring.device)

    def synced(self, device: torch.device) -> None:
        """The host has read a value that `device`'s stream computed after this step's staged
        copies (the step's tokens): those copies are complete, with no wait of their own."""
        self._in_flight.discard(device)

    def _wait(self) -> None:
        """Before reading a ring on the host: staged copies not known complete (a device map's
        other GPUs) are waited for, once per device."""
        for device in self._in_flight:
            torch.cuda.current_stream(device).synchronize()
        self._in_flight.clear()

    def drain(
        self, only: set[int] | None = None, batch: list[JobCapture | None] | None = None
    ) -> dict[int, JobFailure]:
        """Hand every staged step to its job (`only`: to the jobs of those rows of `batch`, the
        running batch, whose steps the rings then forget, the others' staying staged; when the
        rings hold another batch's steps, everything); returns the failures (by id of the job's
        capture) of those whose rows did not fit, also recorded in `failures` for the current
        batch."""
        if only is not None and not same_all(self._rings_for, batch or []):
            only = None
        failed: dict[int, JobFailure] = {}
        for key, ring in self._rings.items():
            if ring.count:
                self._drain_ring(key, ring, failed, only)
        for index, capture in enumerate(self.rows):
            if capture is not None and id(capture) in failed:
                self.failures.setdefault(index, failed[id(capture)])
        return failed

    def compact(self, batch: list[JobCapture | None], keep: list[int]) -> None:
        """The running batch (its captures `batch`) becomes its rows `keep`, in that order (the
        others' steps were drained): the staged steps of the rows kept move with them, one copy
        per ring instead of one per job and point. All or nothing: on failure nothing changed."""
        same = same_all(self._rings_for, batch)
        if not same or not any(ring.count for ring in self._rings.values()):
            self.drain()  # staged steps of another batch (halves after running out of memory), or none
            self._rings, self._rings_for, self._wanted_for = {}, (), ()
            return
        position = {old: new for new, old in enumerate(keep)}
        device = home_device(self.model)
        self._wait()  # the staged steps are copied on the host below
        plans = []
        for ring in self._rings.values():  # every new state first: allocation may fail
            kept = [at for at, index in enumerate(ring.targets) if index in position]
            targets = [position[ring.targets[at]] for at in kept]
            old = buffer = ring.buffer
            if old is not None and ring.count and kept != list(range(len(kept))):
                buffer = torch.empty(old.shape, dtype=old.dtype, pin_memory=ring.pinned)
                buffer[: ring.count, : len(kept)] = old[: ring.count, kept]
            plans.append((ring, kept, targets, buffer, torch.tensor(targets, dtype=torch.long, device=device)))
        for ring, kept, targets, buffer, where in plans:  # then only assignments: nothing can fail
            ring.since = [ring.since[at] for at in kept]
            ring.targets, ring.where, ring.buffer = targets, where, buffer
        self.rows = [batch[i] for i in keep]
        self._rings_for, self._wanted_for = remember_all(self.rows), ()

    def _drain_ring(
        self, key: tuple[str, str], ring: _Ring, failed: dict[int, JobFailure], only: set[int] | None = None
    ) -> None:
        """Never raises: a job that cannot take its rows fails (its capture's `failure`)."""
        self._wait()
        block, since = ring.steps(), list(ring.since)
        if only is None:
            ring.count, ring.since = 0, [0] * len(ring.targets)
        for at, index in enumerate(ring.targets):
            if only is not None:
                if index not in only:
                    continue
                ring.since[at] = ring.count  # handed over: later drains skip these steps
            ref = self._rings_for[index] if index < len(self._rings_for) else None
            if since[at] >= block.shape[0] or ref is None:
                continue  # nothing staged for it (a row that joined after these steps), or no capture
            capture = ref()
            if capture is None or capture.failure is not None:
                continue
            try:
                capture.keep_steps(key, block[since[at] :, at])
            except Exception as exc:  # noqa: BLE001 - that job's failure, never the batch's
                capture.failure = failed[id(capture)] = failure_of(exc, "keeping a job's staged rows")
                if capture in self.rows:
                    self.failures.setdefault(self.rows.index(capture), capture.failure)

    def discard(self) -> None:
        """Forget staged steps (their batch was failed as a whole)."""
        for ring in self._rings.values():
            ring.count, ring.since = 0, [0] * len(ring.targets)
        self._written = []
        self._wait()  # nothing may still be copying into the slots the next steps reuse


@dataclass
class _Ring:
    """The steps of one (module, hook) not yet handed to the jobs: `[slots, len(targets), W]`,
    allocated at the first step (when W is known)."""

    targets: list[int]  # batch rows that keep this (module, hook)
    where: torch.Tensor  # the same, as an index on the model's device
    buffer: torch.Tensor | None = None  # [slots, room for targets, W]
    count: int = 0
    since: list[int] = field(default_factory=list)  # per target: its first staged slot (joined later)
    pinned: bool = False  # the buffer is pinned: its copies run on `device`'s stream (a GPU)
    device: torch.device | None = None  # where the module's rows are (known once a step was staged)

    def __post_init__(self) -> None:
        self.since = self.since or [0] * len(self.targets)

    @property
    def full(self) -> bool:
        return self.buffer is not None and self.count >= self.buffer.shape[0]

    def stage(self, rows: torch.Tensor) -> None:
        """Gather this step's kept rows of `rows` `[B, W]` into the next slot."""
        width, item = int(rows.shape[1]), rows.element_size()
        if self.buffer is None or self.buffer.shape[2] != width or self.buffer.dtype != rows.dtype:
            room = 2 * len(self.targets)  # jobs that join later become targets without a new ring
            slots = ring_depth(room * width * item)
            cuda = rows.device.type == "cuda"
            self.buffer = torch.empty((slots, room, width), dtype=rows.dtype, pin_memory=cuda)
            self.pinned, self.device = cuda, rows.device
            self.count = 0
            self.since = [0] * len(self.targets)
        slot = self.buffer[self.count, : len(self.targets)]
        if self.where.device != rows.device:  # a module on another device of a device map: once per ring
            self.where = self.where.to(rows.device)
        if rows.device.type == "cpu":
            torch.index_select(rows, 0, self.where, out=slot)
        else:
            slot.copy_(rows.index_select(0, self.where), non_blocking=True)

    def steps(self) -> torch.Tensor:
        assert self.buffer is not None
        return self.buffer[: self.count]
