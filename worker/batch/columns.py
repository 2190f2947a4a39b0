"""Growing a batch's `[B, L]` ids, mask and positions by one column without copying the L columns
before it (the compacting batch, worker/batch/decoding.py, and the solo one, worker/batch/solo.py)."""

from __future__ import annotations

import torch

COLUMN_ROOM = 64  # spare columns allocated with the batch's ids, mask and positions


def append_column(view: torch.Tensor, column: torch.Tensor | int) -> torch.Tensor:
    """`view` `[B, L]` with one more column: written into spare room of its storage when it has
    some (a view of a wider allocation: no copy of the L columns, no allocation), else into a
    new allocation with COLUMN_ROOM spare columns. What `view` shows never changes."""
    rows, width = view.shape
    stride = view.stride(0)
    last = view.storage_offset() + (rows - 1) * stride + width  # the element the new column ends at
    room = rows and width and view.stride(1) == 1 and view.storage_offset() % stride + width < stride
    if room and view.untyped_storage().nbytes() > last * view.element_size():
        grown = view.as_strided((rows, width + 1), view.stride())
    else:
        grown = view.new_empty((rows, width + COLUMN_ROOM))[:, : width + 1]
        grown[:, :width] = view
    grown[:, width] = column
    return grown
