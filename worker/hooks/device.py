"""Where a model's inputs go, and with them the rows its jobs capture and the tables of their edits."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def home_device(model: torch.nn.Module) -> torch.device:
    """Where the model's inputs go: the device of its first parameter that holds weights (a device
    map that offloads to disk leaves the offloaded parameters on `meta`)."""
    import torch

    for parameter in model.parameters():
        if parameter.device.type != "meta":
            return parameter.device
    return torch.device("cpu")
