"""Capturing with plain PyTorch hooks: finding a model's capturable modules, and keeping, at every
forward step of a generation, only the rows a job asked for.

Why hooks and not nnsight's cache: the cache keeps every position of every step and can only be
cut after the generation (a `positions: last` job over a 1,600-token prompt held 1.8 GB to keep
1.2 MB); it hands back the module's live tensor when neither device nor dtype changes, so a parent
that edits that tensor in place after the module returns changes what was "captured"; and its
per-step loop silently returns another step's values when modules are read out of order. A hook
sees each value once, as the module returns it, and copies just the kept rows into a buffer the
job owns: memory follows the rows kept, and the values are what the module returned at that moment.

Positions. A generation of N new tokens from a P-token prompt runs N forward steps: the first
feeds positions [0, P), step k >= 1 feeds position P + k - 1. A module's value at a step is
`[1, S, H]` (or `[S, H]`) and covers the last S positions fed so far (S = P, or 1 for a module that only sees the
last position, like `lm_head` in generate). See worker/results.py for what each `positions` choice keeps.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shared.capture_spec import span
from shared.errors import InternalError, JobFailure, OutOfMemory
from shared.schemas import CapturePoint, ModuleInfo
from worker.models import home_device
from worker.row_identity import remember_all, same_all


def first_tensor(value: object) -> torch.Tensor | None:
    """A module's value: one tensor, or the first element of a tuple when that is a tensor (the
    transformers convention: `(hidden_states, attention_weights, ...)`; a `ModelOutput` counts as
    the tuple of its fields, `last_hidden_state` first) and no other element is a tensor of its
    shape (rotary embeddings return `(cos, sin)`: no one value)."""
    if isinstance(value, torch.Tensor):
        return value
    if callable(getattr(value, "to_tuple", None)):  # a transformers ModelOutput: its fields in order
        value = value.to_tuple()  # type: ignore[attr-defined]  # checked just above
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        first = value[0]
        if not any(isinstance(v, torch.Tensor) and v.shape == first.shape for v in value[1:]):
            return first
    return None


def first_input(args: tuple, kwargs: dict) -> object:
    """What a module's `input` is: its first positional argument, or its first keyword argument
    when it was called with keywords only (decoder layers get `hidden_states=` in transformers 5)."""
    if args:
        return args[0]
    return next(iter(kwargs.values()), None)


def rows_of(value: torch.Tensor) -> torch.Tensor | None:
    """A per-position value as `[S, W]`: `[1, S, H]` loses its batch dim, `[1, S, heads, D]`
    (Qwen3's q_norm) also flattens its trailing dims, and `[S, H]` (OPT's MLP and per-layer norm
    flatten the batch away) is already rows; None for any other shape."""
    if value.dim() >= 3 and value.shape[0] == 1:
        return value[0] if value.dim() == 3 else value[0].flatten(1)
    if value.dim() == 2:
        return value
    return None


# The rings of decoding steps, both kinds: the slots' device rings (worker/step_capture.py) and the
# host staging rings of the hooks below. A ring holds RING_STEPS steps of one (module, hook) for
# every row it serves, and at most RING_BYTES: 32 MiB holds all 32 steps of 64 rows (32 slots, or
# the staging ring's room for 32 jobs twice) of an 8192-wide bfloat16 value, the widest residual
# stream served here; only a wider value (lm_head's logits) holds fewer steps, and at least one.
RING_STEPS = 32
RING_BYTES = 32 << 20


def ring_depth(row_bytes: int) -> int:
    """Steps a ring holds when one step of it (every row it serves) takes `row_bytes`."""
    return max(1, min(RING_STEPS, RING_BYTES // max(1, row_bytes)))


PROBE_POSITIONS = 7  # the describe run's prompt length: unlike any head count or small width
PROBE_STEPS = 2


def _shape(value: object) -> tuple[int, ...] | str:
    """A value's shape, or why it has none (what `not_capturable` reports)."""
    tensor = first_tensor(value)
    if tensor is None:
        return "not one tensor (nor a tuple led by one)"
    if not tensor.is_floating_point():
        return f"{str(tensor.dtype).removeprefix('torch.')} values"
    return tuple(tensor.shape)


def _row_layout(shapes: list[tuple[int, ...] | str]) -> tuple[int | None, bool, str]:
    """(width, covers every position, why not) from a value's shape at each describe step. The
    first step feeds PROBE_POSITIONS positions, the second one: a value of rows is `[1, S, ...]`
    or `[S, H]` with S = 7 then 1, or `[1, 1, H]` at both steps for a module that only sees the
    last position (`lm_head` in generate)."""
    for shape in shapes:
        if isinstance(shape, str):
            return None, False, shape
    first, later = shapes
    assert not isinstance(first, str) and not isinstance(later, str)
    seen = f"shape {list(first)} then {list(later)}"
    batch_first = len(first) >= 3 and first[0] == 1
    if len(first) != len(later) or first[2 if batch_first else 1 :] != later[2 if batch_first else 1 :]:
        return None, False, f"{seen}: not one row per position"
    if not batch_first and len(first) != 2:
        return None, False, f"{seen}: no position dimension after a batch of 1"
    rows, later_rows = (first[1], later[1]) if batch_first else (first[0], later[0])
    width = math.prod(first[2:]) if batch_first else first[1]
    if later_rows == 1 and rows == PROBE_POSITIONS:
        return int(width), True, ""
    if later_rows == 1 and rows == 1 and batch_first:  # a 2-D [1, H] could as well be a pooled value
        return int(width), False, ""
    return None, False, f"{seen}: not one row per position"


def describe_modules(model: torch.nn.Module, run_forward) -> tuple[list[ModuleInfo], dict[str, str]]:
    """Every capturable module, in the order the forward pass enters them, with its widths; and
    every other module the run entered, with why it is not capturable.

    `run_forward(seq, steps)` runs a generation of `steps` forward steps from a `seq`-token prompt.
    A module is capturable when its output (or first input) is one row per fed position at every
    step (see `_row_layout`) and it runs exactly once per step: a module called twice in a step
    (one shared block) has no single value per position. Modules the run never enters (a vision
    tower when the model reads text) are not listed."""
    calls: dict[str, int] = {}
    shapes: dict[str, tuple[list, list]] = {}
    order: list[str] = []
    handles = []
    for path, module in model.named_modules():
        if not path:
            continue

        def on_enter(_module, args, kwargs, path=path):
            calls[path] = calls.get(path, 0) + 1
            if path not in shapes:
                order.append(path)
                shapes[path] = ([], [])
            shapes[path][0].append(_shape(first_input(args, kwargs)))

        def on_exit(_module, _args, output, path=path):
            shapes[path][1].append(_shape(output))

        handles.append(module.register_forward_pre_hook(on_enter, with_kwargs=True))
        handles.append(module.register_forward_hook(on_exit))
    try:
        run_forward(PROBE_POSITIONS, PROBE_STEPS)
    finally:
        for handle in handles:
            handle.remove()
    modules, skipped = [], {}
    for path in order:
        if calls[path] != PROBE_STEPS:
            skipped[path] = f"runs {calls[path]} times in {PROBE_STEPS} forward steps, not once per step"
            continue
        inputs, outputs = shapes[path]
        out_dim, out_all, out_why = _row_layout(outputs)
        in_dim, in_all, in_why = _row_layout(inputs)
        if out_dim is None and in_dim is None:
            skipped[path] = f"output: {out_why}; input: {in_why}"
            continue
        all_positions = out_all if out_dim is not None else in_all
        if out_dim is not None and in_dim is not None and out_all != in_all:
            in_dim = None  # keep one row layout per module
        modules.append(ModuleInfo(path=path, output_dim=out_dim, input_dim=in_dim, all_positions=all_positions))
    return modules, skipped


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
    """A window of decoding steps of several keys side by side (worker/step_capture.py): `rows`
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
        self.failure: JobFailure | None = None  # rows handed over late (BatchHooks.drain) did not fit
        # Windows of decoding steps handed to the capture writer thread and not yet kept
        # (worker/step_capture.py): the job's result waits for them (`settle`).
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
        self.arena = torch.empty((rows, total), dtype=dtype, device="cpu")  # position-major: row i, every point
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
        if columns is None:
            target.copy_(source)
        elif source.dtype == target.dtype:
            torch.index_select(source, 1, columns, out=target)
        else:
            target.copy_(source.index_select(1, columns))

    def _block_columns(self, block: Block) -> tuple[bool, torch.Tensor | None]:
        """The block's columns this job keeps, in its arena's order (None: the block's own, in
        order); first False when a point's key is not in the block or has another width."""
        if self._columns is not None and self._columns[0] is block.layout:
            return True, self._columns[1]
        parts = []
        for buffer in self.buffers:
            found = block.columns.get((buffer.point.module, buffer.point.hook))
            if found is None or found[1] != buffer.width:
                return False, None
            offset, width = found
            parts.append(torch.arange(offset, offset + width) if buffer.select is None else buffer.select + offset)
        index = torch.cat(parts)
        whole = index.numel() == block.width and bool((index == torch.arange(block.width)).all())
        self._columns = (block.layout, None if whole else index)
        return True, self._columns[1]

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


def split_rows(value: torch.Tensor | None, batch: int) -> list[torch.Tensor | None]:
    """A module's value for a batch of `batch` sequences, as each sequence's `[S, W]` rows:
    `[B, S, H]` and `[B, S, heads, D]` split on the batch dim; a 2-D `[B * S, H]` (OPT's MLP and
    per-layer norm flatten the batch) splits into B equal runs of rows."""
    if value is None:
        return [None] * batch
    if value.dim() >= 3 and value.shape[0] == batch:
        return [rows_of(value[b : b + 1]) for b in range(batch)]
    if value.dim() == 2 and value.shape[0] % batch == 0:
        return list(value.view(batch, value.shape[0] // batch, value.shape[1]).unbind(0))
    return [None] * batch


def _failure(exc: BaseException) -> JobFailure:
    """A job's failure for an exception raised while handing it its rows."""
    if isinstance(exc, JobFailure):
        return exc
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in str(exc).lower():
        return OutOfMemory("the model ran out of memory on this job; ask for fewer tokens or capture less")
    return InternalError(f"{type(exc).__name__}: {str(exc)[:500]}")


def step_rows(value: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """A module's value at a decoding step (one new position per sequence) as `[B, W]`: `[B, 1, H]`,
    `[B, 1, heads, D]` and `[B, H]` (OPT's flattened batch); None for any other shape."""
    if value is None or value.shape[0] != batch:
        return None
    if value.dim() >= 3 and value.shape[1] == 1:
        return value.reshape(batch, -1)
    if value.dim() == 2:
        return value
    return None


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

    def __enter__(self) -> BatchHooks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """The hooks removed (until the next `use`): the slots' decoding steps capture through
        worker/step_capture.py, and no hook of a prefill may run inside them."""
        for handle in self._handles.values():
            handle.remove()  # type: ignore[attr-defined]  # a torch RemovableHandle
        self._handles.clear()
        self._wanted_for = ()

    def use(self, rows: list[JobCapture | None], lengths: list[int] | None = None, decoding: bool = False) -> None:
        """The sequences of the next forward pass, in batch order: hooks for what they capture.
        `lengths`: the pass is left-padded and row b's own positions are its last `lengths[b]`.
        `decoding`: every sequence feeds one position (batched gathers, see the class)."""
        self.settle(rows, decoding)
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
                capture.failure = failed[id(capture)] = _failure(exc)
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
