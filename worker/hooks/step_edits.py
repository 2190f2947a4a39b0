"""Edits at the slots' decoding steps as tensor operations on persistent tables, so a step that
edits is graph-safe and replays as a CUDA graph like one that does not.

Each edited (module, hook) has, per depth (a row's first, second... edit there, applied in the
request's order, as worker/hooks/edits.py does), tables indexed by slot: the op's kind (0: none, the
row keeps its value exactly), each parameter of the ops (worker/hooks/edit_ops.py `PARAMS`), and
up to SPANS intervals of token positions it applies to. The step's hook computes, for the whole
batch, the rows an op of each kind present selects at the position each row feeds (read from
the batch's state on the device) and applies it with `torch.where`: the op of edit_ops.py that
the hooks' groups apply too, in the same order and dtype, so a row's values are what its eager
step gives. A row that
joins writes its rows of the tables in place (`sync`); one that leaves sets its kind back to 0.
Tables have a row per slot of the batch (its most slots) and are never rebuilt.

A gated edit (`when`) is in the tables too: its probe and its bias and threshold (signed, so
that "below" is "above" of the negated score) per slot, and its op's code has the GATED bit; the
step computes each gated row's score from the incoming value and applies the op where it passes,
as worker/hooks/edits.py does. Where it fired is written, per slot, at the position the row fed (a
`[slots, positions]` flag table), and read once when the row leaves (`collect`): the counts its
report gives per step.

An edit that applies only to prompt positions is no decoding step's: it is not in the tables. A
patch that reaches decoding positions, or an edit over more than SPANS intervals, is not in
tables: a batch with any of them runs its steps eagerly with worker/hooks/edits.py (`fits`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from shared.errors import JobFailure
from worker.hooks import edit_ops
from worker.hooks.edits import JobEdits, RowEdit
from worker.hooks.module_rows import first_input
from worker.hooks.paths import PassRows
from worker.hooks.row_identity import remember, same

Key = tuple[str, str]  # (module path, hook)
SPANS = 4  # position intervals an edit in a table may have
KINDS = {kind: code for code, kind in enumerate(edit_ops.OPS, start=1)}  # an op's code in the tables (0: none)
NAMES = {code: kind for kind, code in KINDS.items()}
GATED = 8  # added to a gated edit's kind code
assert len(KINDS) < GATED
NEVER = (0, 0)  # an empty interval
EditPlan = frozenset[tuple[Key, int, int]]  # (key, depth, kind code) of each op a step applies


def fits(edits: JobEdits) -> bool:
    """Whether a job's edits can live in the tables (see the module): those that reach a decoding
    step can (a patch of prompt positions, the usual one, never does)."""
    return all(e.kind in KINDS and len(e.spans) <= SPANS for e in edits.edits if decodes(e, edits.prompt_tokens))


def decodes(edit: RowEdit, prompt_tokens: int) -> bool:
    """Whether an edit applies at any decoding step (they feed positions from `prompt_tokens` on)."""
    return any(hi > prompt_tokens for _, hi in edit.spans)


def code(edit: RowEdit) -> int:
    """The table's code of an edit's op: its kind, plus GATED for a gated one."""
    return KINDS[edit.kind] + (GATED if edit.gate is not None else 0)


class _Table:
    """One depth of one (module, hook): per slot, its op and parameters."""

    def __init__(self, slots: int, width: int, positions: int, device: torch.device) -> None:
        self.width = width
        self.kind = torch.zeros(slots, dtype=torch.int64, device=device)
        self.spans = torch.zeros((slots, SPANS, 2), dtype=torch.int64, device=device)
        # each op's parameters (worker/hooks/edit_ops.py), float32 as the jobs' edits are: cast to
        # the value's dtype where applied, as the hooks' groups are
        self.params = {
            name: torch.full(
                (slots, width if param.features else 1),
                param.fill,
                dtype=torch.bool if param.boolean else torch.float32,
                device=device,
            )
            for name, param in edit_ops.PARAMS.items()
        }
        self.probe = torch.zeros((slots, width), dtype=torch.float32, device=device)  # gated: signed probe
        self.gate = torch.zeros((slots, 2), dtype=torch.float32, device=device)  # gated: signed bias, threshold
        self.fired = torch.zeros((slots, positions), dtype=torch.bool, device=device)  # gated: by fed position
        self.kinds = [0] * slots  # the host's copy of `kind`

    def set_row(self, slot: int, edit: RowEdit) -> None:
        kind = edit.kind
        spans = (list(edit.spans) + [NEVER] * SPANS)[:SPANS]
        self.spans[slot].copy_(torch.tensor(spans, dtype=torch.int64))
        for name in edit_ops.OPS[kind].params:
            self.params[name][slot].copy_(edit_ops.PARAMS[name].of(edit, name))
        if edit.gate is not None:
            probe, bias, threshold, sign = edit.gate
            self.probe[slot].copy_(probe * sign)
            self.gate[slot].copy_(torch.tensor([bias * sign, threshold * sign], dtype=torch.float32))
        self.fired[slot].zero_()  # a step run with the eager hooks writes no flag: it counts 0 here
        self.kind[slot] = code(edit)
        self.kinds[slot] = code(edit)

    def grown(self, positions: int) -> None:
        """Longer slots: a longer flag table (a new tensor, the old flags kept)."""
        if positions > self.fired.shape[1]:
            fired = self.fired.new_zeros(self.fired.shape[0], positions)
            fired[:, : self.fired.shape[1]].copy_(self.fired)
            self.fired = fired

    def more_slots(self, slots: int) -> None:
        """Rows for `slots` slots (new tensors; the rows held kept, the new ones at no op)."""
        grow = slots - self.kind.shape[0]
        if grow <= 0:
            return

        def grown(t: torch.Tensor, fill: float | bool = 0) -> torch.Tensor:
            return torch.cat([t, t.new_full((grow, *t.shape[1:]), fill)])

        self.kind, self.spans, self.probe, self.gate = (
            grown(t) for t in (self.kind, self.spans, self.probe, self.gate)
        )
        self.fired = grown(self.fired, False)
        self.params = {name: grown(t, edit_ops.PARAMS[name].fill) for name, t in self.params.items()}
        self.kinds += [0] * grow

    def clear_row(self, slot: int) -> None:
        if self.kinds[slot]:
            self.kind[slot] = 0
            self.kinds[slot] = 0


class StepEdits:
    """The edit tables of one persistent batch of `slots` slots (see the module)."""

    def __init__(self, model: torch.nn.Module, state: torch.Tensor, column: int, positions: int) -> None:
        self.model, self.slots = model, int(state.shape[0])
        self.state, self.column = state, column  # the batch's [slots, k] state; `column`: what each slot feeds next
        self.positions = positions  # a slot's positions (the gated edits' flags)
        self.tables: dict[Key, list[_Table]] = {}
        self._rows: list[Any] = [None] * self.slots  # weakref to each slot's JobEdits (None: no edits)
        self._plan: EditPlan = frozenset()  # `begin`'s step

    def begin(self, rows: list[JobEdits | None], at: PassRows) -> None:
        """`EditPath.begin` (worker/hooks/paths.py) of a decoding step over slots [0, n): the tables
        hold the rows' edits (`sync`), and the step applies the ops they take (`plan`)."""
        assert at.decoding and at.lo == 0, "the tables edit a decoding step of the slots from slot 0"
        self.sync(rows)
        self._plan = self.plan(at.rows)

    def record(self, at: PassRows) -> AbstractContextManager[object]:
        """`EditPath.record`: the tables' hooks on slots [at.lo, at.lo + at.rows) for the pass."""
        return self.recording(self._plan, at.lo, at.rows)

    def finish(self) -> None:
        """`EditPath.finish`: nothing to keep on the host; the gates' flags are in the tables."""

    def close(self) -> None:
        """`EditPath.close`: nothing to remove, the hooks live inside `record` only."""

    def sync(self, rows: list[JobEdits | None]) -> None:
        """The tables hold `rows`' edits (each a running slot's, None: none; slots past them:
        none): rows that changed since the last step are written, in place."""
        for slot in range(self.slots):
            edits = rows[slot] if slot < len(rows) else None
            if same(self._rows[slot], edits):
                continue
            for layers in self.tables.values():
                for table in layers:
                    table.clear_row(slot)
            self._rows[slot] = remember(edits)
            if edits is not None:
                for key, key_edits in edits.by_key.items():
                    for depth, edit in enumerate(key_edits):
                        if decodes(edit, edits.prompt_tokens):
                            self._table(key, depth, edit).set_row(slot, edit)

    def _table(self, key: Key, depth: int, edit: RowEdit) -> _Table:
        layers = self.tables.setdefault(key, [])
        while len(layers) <= depth:
            like = edit.vector if edit.vector is not None else edit.factor if edit.factor is not None else edit.zeroed
            assert like is not None
            layers.append(_Table(self.slots, int(like.shape[0]), self.positions, self.state.device))
        return layers[depth]

    def grown(self, positions: int) -> None:
        """Longer slots (the graphs, which read the old flag tables, are dropped with them)."""
        self.positions = max(self.positions, positions)
        for layers in self.tables.values():
            for table in layers:
                table.grown(self.positions)

    def resized(self, state: torch.Tensor) -> None:
        """More slots: `state` is the batch's new `[slots, k]` state (a batch whose slots grew)."""
        self.state = state
        grow = int(state.shape[0]) - self.slots
        if grow > 0:
            for layers in self.tables.values():
                for table in layers:
                    table.more_slots(int(state.shape[0]))
            self._rows += [None] * grow
            self.slots = int(state.shape[0])

    def collect(self, slot: int, edits: JobEdits, prompt_tokens: int, steps: int) -> None:
        """A leaving row's gated edits: where each fired at its decoding steps 1..steps-1 (step k
        fed position prompt_tokens - 1 + k), read once, into the edit's `fired` (its report)."""
        for key, key_edits in edits.by_key.items():
            for depth, edit in enumerate(key_edits):
                if edit.gate is None or steps < 2 or not decodes(edit, edits.prompt_tokens):
                    continue
                # a copy: on the CPU `.cpu()` is the table itself, and the slot's next job clears it
                flags = (
                    self.tables[key][depth].fired[slot, prompt_tokens : prompt_tokens + steps - 1].to("cpu", copy=True)
                )
                edit.fired.extend((k, flags, k - 1) for k in range(1, steps))

    def plan(self, rows: int) -> EditPlan:
        """(key, depth, kind) of every op a slot in [0, rows) takes: what a step's graph holds."""
        return frozenset(
            (key, depth, kind)
            for key, layers in self.tables.items()
            for depth, table in enumerate(layers)
            for kind in set(table.kinds[:rows])
            if kind
        )

    @contextmanager
    def recording(self, plan: EditPlan, lo: int, rows: int, slots: list[int] | None = None):
        """Hooks (in front of any other on the module) that apply `plan` to slots [lo, lo + rows)
        for one forward pass of a decoding step; with `slots`, row b is slot `slots[b]`'s (a batch
        whose rows keep their slots in another order: worker/batch/state_decoding.py)."""
        handles = []
        part: slice | torch.Tensor = slice(lo, lo + rows)
        if slots is not None:
            part = torch.tensor(slots, dtype=torch.int64, device=self.state.device)
        by_key: dict[Key, list[tuple[int, int]]] = {}
        for key, depth, kind in sorted(plan):
            by_key.setdefault(key, []).append((depth, kind))
        try:
            for key, ops in by_key.items():
                module = self.model.get_submodule(key[0])
                if key[1] == "output":

                    def on_output(_module, _args, output, key=key, ops=ops):
                        return self._edit_output(key, ops, output, part, rows)

                    handles.append(module.register_forward_hook(on_output, prepend=True))
                else:

                    def on_input(_module, args, kwargs, key=key, ops=ops):
                        return self._edit_input(key, ops, args, kwargs, part, rows)

                    handles.append(module.register_forward_pre_hook(on_input, prepend=True, with_kwargs=True))
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _edit_output(self, key: Key, ops, output: Any, part: slice | torch.Tensor, rows: int) -> Any:
        if isinstance(output, torch.Tensor):
            return self._apply(key, ops, output, part, rows)
        if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
            return type(output)([self._apply(key, ops, output[0], part, rows), *output[1:]])
        raise JobFailure(f"{key[0]}: its output is not a tensor this edit can change")

    def _edit_input(
        self, key: Key, ops, args: tuple, kwargs: dict, part: slice | torch.Tensor, rows: int
    ) -> tuple[tuple, dict]:
        value = first_input(args, kwargs)
        if not isinstance(value, torch.Tensor):
            raise JobFailure(f"{key[0]}: its input is not a tensor this edit can change")
        edited = self._apply(key, ops, value, part, rows)
        if args:
            return (edited, *args[1:]), kwargs
        name = next(iter(kwargs))
        return args, {**kwargs, name: edited}

    def _apply(self, key: Key, ops, value: torch.Tensor, part: slice | torch.Tensor, rows: int) -> torch.Tensor:
        """`value` of a decoding step (`[B, 1, ...]` or `[B, W]`) with the ops applied, depth by
        depth and kind by kind, each to the rows it selects; `part`: the slots of its rows."""
        if value.shape[0] != rows or (value.dim() > 2 and value.shape[1] != 1):
            raise JobFailure(f"{key[0]}: a decoding step's value of shape {list(value.shape)} for {rows} rows")
        x = value.reshape(rows, 1, -1)
        position = self.state[part, self.column].reshape(rows, 1)
        by_depth: dict[int, list[int]] = {}
        for depth, kind in ops:
            by_depth.setdefault(depth, []).append(kind)
        for depth, kinds in sorted(by_depth.items()):
            table = self.tables[key][depth]
            if x.shape[2] != table.width:
                raise JobFailure(f"{key[0]}: {x.shape[2]} features, the edit has {table.width}")
            spans = table.spans[part]
            inside = ((spans[:, :, 0] <= position) & (position < spans[:, :, 1])).any(-1)
            fired = None
            for kind in kinds:
                where = (inside & (table.kind[part] == kind)).reshape(rows, 1, 1)
                if kind & GATED:  # worker/hooks/edits.py's gate: signed score against signed threshold
                    gate = table.gate[part].unsqueeze(1)
                    score = (x.to(torch.float32) * table.probe[part].unsqueeze(1)).sum(-1, keepdim=True)
                    where = where & (score + gate[..., 0:1] > gate[..., 1:2])
                    fired = where if fired is None else fired | where
                x = torch.where(where, self._edited(table, kind & ~GATED, x, part), x)
            if fired is not None:  # each row's flag at the position it fed (a row's own op wrote it)
                if isinstance(part, slice):
                    table.fired[part].scatter_(1, position, fired.reshape(rows, 1))
                else:
                    table.fired.index_put_((part.unsqueeze(1), position), fired.reshape(rows, 1))
        return x.reshape(value.shape)

    @staticmethod
    def _edited(table: _Table, kind: int, x: torch.Tensor, part: slice | torch.Tensor) -> torch.Tensor:
        """`x` under the op `kind` (worker/hooks/edit_ops.py) with every row's parameters (the rows
        that take it are chosen by the caller)."""
        op = edit_ops.OPS[NAMES[kind]]
        params = {}
        for name in op.params:
            values = table.params[name][part].unsqueeze(1)
            params[name] = values if edit_ops.PARAMS[name].boolean else values.to(x.dtype)
        return op.apply(x, params)
