"""Applying interventions (shared/interventions.py) inside the batch's forward passes.

One forward hook per edited (module, hook), registered in front of any capture hook on it
(`prepend=True`): a capture on the same module and hook sees the edited value, and an `input`
edit changes what the module itself computes from. Each hook applies, for the whole batch at
once, every row's edits there in each row's request order: edits of one kind at the same place
in their rows' lists form one group, applied as one tensor operation with a per-row parameter
tensor (`[B, 1, W]`) and a per-position mask (`[B, S, 1]`), never a Python loop over rows. A row
outside a group, or a position outside its selection, keeps its value exactly (`torch.where`).
What each kind's op computes, and its parameters, is worker/hooks/edit_ops.py's (the step tables
apply the same ops); a patch's values, the source job's rows by position, are this module's.

Positions, as in capture: a pass feeds row b's positions [start, start + n), right-aligned in the
pass's S columns (a left-padded prompt pass), and generated step k is position P - 1 + k. An
ungated edit touches exactly the positions it selects, so its count per step follows from its
selection; a gated edit's positions are kept per pass (the mask it applied) once the pass has
succeeded (`flush`), so a pass that failed and ran again counts once, and counted when the job
ends.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from shared.errors import JobFailure
from shared.interventions import EditReport, Intervention, intervals
from worker.hooks import edit_ops
from worker.hooks.module_rows import first_input
from worker.hooks.paths import PassRows
from worker.hooks.row_identity import remember_all, same_all

Key = tuple[str, str]  # (module path, hook)


@dataclass(eq=False)
class RowEdit:
    """One edit at one module for one job, with its parameters on the model's device (float32)."""

    index: int  # the edit's place in the request's `interventions`
    module: str
    hook: str
    op: str
    spans: list[tuple[int, int]]  # the token positions it applies to, sorted and disjoint
    # the ops' parameters (worker/hooks/edit_ops.py `PARAMS`, made by its `make`)
    vector: torch.Tensor | None = None
    normalize: bool = False  # add: the vector was normalized (the `add_norm` op)
    factor: torch.Tensor | None = None
    zeroed: torch.Tensor | None = None
    value: float = 0.0
    patch_first: int = 0  # patch: the token position of `patch_rows[0]`
    patch_rows: torch.Tensor | None = None
    gate: tuple[torch.Tensor, float, float, float] | None = None  # (probe, bias, threshold, +1 above / -1 below)
    fired: list[tuple[int, torch.Tensor, int]] = field(default_factory=list)  # gated: (step, where [B, S, 1], row)

    @property
    def kind(self) -> str:
        return ("add_norm" if self.normalize else "add") if self.op == "add" else self.op

    def touched(self, start: int, n: int) -> int:
        """Positions of [start, start + n) this edit selects."""
        end = start + n
        return sum(max(0, min(hi, end) - max(lo, start)) for lo, hi in self.spans)


class JobEdits:
    """A job's edits, ready for its passes: built by `build` once the prompt is tokenized."""

    def __init__(self, edits: list[RowEdit], prompt_tokens: int) -> None:
        self.edits, self.prompt_tokens = edits, prompt_tokens
        self.by_key: dict[Key, list[RowEdit]] = {}
        for edit in edits:
            self.by_key.setdefault((edit.module, edit.hook), []).append(edit)

    def step_of(self, start: int, n: int) -> int:
        """The forward step a pass over positions [start, start + n) belongs to: 0 for the prompt
        (every chunk of it), k for the pass at position P - 1 + k."""
        return max(0, start + n - self.prompt_tokens)

    def saved(self) -> list[int]:
        """How many gated passes each edit has kept (for `Undo`)."""
        return [len(e.fired) for e in self.edits]

    def restore(self, saved: list[int]) -> None:
        for edit, fired in zip(self.edits, saved, strict=True):
            del edit.fired[fired:]

    def reports(self, ops: list[str], steps: int) -> list[EditReport]:
        """`result.interventions`: per edit and module, positions touched at each of `steps`
        forward steps. An ungated edit touches exactly the positions it selects among those each
        step feeds (step 0: the prompt's, step k: P - 1 + k); a gated one, those where its gate
        fired, from the masks its passes kept (read from the device here, once)."""
        out = []
        for edit in self.edits:
            counts: dict[int, int] = {}
            if edit.gate is None:
                prompt = self.prompt_tokens
                counts = {0: edit.touched(0, prompt)}
                counts.update({k: edit.touched(prompt - 1 + k, 1) for k in range(1, steps)})
            if edit.fired:
                values = torch.stack([t[row].sum() for _, t, row in edit.fired]).tolist()
                for (step, _, _), value in zip(edit.fired, values, strict=True):
                    counts[step] = counts.get(step, 0) + int(value)
            applied = [counts.get(k, 0) for k in range(steps)]
            out.append(
                EditReport(
                    index=edit.index,
                    module=edit.module,
                    hook=edit.hook,
                    op=ops[edit.index],
                    applied=applied,
                    total=sum(applied),
                )
            )
        return out


def _vector(vectors: Callable[[int, str, int], torch.Tensor], index: int, width: int, name: str) -> torch.Tensor:
    return vectors(index, name, width)


def _param_of(param: edit_ops.Param, name: str, edit: RowEdit) -> torch.Tensor:
    return param.of(edit, name)


def build(
    request_edits: list[Intervention],
    points: Sequence[tuple[int, str, str, int]],  # (edit index, module, hook, width) in the API's order
    vectors: Callable[[int, str, int], torch.Tensor],  # (edit index, field, width) -> [W] float32 on the device
    patch: Callable[[int, str, str, int], tuple[int, torch.Tensor]],  # -> (first position, rows [n, W])
    prompt_tokens: int,
    max_tokens: int,
    device: torch.device | str,
) -> JobEdits:
    """A job's edits at each of its modules. Raises JobFailure for what only the tokenized prompt
    can show (a prompt index past its end, patch positions outside the source's rows)."""
    built: list[RowEdit] = []
    for index, module, hook, width in points:
        edit = request_edits[index]
        where = f"interventions[{index}] at {module}"
        try:
            spans = intervals(edit.positions, prompt_tokens, max_tokens)
        except ValueError as exc:
            raise JobFailure(f"{where}: {exc} (the prompt is {prompt_tokens} tokens)") from None
        row = RowEdit(index=index, module=module, hook=hook, op=edit.op, spans=spans)
        if edit.op == "patch":
            first, rows = patch(index, module, hook, width)
            last = first + int(rows.shape[0])
            outside = [(lo, hi) for lo, hi in spans if lo < first or hi > last]
            if outside:
                raise JobFailure(
                    f"{where}: the patch applies to positions {spans[0][0]} to {spans[-1][1] - 1}; the source "
                    f"job's rows cover positions {first} to {last - 1}: patch positions its capture kept"
                )
            row.patch_first, row.patch_rows = first, rows
        else:
            edit_ops.make(row, edit, width, functools.partial(_vector, vectors, index, width), device, where)
        if edit.when is not None:
            gate = edit.when
            probe = vectors(index, "when.probe", width)
            above = gate.above is not None
            threshold = gate.above if gate.above is not None else gate.below
            assert threshold is not None
            row.gate = (probe, gate.bias, threshold, 1.0 if above else -1.0)
        built.append(row)
    return JobEdits(built, prompt_tokens)


@dataclass(eq=False)
class _Group:
    """Edits of one kind (gated or not) at one place in their rows' lists, on one (module, hook)."""

    kind: str
    gated: bool
    members: list[tuple[int, RowEdit]]  # (batch row, its edit)
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # built at the first pass (dtype, device)
    mask_for: tuple | None = None
    mask: torch.Tensor | None = None
    folded: dict[str, torch.Tensor] | None = None  # a decoding step's parameters with the mask in them
    folded_for: tuple | None = None

    def build(self, batch: int, width: int, like: torch.Tensor) -> None:
        dtype, device = like.dtype, like.device
        rows = torch.tensor([b for b, _ in self.members], device=device)

        def stacked(
            get: Callable[[RowEdit], torch.Tensor], fill: float | bool, kind: torch.dtype, size: int = width
        ) -> torch.Tensor:
            full = torch.full((batch, 1, size), fill, dtype=kind, device=device)
            full[rows, 0] = torch.stack([get(e).to(device=device, dtype=kind) for _, e in self.members])
            return full

        op = edit_ops.OPS.get(self.kind)
        for name in op.params if op is not None else ():  # a patch's values are not parameters
            param = edit_ops.PARAMS[name]
            size = width if param.features else 1
            self.params[name] = stacked(
                functools.partial(_param_of, param, name),
                param.fill,
                torch.bool if param.boolean else dtype,
                size,
            )
        if self.gated:
            # The sign (+1 above, -1 below) goes into the probe, the bias and the threshold: exact
            # (a negation), so `score > threshold` is one comparison either way, in float32.
            self.params["probe"] = stacked(lambda e: e.gate[0] * e.gate[3], 0.0, torch.float32)  # type: ignore[index]
            gates = [e.gate for _, e in self.members]
            host = torch.zeros((batch, 2), dtype=torch.float32)
            host[[b for b, _ in self.members]] = torch.tensor(
                [[g[1] * g[3], g[2] * g[3]] for g in gates if g is not None]
            )
            self.params["gate"] = host.to(device=device).view(batch, 1, 2)


@dataclass
class _Pass:
    """What the pass now running feeds: per batch row (start, n) of its real positions, and the
    pass's width S (columns; a row's positions are its last n)."""

    spans: list[tuple[int, int]]
    width: int


class BatchEdits:
    """The edit hooks of the running batch. `use` before each forward pass (with each row's
    positions), `flush` after it succeeded; a batch with no edits costs nothing (no hook)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.rows: list[JobEdits | None] = []
        self._handles: dict[Key, Any] = {}
        self._plan: dict[Key, list[list[_Group]]] = {}
        self._plan_for: tuple[weakref.ref | None, ...] = ()
        self._pass = _Pass([], 0)
        self._pending: list[tuple[RowEdit, int, torch.Tensor, int]] = []  # gated: (edit, step, where, row)

    def begin(self, rows: list[JobEdits | None], at: PassRows) -> None:
        """`EditPath.begin` (worker/hooks/paths.py): `use`."""
        self.use(rows, at.spans, at.width)

    def record(self, at: PassRows) -> AbstractContextManager[object]:
        """`EditPath.record`: nothing to add, the hooks stay on their modules from `begin`."""
        return nullcontext()

    def finish(self) -> None:
        """`EditPath.finish`: `flush`."""
        self.flush()

    def close(self) -> None:
        for handle in self._handles.values():
            handle.remove()
        self._handles = {}

    def use(self, rows: list[JobEdits | None], spans: list[tuple[int, int]], width: int) -> None:
        self._pending = []
        if not any(r is not None for r in rows):
            if self._handles:
                self.close()
                self._plan, self._plan_for = {}, ()
            self.rows = rows
            return
        self.rows, self._pass = rows, _Pass(spans, width)
        if same_all(self._plan_for, rows):  # the same batch as the last pass (most steps): the same hooks
            return
        self._plan = self._make_plan(rows)
        self._plan_for = remember_all(rows)
        for key in [k for k in self._handles if k not in self._plan]:
            self._handles.pop(key).remove()
        for key in self._plan.keys() - self._handles.keys():
            module = self.model.get_submodule(key[0])
            if key[1] == "output":

                def on_output(_module, _args, output, key=key):
                    return self._edit_output(key, output)

                self._handles[key] = module.register_forward_hook(on_output, prepend=True)
            else:

                def on_input(_module, args, kwargs, key=key):
                    return self._edit_input(key, args, kwargs)

                self._handles[key] = module.register_forward_pre_hook(on_input, prepend=True, with_kwargs=True)

    def flush(self) -> None:
        """After a pass that succeeded: the positions its gates fired at become the jobs'."""
        pending, self._pending = self._pending, []
        for edit, step, where, row in pending:
            edit.fired.append((step, where, row))

    @staticmethod
    def _make_plan(rows: list[JobEdits | None]) -> dict[Key, list[list[_Group]]]:
        plan: dict[Key, list[list[_Group]]] = {}
        for b, job in enumerate(rows):
            if job is None:
                continue
            for key, edits in job.by_key.items():
                layers = plan.setdefault(key, [])
                for depth, edit in enumerate(edits):
                    if depth == len(layers):
                        layers.append([])
                    kind, gated = edit.kind, edit.gate is not None
                    group = next((g for g in layers[depth] if g.kind == kind and g.gated == gated), None)
                    if group is None:
                        group = _Group(kind, gated, [])
                        layers[depth].append(group)
                    group.members.append((b, edit))
        return plan

    # -- in the hooks ------------------------------------------------------------------------

    def _edit_output(self, key: Key, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return self._apply(key, output)
        if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
            return type(output)([self._apply(key, output[0]), *output[1:]])
        if callable(getattr(output, "to_tuple", None)):  # a transformers ModelOutput
            first = next(iter(output.keys()))
            output[first] = self._apply(key, output[first])
            return output
        raise JobFailure(f"{key[0]}: its output is not a tensor this edit can change")

    def _edit_input(self, key: Key, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        value = first_input(args, kwargs)
        if not isinstance(value, torch.Tensor):
            raise JobFailure(f"{key[0]}: its input is not a tensor this edit can change")
        edited = self._apply(key, value)
        if args:
            return (edited, *args[1:]), kwargs
        name = next(iter(kwargs))
        return args, {**kwargs, name: edited}

    def _apply(self, key: Key, value: torch.Tensor) -> torch.Tensor:
        batch, pass_ = len(self.rows), self._pass
        if value.dim() == 3 and value.shape[0] == batch:  # [B, S, W]: the common case, no reshape
            x = value
        elif value.dim() > 3 and value.shape[0] == batch:
            x = value.reshape(batch, value.shape[1], -1)
        elif value.dim() == 2 and value.shape[0] % batch == 0:
            x = value.view(batch, value.shape[0] // batch, value.shape[1])
        else:
            raise JobFailure(f"{key[0]}: a value of shape {list(value.shape)} for a batch of {batch}")
        if x.shape[1] != pass_.width:
            raise JobFailure(f"{key[0]}: {x.shape[1]} positions in a pass of {pass_.width}")
        for layer in self._plan[key]:
            for group in layer:
                x = self._apply_group(group, x)
        return x if x.shape == value.shape else x.reshape(value.shape)

    def _positions(self, group: _Group, like: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """`[B, S, 1]` bool: where this pass's positions are selected, per member row (cached while
        the selection stays the same: most decoding steps); and whether that is every position of
        every row (then the edit needs no mask)."""
        pass_ = self._pass
        width = pass_.width
        if width == 1:  # a decoding step: one position per row, in its selection or not
            picks = tuple(edit.touched(*pass_.spans[b]) for b, edit in group.members)
            if group.mask_for != picks or group.mask is None:
                host = torch.zeros((len(self.rows), 1, 1), dtype=torch.bool)
                for (b, _), pick in zip(group.members, picks, strict=True):
                    host[b] = bool(pick)
                group.mask, group.mask_for = host.to(like.device), picks
            return group.mask, len(group.members) == len(self.rows) and all(picks)
        rows = []
        full = len(group.members) == len(self.rows)
        for b, edit in group.members:
            start, n = pass_.spans[b]
            pad, end = width - n, start + n
            cuts = tuple(
                (pad + max(lo, start) - start, pad + min(hi, end) - start)
                for lo, hi in edit.spans
                if lo < end and hi > start
            )
            full = full and cuts == ((0, width),)
            rows.append((b, cuts))
        signature = (width, tuple(rows))
        if group.mask_for != signature or group.mask is None:
            host = torch.zeros((len(self.rows), width, 1), dtype=torch.bool)
            for b, cuts in rows:
                for lo, hi in cuts:
                    host[b, lo:hi] = True
            group.mask = host.to(like.device)
            group.mask_for = signature
        return group.mask, full

    def _apply_group(self, group: _Group, x: torch.Tensor) -> torch.Tensor:
        if not group.params:
            group.build(len(self.rows), int(x.shape[2]), x)
        p = group.params
        where, full = self._positions(group, x)
        op = edit_ops.OPS.get(group.kind)
        if not full and not group.gated and self._pass.width == 1 and op is not None and op.folds:
            return self._apply_folded(group, x, where)
        if group.gated:
            gate = p["gate"]
            score = (x.to(torch.float32) * p["probe"]).sum(-1, keepdim=True) + gate[..., 0:1]
            where = where & (score > gate[..., 1:2])
            fired = where  # counted when the job ends (`reports`), not in every step
        edited = op.apply(x, p) if op is not None else self._patch_values(group, x)
        if group.gated:  # an ungated edit's count per step follows from its selection (`reports`)
            pass_ = self._pass
            for b, edit in group.members:
                start, n = pass_.spans[b]
                self._pending.append((edit, self.rows[b].step_of(start, n), fired, b))  # type: ignore[union-attr]
        if full and not group.gated:  # every position of every row: nothing to keep as it was
            return edited
        return torch.where(where, edited, x)

    @staticmethod
    def _apply_folded(group: _Group, x: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        """A decoding step of an ungated op that folds (edit_ops `Op.folds`) and that some rows do
        not take: the mask folded into the parameters once while it stays the same (a row that
        takes no edit holds each parameter's fill: its value exactly), so each step is one
        operation, not two."""
        op = edit_ops.OPS[group.kind]
        if group.folded is None or group.folded_for != group.mask_for:
            fills = {name: edit_ops.PARAMS[name].fill for name in op.params}
            group.folded = {name: torch.where(where, group.params[name], fill) for name, fill in fills.items()}
            group.folded_for = group.mask_for
        return op.apply(x, group.folded)

    def _patch_values(self, group: _Group, x: torch.Tensor) -> torch.Tensor:
        """`[B, S, W]`: each member row's source rows at the positions this pass feeds (zeros
        elsewhere; `where` keeps only the selected ones)."""
        values = torch.zeros_like(x)
        width = self._pass.width
        for b, edit in group.members:
            start, n = self._pass.spans[b]
            assert edit.patch_rows is not None
            first, count = edit.patch_first, int(edit.patch_rows.shape[0])
            lo, hi = max(start, first), min(start + n, first + count)
            if lo < hi:
                pad = width - n
                values[b, pad + lo - start : pad + hi - start] = edit.patch_rows[lo - first : hi - first].to(
                    device=x.device, dtype=x.dtype
                )
        return values
