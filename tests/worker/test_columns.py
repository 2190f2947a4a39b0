"""The running batch's ids, mask and positions grow by one column per decoding step without
copying what they hold (worker/batch/columns.py `append_column`)."""

from __future__ import annotations

import torch

from worker.batch.columns import COLUMN_ROOM, append_column


def test_a_column_goes_into_spare_room_and_what_a_view_showed_never_changes() -> None:
    ids = torch.arange(6).view(2, 3)
    grown = append_column(ids, torch.tensor([7, 8]))  # no room: a new allocation with room
    assert grown.tolist() == [[0, 1, 2, 7], [3, 4, 5, 8]] and grown.stride(0) == 3 + COLUMN_ROOM
    again = append_column(grown, 9)
    assert again.data_ptr() == grown.data_ptr()  # in place: no allocation, no copy
    assert again.tolist() == [[0, 1, 2, 7, 9], [3, 4, 5, 8, 9]]
    assert grown.tolist() == [[0, 1, 2, 7], [3, 4, 5, 8]]  # the older view still shows what it did
    cropped = again[:, 2:]  # padding every row has, trimmed: still a view with room after it
    assert append_column(cropped, 1).data_ptr() == cropped.data_ptr()
    picked = again[[1]]  # rows picked out: a copy, so a new allocation
    assert append_column(picked, 0).tolist() == [[3, 4, 5, 8, 9, 0]]


def test_the_room_runs_out_and_a_new_allocation_takes_over() -> None:
    view = torch.zeros(1, 0, dtype=torch.long)
    for step in range(3 * COLUMN_ROOM):
        view = append_column(view, step)
    assert view.tolist() == [list(range(3 * COLUMN_ROOM))]
    empty = append_column(torch.zeros(0, 5, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    assert empty.shape == (0, 6)
