"""The capture hooks on plain torch modules: what is stored is what a module returned (or
received) at that moment, whatever its parent does to the tensor afterwards."""

from __future__ import annotations

import torch

from shared.schemas import CapturePoint
from worker.hooks.capturable import describe_modules
from worker.hooks.capture import JobCapture
from worker.hooks.capture_hooks import BatchHooks


class EditsInPlace(torch.nn.Module):
    """Like Falcon's parallel-attention block: the parent adds into its child's output in place."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Linear(4, 4)
        self.attn = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.mlp(x)
        out += self.attn(x)  # after mlp returned: its output tensor is changed
        out.mul_(2)
        return out


def test_a_capture_is_the_value_at_return_not_after_the_parent_edits_it():
    torch.manual_seed(0)
    model = EditsInPlace()
    x = torch.randn(1, 5, 4)
    points = [
        CapturePoint(name="mlp", module="mlp", hook="output"),
        CapturePoint(name="attn:input", module="attn", hook="input"),
    ]
    capture = JobCapture(points, [4, 4], "all", 5, 1, torch.float32)
    with torch.no_grad(), BatchHooks(model) as hooks:
        hooks.use([capture])
        model(x)
    (_, mlp, start, stop, _), (_, attn_in, _, _, _) = capture.tensors(new_tokens=1)
    with torch.no_grad():
        expected = model.mlp(x)[0]
    assert (start, stop) == (0, 5)
    assert torch.equal(mlp, expected)  # not (mlp + attn) * 2
    assert torch.equal(attn_in, x[0])
    assert not model.mlp._forward_hooks  # the hooks leave with the context


def test_describe_lists_modules_in_entry_order_and_skips_shared_ones():
    class Shared(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = torch.nn.Linear(4, 4)
            self.twice = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.twice(self.twice(self.first(x)))

    model = Shared()
    modules, skipped = describe_modules(model, lambda seq, steps: _generate_like(model, seq, steps))
    assert [m.path for m in modules] == ["first"]  # `twice` runs twice a step: no single value per row
    assert skipped == {"twice": "runs 4 times in 2 forward steps, not once per step"}


def _generate_like(model: torch.nn.Module, seq: int, steps: int) -> None:
    """What generate does to each module: a prefill over `seq` positions, then one per step."""
    with torch.no_grad():
        for step in range(steps):
            model(torch.randn(1, seq if step == 0 else 1, 4))


class TupleAttention(torch.nn.Module):
    """Returns `(out, weights)`, as transformers' eager attention does."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.proj(x), torch.ones(1, 2, x.shape[1], x.shape[1])


class Shapes(torch.nn.Module):
    """Values of every layout a model may give: OPT-like `[S, H]` rows, a pooled `[1, H]`, an
    attention-like `(out, weights)` tuple and a rotary-like `(cos, sin)` pair."""

    def __init__(self) -> None:
        super().__init__()
        self.flat = torch.nn.Linear(4, 6)  # called on [S, 4]
        self.pooled = torch.nn.Linear(4, 4)  # called on the mean over positions: [1, 4]
        self.attn = TupleAttention()
        self.rotary = torch.nn.Identity()  # called on (x, x): two tensors of one shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.pooled(x.mean(dim=1))
        self.rotary((x, x))
        self.attn(x)
        return self.flat(x.view(-1, 4))


def test_describe_lists_flat_rows_and_attention_tuples_not_pooled_values_or_pairs():
    model = Shapes()
    listed, skipped = describe_modules(model, lambda seq, steps: _generate_like(model, seq, steps))
    modules = {m.path: m for m in listed}
    assert modules["flat"].output_dim == 6 and modules["flat"].input_dim == 4 and modules["flat"].all_positions
    assert modules["attn"].output_dim == 4  # the first element of (out, weights)
    assert "pooled" not in modules  # [1, H] at every step is no row per position
    assert "rotary" not in modules  # (cos, sin): no one value
    assert skipped["pooled"] == (
        "output: shape [1, 4] then [1, 4]: not one row per position; input: shape [1, 4] then [1, 4]: "
        "not one row per position"
    )
    assert "not one tensor" in skipped["rotary"]


def test_flat_rows_are_captured_as_rows_of_the_sequence():
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 6)
    points = [CapturePoint(name="flat", module="flat", hook="output")]
    model = torch.nn.Module()
    model.flat = layer
    prefill, step = torch.randn(5, 4), torch.randn(1, 4)
    capture = JobCapture(points, [6], "all", 5, 2, torch.float32)
    with torch.no_grad(), BatchHooks(model) as hooks:
        hooks.use([capture])
        layer(prefill)
        layer(step)
    ((_, rows, start, stop, _),) = capture.tensors(new_tokens=2)
    with torch.no_grad():
        expected = torch.cat([layer(prefill), layer(step)])
    assert (start, stop) == (0, 6) and torch.equal(rows, expected)


def test_a_batch_hands_each_sequence_its_own_rows():
    """[B, S, H] splits on the batch dim; a flattened [B * S, H] (OPT) into B runs of rows; a
    sequence that captures nothing is skipped."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.deep, model.flat = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    points = [
        CapturePoint(name="deep", module="deep", hook="output"),
        CapturePoint(name="flat", module="flat", hook="output"),
    ]
    first, second = (JobCapture(points, [3, 3], "generated", 2, 1, torch.float32) for _ in range(2))
    x = torch.randn(3, 2, 4)  # three sequences of two positions
    with torch.no_grad(), BatchHooks(model) as hooks:
        hooks.use([first, None, second])
        model.deep(x)
        model.flat(x.reshape(6, 4))
    with torch.no_grad():
        deep_expected, flat_expected = model.deep(x), model.flat(x)
    for capture, row in ((first, 0), (second, 2)):
        (_, deep, start, stop, _), (_, flat, _, _, _) = capture.tensors(new_tokens=1)
        assert (start, stop) == (1, 2)
        assert torch.equal(deep, deep_expected[row, 1:]) and torch.equal(flat, flat_expected[row, 1:])
    assert not model.deep._forward_hooks
