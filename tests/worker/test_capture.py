"""The capture hooks on plain torch modules: what is stored is what a module returned (or
received) at that moment, whatever its parent does to the tensor afterwards."""

from __future__ import annotations

import torch

from shared.schemas import CapturePoint
from worker.capture import StepCapture, describe_modules


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
    with torch.no_grad(), StepCapture(model, points, [4, 4], "all", 5, 1, torch.float32) as capture:
        model(x)
    (_, mlp, start, stop), (_, attn_in, _, _) = capture.tensors(new_tokens=1)
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
    modules = describe_modules(model, lambda seq: model(torch.randn(1, seq, 4)))
    assert [m.path for m in modules] == ["first"]  # `twice` runs twice a step: no single value per row
