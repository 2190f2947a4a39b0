"""Capture at the slots' decoding steps, recorded inside the step: one device ring per captured
(module, hook), written by one `index_copy_` at a device cursor, so a step that captures is
graph-safe and replays as a CUDA graph like one that does not.

A ring is `[steps, slots, W]` on the module's device, in the module's dtype: step k of the ring
holds every slot's value at that step (slots whose row captures nothing write rows nobody reads:
one copy of the whole batch costs less than choosing rows). The cursor is a one-element device
tensor that the step moves on (`advance`), so neither the hook nor the graph reads the host's
count. The host counts the steps alike (`count`) and hands the rows to the jobs' captures
(`JobCapture.keep_steps`: their positions, features, dtype and reductions) when a ring is full, when
a capturing row leaves, before the slots grow and at the end: one copy of `[count, slots, W]`
per ring to the host (pinned on a GPU) and one wait for the device per drain, not per step.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any

import torch

from shared.errors import JobFailure
from worker.capture import JobCapture, _failure, first_input, first_tensor, step_rows

Key = tuple[str, str]  # (module path, "output" | "input")
RING_STEPS = 32  # decoding steps a ring holds before its rows go to the jobs
RING_BYTES = 32 << 20  # at most this much device memory per ring (a wide module, lm_head, holds fewer steps)


class StepRings:
    """The rings of the decoding steps of one persistent batch of `slots` slots (see the module)."""

    def __init__(self, model: torch.nn.Module, slots: int, device: torch.device) -> None:
        self.model, self.slots = model, slots
        self.cursor = torch.zeros(1, dtype=torch.int64, device=device)  # the ring step the next step writes
        self.rings: dict[Key, torch.Tensor] = {}
        self.count = 0  # steps recorded since the last drain (the host's copy of the cursor)
        self.depth = RING_STEPS  # steps the rings hold: the least over the rings
        self.unfit: dict[Key, str] = {}  # keys whose value is not one row per slot: why
        self._owner: list[weakref.ref | None] = [None] * slots  # the capture each slot's rows are for
        self._since = [0] * slots  # its first step in the rings

    @staticmethod
    def keys(captures: list[JobCapture | None]) -> frozenset[Key]:
        """What the rows' captures want at a decoding step."""
        return frozenset(key for capture in captures if capture is not None for key in capture.wanted)

    def ready(self, keys: frozenset[Key]) -> bool:
        """Whether every key has its ring (a new one is made at a write at step 0: its depth may
        be less than the cursor)."""
        return all(key in self.rings or key in self.unfit for key in keys)

    @property
    def full(self) -> bool:
        return self.count >= self.depth

    @contextmanager
    def recording(self, keys: frozenset[Key], lo: int, rows: int):
        """Hooks that write slots [lo, lo + rows)' values of `keys` at the cursor, for one forward pass
        (at a graph's capture, the writes become part of the graph)."""
        handles = []
        try:
            for key in sorted(keys):
                module_path, hook = key
                module = self.model.get_submodule(module_path)
                if hook == "output":

                    def on_output(_module, _args, output, key=key):
                        self._write(key, first_tensor(output), lo, rows)

                    handles.append(module.register_forward_hook(on_output))
                else:

                    def on_input(_module, args, kwargs, key=key):
                        self._write(key, first_tensor(first_input(args, kwargs)), lo, rows)

                    handles.append(module.register_forward_pre_hook(on_input, with_kwargs=True))
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _write(self, key: Key, value: torch.Tensor | None, lo: int, rows: int) -> None:
        step = step_rows(value, rows)
        if step is None:
            shape = None if value is None else list(value.shape)
            self.unfit[key] = f"{key[0]} ({key[1]}): a decoding step's value {shape} is not one row per sequence"
            return
        ring = self.rings.get(key)
        if ring is None or ring.shape[2] != step.shape[1] or ring.dtype != step.dtype or ring.device != step.device:
            ring = self._ring(key, step)
        ring[:, lo : lo + rows].index_copy_(0, self.cursor.to(step.device), step.unsqueeze(0))

    def _ring(self, key: Key, step: torch.Tensor) -> torch.Tensor:
        """A ring for `key` (at its first write: the warm-up before a graph's capture, or an eager
        step), as deep as RING_BYTES allows a slot's rows of this width, at least one step."""
        width = int(step.shape[1])
        depth = max(1, min(RING_STEPS, RING_BYTES // max(1, self.slots * width * step.element_size())))
        ring = torch.zeros((depth, self.slots, width), dtype=step.dtype, device=step.device)
        self.rings[key] = ring
        self.depth = min(ring.shape[0] for ring in self.rings.values())
        return ring

    def advance(self) -> None:
        """After a step's forward pass (inside its graph): the cursor moves on."""
        self.cursor.add_(1)

    def stepped(self, owners: list[Any]) -> None:
        """The host's side of a step that recorded: who each slot's rows are for, and one step
        more. `owners`: each running slot's capture (None: nothing; slots past it: nothing)."""
        for slot in range(self.slots):
            capture = owners[slot] if slot < len(owners) else None
            ref = self._owner[slot]
            if (ref() if ref is not None else None) is not capture:
                self._owner[slot] = weakref.ref(capture) if capture is not None else None
                self._since[slot] = self.count
        self.count += 1

    def drain(self) -> dict[int, JobFailure]:
        """Hand every recorded step to its slot's capture, then start the rings over. Never
        raises for a job: one whose rows do not fit (or whose key had no row per slot) gets its
        capture's `failure`. Returns those failures by slot."""
        failed: dict[int, JobFailure] = {}
        count, self.count = self.count, 0
        if not count:
            return failed
        owners = [ref() if ref is not None else None for ref in self._owner]
        used = max((slot + 1 for slot, c in enumerate(owners) if c is not None), default=0)
        wanted = self.keys(owners)
        rings = {key: ring for key, ring in self.rings.items() if key in wanted}
        blocks = {key: self._to_host(ring[:count, :used]) for key, ring in rings.items()}
        for device in {ring.device for ring in rings.values() if ring.device.type == "cuda"}:
            torch.cuda.current_stream(device).synchronize()  # the one wait of a drain (per GPU of a device map)
        for slot, capture in enumerate(owners[:used]):
            if capture is None or capture.failure is not None:
                continue
            since = self._since[slot]
            try:
                for key in capture.wanted:
                    if key in self.unfit:
                        raise JobFailure(self.unfit[key])
                    if since < count:
                        capture.keep_steps(key, blocks[key][since:count, slot])
            except Exception as exc:  # noqa: BLE001 - that job's failure, never the batch's
                capture.failure = failed[slot] = _failure(exc)
        self._since = [0] * self.slots
        self.cursor.zero_()
        return failed

    @staticmethod
    def _to_host(rows: torch.Tensor) -> torch.Tensor:
        if rows.device.type == "cpu":
            return rows.clone()
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        return host

    def discard(self) -> None:
        """Forget recorded steps (their batch was failed as a whole)."""
        self.count = 0
        self._since = [0] * self.slots
        self._owner = [None] * self.slots
        self.cursor.zero_()

    def grown(self, slots: int) -> None:
        """More slots (after `drain`): rings are made anew at their next write."""
        self.slots = slots
        self.rings.clear()
        self.depth = RING_STEPS
        self._owner = self._owner + [None] * (slots - len(self._owner))
        self._since = [0] * slots
