"""Which of a model's modules can be captured, found by running it: a module is capturable when
its output (or first input) is one row per fed position at every step and it runs once per step.
What the worker publishes as the model's description (`ModuleInfo`), and why each other module
it entered is not capturable.
"""

from __future__ import annotations

import math

import torch

from shared.schemas import ModuleInfo
from worker.hooks.module_rows import first_input, first_tensor

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
