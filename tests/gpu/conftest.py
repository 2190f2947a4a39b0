"""The GPU tier: every test under tests/gpu is marked `gpu` and `model`, and is skipped (with the
reason) where CUDA is absent. `make test-fast` leaves them out by the `model` mark."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent
NO_CUDA = "needs CUDA: torch.cuda.is_available() is false"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mine = [item for item in items if Path(str(item.fspath)).is_relative_to(HERE)]
    if not mine:
        return
    import torch  # only when this tier was collected: the fast tiers stay free of it

    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason=NO_CUDA)
    for item in mine:
        item.add_marker(pytest.mark.gpu)
        item.add_marker(pytest.mark.model)
        if skip is not None:
            item.add_marker(skip)
