"""One job's captured rows: which positions of each capture point it keeps, by its `positions`
choice, and how it keeps them (copied into its arena, or folded into a reduction).

Why plain hooks and not nnsight's cache: the cache keeps every position of every step and can only
be cut after the generation (a `positions: last` job over a 1,600-token prompt held 1.8 GB to keep
1.2 MB); it hands back the module's live tensor when neither device nor dtype changes, so a parent
that edits that tensor in place after the module returns changes what was "captured"; and its
per-step loop silently returns another step's values when modules are read out of order. A capture
path sees each value once, as the module returns it, and copies just the kept rows into a buffer
the job owns: memory follows the rows kept, and the values are what the module returned then.

Positions. A generation of N new tokens from a P-token prompt runs N forward steps: the first
feeds positions [0, P), step k >= 1 feeds position P + k - 1. A module's value at a step is
`[1, S, H]` (or `[S, H]`) and covers the last S positions fed so far (S = P, or 1 for a module
that only sees the last position, like `lm_head` in generate). See worker/batch/generation.py for what
each `positions` choice keeps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.capture_spec import span
from shared.errors import JobFailure
from shared.schemas import CapturePoint
from worker.hooks import shared_memory


@dataclass
class _Buffer:
    """The rows one capture point keeps: a slice of the job's arena sized for the most the job can
    keep. Pages of a large CPU allocation are only backed once written, so a short answer costs
    its own rows. A reduced point keeps a float32 accumulator instead (`acc`, `count` rows in it)."""

    point: CapturePoint
    rows: torch.Tensor  # [capacity, W] (W: the kept features); [0, W] when reduced
    width: int  # the module's full last dimension
    select: torch.Tensor | None = None  # kept feature indices (None: all)
    first: int | None = None  # token_ids index of row 0, set at the first kept row
    steps: int = 0
    acc: torch.Tensor | None = None  # [W] float32: the running reduction
    count: int = 0

    @property
    def features(self) -> list[int] | None:
        return None if self.select is None else [int(i) for i in self.select.tolist()]


def capacity(positions: str, prompt_tokens: int, max_tokens: int, completion: tuple[int, int] | None = None) -> int:
    """Rows a point may keep at most: `last` keeps one, replaced at every step."""
    if positions == "last":
        return 1
    lo, hi = span(positions, prompt_tokens, max_tokens, completion)
    return hi - lo


class Mark:
    """A point to go back to in a job's capture (`JobCapture.mark`): the buffers' state, saved
    at the first change after the mark (None: nothing changed since)."""

    __slots__ = ("saved",)

    def __init__(self) -> None:
        self.saved: list[tuple] | None = None


@dataclass
class Block:
    """A window of decoding steps of several keys side by side (worker/hooks/step_capture.py): `rows`
    is `[steps, slots, width]`, key k's values in columns `columns[k] = (offset, width)`; `layout`
    is the same object for every block of one arrangement (what a job's gather index is kept by)."""

    rows: torch.Tensor
    columns: dict[tuple[str, str], tuple[int, int]]
    layout: object

    @property
    def width(self) -> int:
        return int(self.rows.shape[2])

    def of(self, key: tuple[str, str]) -> torch.Tensor:
        """One key's values, `[steps, slots, W]`."""
        offset, width = self.columns[key]
        return self.rows[:, :, offset : offset + width]


def copy_columns(source: torch.Tensor, target: torch.Tensor, columns: torch.Tensor | None) -> None:
    """`source`'s columns `columns` (None: all, in order) into `target`, cast to its dtype: one
    copy, or one gather straight into it when the dtypes agree."""
    if columns is None:
        target.copy_(source)
    elif source.dtype == target.dtype:
        torch.index_select(source, 1, columns, out=target)
    else:
        target.copy_(source.index_select(1, columns))


class JobCapture:
    """One job's kept rows: a buffer per capture point, filled by `keep` with the rows of this job's
    sequence at each forward step (on the CPU, in the capture dtype; `copy_` casts and moves in one
    pass and never aliases the model's tensor). `BatchHooks` hands each job its own rows.

    Every buffer is a slice of one allocation per job: many allocations of a few megabytes would
    land between the forward pass's short-lived tensors on the malloc heap, and the holes those
    leave are memory the process keeps (measured: +45% over the kept bytes for a prompt capture).
    One large allocation is mapped on its own and returned whole when the job's tensors are freed.
    It is laid out by position (`arena[i]` holds position i of every point, each point a column
    range), so the decoding steps of a window land in one copy per job (`keep_block`) rather than
    one per point, and the pages written are those of the positions kept.

    `features` keeps those indices of each value's last dimension (taken before the copy), and
    `reduce` ("mean", "sum", "max", "last") folds the kept positions into one float32 row as they
    arrive, so a reduced capture never holds more than that row. A trace job (`max_tokens` 0) has
    one forward step over its whole text; `completion` is its final assistant turn's range."""

    def __init__(
        self,
        points: list[CapturePoint],
        widths: list[int],  # each point's last dimension, as the model description says
        positions: str,
        prompt_tokens: int,
        max_tokens: int,
        dtype: torch.dtype,
        reduce: str = "none",
        features: Callable[[int], list[int] | None] = lambda _: None,
        completion: tuple[int, int] | None = None,
    ) -> None:
        self.positions, self.prompt_tokens, self.max_tokens = positions, prompt_tokens, max_tokens
        self.failure: JobFailure | None = None  # rows handed over late (a window, a drain) did not fit
        # Windows of decoding steps handed to the capture writer thread and not yet kept
        # (worker/hooks/step_capture.py): the job's result waits for them (`settle`).
        self._pending = 0
        self._settled = threading.Condition()
        # A prompt fed in chunks (Decoder.feed): the pass now running feeds positions
        # [chunk[0], chunk[0] + chunk[1]); its last chunk ends the prompt's step.
        self.chunk: tuple[int, int] | None = None
        self._mark: Mark | None = None  # the latest `mark`
        self.dtype, self.reduce, self.completion = dtype, reduce, completion
        # positions "last" is one row: every reduction of it is that row, replaced at each step
        self._fold_kind = "last" if positions == "last" else reduce
        self.window = span(positions, prompt_tokens, max_tokens, completion)
        rows = 0 if reduce != "none" else capacity(positions, prompt_tokens, max_tokens, completion)
        kept = [features(width) for width in widths]
        kept_widths = [width if k is None else len(k) for width, k in zip(widths, kept, strict=True)]
        total = sum(kept_widths)
        # position-major: row i, every point; shared with the store process when it runs
        self.arena = shared_memory.empty(rows, total, dtype)
        self.nbytes = self.arena.numel() * self.arena.element_size() + (4 * total if reduce != "none" else 0)
        self.buffers: list[_Buffer] = []
        self.wanted: dict[tuple[str, str], list[_Buffer]] = {}  # (module, hook) -> its points' buffers
        offset = 0
        for point, width, keep, kept_width in zip(points, widths, kept, kept_widths, strict=True):
            buffer = _Buffer(point, self.arena[:, offset : offset + kept_width], width)
            if keep is not None:
                buffer.select = torch.tensor(keep, dtype=torch.long)
            offset += kept_width
            self.buffers.append(buffer)
            self.wanted.setdefault((point.module, point.hook), []).append(buffer)
        self._columns: tuple[object, torch.Tensor | None] | None = None  # (a block's layout, `keep_block`'s index)

    def hold(self) -> None:
        """A window of this job's decoding steps is on its way to `keep_block` (or `keep_steps`) on another thread."""
        with self._settled:
            self._pending += 1

    def release(self) -> None:
        """That window was kept (or failed: `failure` says so)."""
        with self._settled:
            self._pending -= 1
            if self._pending <= 0:
                self._settled.notify_all()

    def settle(self) -> None:
        """Wait until every window handed over has been kept (at once when none is on its way)."""
        with self._settled:
            self._settled.wait_for(lambda: self._pending <= 0)

    def mark(self) -> Mark:
        """Where every buffer stands, to undo a forward pass that failed half-way (`reset`). Free
        until a buffer changes: the state is saved then, once (a decoding step's rows go to the
        staging rings, so most steps change nothing)."""
        if self._mark is None or self._mark.saved is not None:
            self._mark = Mark()
        return self._mark

    def reset(self, mark: Mark) -> None:
        """Back to where `mark` was taken (nothing to do when nothing changed since)."""
        if mark.saved is None:
            return
        for buffer, (steps, first, count, acc) in zip(self.buffers, mark.saved, strict=True):
            buffer.steps, buffer.first, buffer.count, buffer.acc = steps, first, count, acc
        self._mark = mark

    def _changing(self) -> None:
        """Before a buffer changes: the state at the current mark, saved the first time."""
        mark = self._mark
        if mark is not None and mark.saved is None:
            # no copy of `acc`: folding makes a new tensor and never writes into the old one
            mark.saved = [(b.steps, b.first, b.count, b.acc) for b in self.buffers]

    def keep(self, key: tuple[str, str], rows: torch.Tensor | None) -> None:
        """This job's value of one module at one step, as `[S, W]` rows (None: not rows at all)."""
        self._changing()
        for buffer in self.wanted.get(key, ()):
            self._keep(buffer, rows)

    def keep_steps(self, key: tuple[str, str], rows: torch.Tensor) -> None:
        """This job's values of one module at `len(rows)` consecutive decoding steps (one position
        each), as `[steps, W]`: what `keep` does for each step, in one copy."""
        self._changing()
        for buffer in self.wanted.get(key, ()):
            self._keep_steps(buffer, rows)

    def keep_block(self, block: Block, slot: int, since: int, until: int) -> None:
        """This job's rows of a window of decoding steps: `block.rows[since:until, slot]` holds its
        value at each of `until - since` consecutive steps for every key of the block, side by side.
        One copy (one gather when its points are not the block's columns in order) into the arena's
        rows, as `keep_steps` for each key would keep them; per key when a point reduces or keeps
        `last` (or the buffers do not stand at the same step)."""
        first_buffer = self.buffers[0] if self.buffers else None
        fast = (
            first_buffer is not None
            and self.reduce == "none"
            and self.positions != "last"
            and first_buffer.steps > 0
            and all(b.steps == first_buffer.steps and b.first == first_buffer.first for b in self.buffers)
        )
        fits, columns = self._block_columns(block) if fast else (False, None)
        if not fits:
            for key in self.wanted:
                self.keep_steps(key, block.of(key)[since:until, slot])
            return
        assert first_buffer is not None
        self._changing()
        steps = until - since
        first = self.prompt_tokens + first_buffer.steps - 1  # the position fed at the window's first step
        lo, hi = self.window
        begin, stop = max(lo, first), min(hi, first + steps)
        for buffer in self.buffers:
            buffer.steps += steps
        if begin >= stop:
            return
        if first_buffer.first is None:
            for buffer in self.buffers:
                buffer.first = begin
        assert first_buffer.first is not None
        at = begin - first_buffer.first
        source = block.rows[since + begin - first : since + stop - first, slot]
        target = self.arena[at : at + stop - begin]
        if target.shape[0] != stop - begin:
            raise JobFailure(f"{first_buffer.point.name}: positions [{begin}, {stop}) past the rows it may keep")
        copy_columns(source, target, columns)

    def keep_pass(
        self,
        rows: torch.Tensor,
        begin: int,
        columns: dict[tuple[str, str], tuple[int, int]],
        taken: set[tuple[str, str]],
    ) -> None:
        """This job's rows of a prompt pass gathered with other jobs' (worker/hooks/pass_block.py):
        `rows[i]` holds position `begin + i` of every key of the pass side by side, key k's values
        in `columns[k] = (offset, width)`; the keys in `taken` were gathered (the others this job
        keeps one by one, `keep`). What `keep` does for each taken key at the prompt's step, in
        one copy into the arena when every point's key was taken (one gather when its points are
        not the block's columns in order)."""
        kept_by_block = [buffer for key, buffers in self.wanted.items() if key in taken for buffer in buffers]
        if not kept_by_block:
            return
        kept = int(rows.shape[0])
        if kept > self.arena.shape[0]:
            name = kept_by_block[0].point.name
            raise JobFailure(f"{name}: positions [{begin}, {begin + kept}) past the rows it may keep")
        self._changing()
        for buffer in kept_by_block:
            buffer.steps += 1
            if kept:
                buffer.first = begin
        if not kept:
            return
        if len(kept_by_block) == len(self.buffers):  # every point: one copy into the arena
            copy_columns(rows, self.arena[:kept], self._arena_columns(columns, int(rows.shape[1]))[1])
            return
        for buffer in kept_by_block:  # some keys are kept one by one: these points' columns alone
            offset, width = columns[(buffer.point.module, buffer.point.hook)]
            part = rows[:, offset : offset + width]
            if buffer.select is not None:
                part = part.index_select(1, buffer.select)
            buffer.rows[:kept].copy_(part)

    def _block_columns(self, block: Block) -> tuple[bool, torch.Tensor | None]:
        """`_arena_columns` of a decoding window's block, kept for as long as its layout lasts."""
        if self._columns is not None and self._columns[0] is block.layout:
            return True, self._columns[1]
        fits, index = self._arena_columns(block.columns, block.width)
        if fits:
            self._columns = (block.layout, index)
        return fits, index

    def _arena_columns(
        self, columns: dict[tuple[str, str], tuple[int, int]], total: int
    ) -> tuple[bool, torch.Tensor | None]:
        """A block's columns (`columns[key] = (offset, width)`, `total` in all) in this job's arena's
        order, None when they are the block's own in order (jobs keeping the same points); first
        False when a point's key is not in the block or has another width."""
        at, in_order = 0, True
        for buffer in self.buffers:
            found = columns.get((buffer.point.module, buffer.point.hook))
            if found is None or found[1] != buffer.width:
                return False, None
            in_order = in_order and buffer.select is None and found[0] == at
            at += found[1]
        if in_order and at == total:
            return True, None
        parts = []
        for buffer in self.buffers:
            offset, width = columns[(buffer.point.module, buffer.point.hook)]
            parts.append(torch.arange(offset, offset + width) if buffer.select is None else buffer.select + offset)
        return True, torch.cat(parts)

    def _keep_steps(self, buffer: _Buffer, rows: torch.Tensor) -> None:
        name, width = buffer.point.name, buffer.width
        if rows.dim() != 2 or rows.shape[1] != width:
            raise JobFailure(f"{name}: expected one row of {width} per decoding step, got {list(rows.shape)}")
        steps, step = int(rows.shape[0]), buffer.steps
        if step == 0:
            raise JobFailure(f"{name}: decoding steps before the prompt's")
        buffer.steps += steps
        self._store(buffer, rows, self.prompt_tokens + step - 1)  # from the position fed at the first step

    def _keep(self, buffer: _Buffer, rows: torch.Tensor | None) -> None:
        name, width = buffer.point.name, buffer.width
        if rows is None or rows.dim() != 2 or rows.shape[1] != width:
            raise JobFailure(f"{name}: expected [1, positions, {width}] or [positions, {width}] at step {buffer.steps}")
        step, seen = buffer.steps, int(rows.shape[0])
        if self.chunk is not None:  # a part of the prompt: its last part ends step 0
            offset, fed = self.chunk
            end = offset + fed
            if step != 0 or seen not in (1, fed):
                raise JobFailure(f"{name}: {seen} positions in a prompt chunk of {fed} at step {step}")
            buffer.steps += 1 if end == self.prompt_tokens else 0
        else:
            buffer.steps += 1
            end = self.prompt_tokens + step  # one past the last position fed so far
            if seen not in (1, end if step == 0 else 1):
                raise JobFailure(f"{name}: {seen} positions at step {step}, expected {end if step == 0 else 1} or 1")
        self._store(buffer, rows, end - seen)

    def _store(self, buffer: _Buffer, rows: torch.Tensor, first: int) -> None:
        """Keep what the job's positions want of `rows`, the values at positions `first`,
        `first + 1`...: copied into its buffer, or folded into its reduction."""
        end = first + int(rows.shape[0])
        lo, hi = self.window
        if self.positions == "last":
            lo = end - 1
        begin, stop = max(lo, first), min(hi, end)
        if begin >= stop:
            return
        chunk = rows[begin - first : stop - first]
        if buffer.select is not None:
            chunk = chunk.index_select(1, buffer.select.to(chunk.device))
        if buffer.first is None or self.positions == "last":
            buffer.first = begin
        if self.reduce != "none":
            self._fold(buffer, chunk)
            return
        at = begin - buffer.first
        buffer.rows[at : at + stop - begin].copy_(chunk)

    def _fold(self, buffer: _Buffer, chunk: torch.Tensor) -> None:
        """Fold rows into the point's float32 accumulator (on the CPU)."""
        values = chunk.to(device="cpu", dtype=torch.float32)
        if self._fold_kind in ("mean", "sum"):
            part = values.sum(dim=0)
            buffer.acc = part if buffer.acc is None else buffer.acc + part
        elif self._fold_kind == "max":
            part = values.amax(dim=0)
            buffer.acc = part if buffer.acc is None else torch.maximum(buffer.acc, part)
        else:  # last
            buffer.acc = values[-1].clone()
        buffer.count = 1 if self.positions == "last" else buffer.count + int(chunk.shape[0])

    def tensors(self, new_tokens: int) -> list[tuple[CapturePoint, torch.Tensor, int, int, list[int] | None]]:
        """(point, [rows, W], start, stop) per point once the generation ended after `new_tokens`
        (a trace: 0); a reduced point's tensor is one row, the reduction of rows [start, stop)."""
        self.settle()
        start, stop = span(self.positions, self.prompt_tokens, new_tokens, self.completion)
        steps = new_tokens if self.max_tokens else 1
        out = []
        for buffer in self.buffers:
            name = buffer.point.name
            if buffer.steps != steps:
                raise JobFailure(f"{name}: captured {buffer.steps} steps for {new_tokens} new tokens")
            if buffer.first is None or buffer.first > start:
                first = buffer.first if buffer.first is not None else self.prompt_tokens - 1
                raise JobFailure(f"{name} only has positions from {first}; use 'generated' or 'last'")
            if self.reduce != "none":
                expected = 1 if self.positions == "last" else stop - start
                if buffer.acc is None or buffer.count != expected:
                    raise JobFailure(f"{name}: reduced {buffer.count} rows for positions [{start}, {stop})")
                value = buffer.acc / buffer.count if self._fold_kind == "mean" else buffer.acc
                out.append((buffer.point, value.to(self.dtype).unsqueeze(0), start, stop, buffer.features))
                continue
            rows = buffer.rows[start - buffer.first : stop - buffer.first]
            if rows.shape[0] != stop - start:
                raise JobFailure(f"{name}: kept {rows.shape[0]} rows for positions [{start}, {stop})")
            out.append((buffer.point, rows, start, stop, buffer.features))
        return out
