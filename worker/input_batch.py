"""The persistent input batch: every running sequence's per-row state in device tensors that keep
their addresses for the life of the engine, addressed by slot.

Per slot: the token it feeds next, that token's position, whether a sequence holds the slot
(`live`), the token the last step chose (`next`), the last step's logits, and its sampling row
(worker/sampling.py). A sequence `join`s a free slot (the lowest, so running rows stay packed at
the front) and `leave`s it; what a join or leave changes in the per-row tensors is staged on the
host and reaches the device in one packed copy before the next step (`flush`), so a step with
joins and leaves costs one host-to-device copy, and a step without costs none. Nothing here is
moved when a sequence leaves: its slot is only marked free.
"""

from __future__ import annotations

import torch

from worker.sampling import RowSampling, SamplingTable

# Columns of a staged change: slot, token, position, live.
_SLOT, _TOKEN, _POSITION, _LIVE = range(4)


class InputBatch:
    def __init__(self, slots: int, vocab: int, eos_ids: set[int], device: torch.device | str, pad_id: int) -> None:
        self.slots, self.vocab, self.pad_id = slots, vocab, pad_id
        self.device = torch.device(device)
        self.tokens = torch.full((slots,), pad_id, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(slots, dtype=torch.int64, device=self.device)
        self.live = torch.zeros(slots, dtype=torch.int64, device=self.device)
        self.next = torch.zeros(slots, dtype=torch.int64, device=self.device)
        self.logits = torch.zeros(slots, vocab, dtype=torch.float32, device=self.device)
        self.sampling = SamplingTable(slots, vocab, eos_ids, self.device)
        pinned = self.device.type == "cuda"
        self._staged = torch.zeros(slots, 4, dtype=torch.int64, pin_memory=pinned)
        self._changes: dict[int, tuple[int, int, int]] = {}
        self.host_next = torch.zeros(slots, dtype=torch.int64, pin_memory=pinned)  # where `next` is read
        self.owners: list[object | None] = [None] * slots  # the host's view: who holds each slot
        self.host_positions = [0] * slots  # each slot's next position (known on the host: no read)

    # -- slots -------------------------------------------------------------------------------

    def free(self) -> int:
        return sum(owner is None for owner in self.owners)

    @property
    def span_rows(self) -> int:
        """Rows a step runs: up to the last slot in use (0: none)."""
        for slot in range(self.slots - 1, -1, -1):
            if self.owners[slot] is not None:
                return slot + 1
        return 0

    def span_positions(self) -> int:
        """Positions a step attends over: the longest running row's, its new token included."""
        return max((self.host_positions[s] + 1 for s, o in enumerate(self.owners) if o is not None), default=1)

    def join(self, owner: object, token: int, position: int, sampling: RowSampling, prompt: torch.Tensor) -> int:
        """Give `owner` the lowest free slot: it feeds `token` at `position` next (its first
        generated token, right after its prompt's `position` tokens). Returns the slot."""
        slot = self.owners.index(None)  # raises ValueError when full: the scheduler never lets it be
        self.sampling.set_row(slot, sampling, prompt)
        self.owners[slot] = owner
        self.host_positions[slot] = position
        self._changes[slot] = (token, position, 1)
        return slot

    def seen(self, slot: int, tokens: list[int]) -> None:
        """Tokens the slot's sequence generated before it joined (its prefill chose them): counted
        as the step that chose them would have."""
        if tokens:
            index = torch.tensor(tokens, dtype=torch.int64, device=self.device)
            table = self.sampling
            table.seen[slot, index] = True
            table.counts[slot].index_add_(0, index, torch.ones(len(tokens), device=self.device))
            table.generated[slot] = len(tokens)

    def leave(self, slot: int) -> None:
        """Free `slot`: from the next step it feeds padding at position 0, which nothing reads."""
        self.owners[slot] = None
        self.host_positions[slot] = 0
        self._changes[slot] = (self.pad_id, 0, 0)

    def advanced(self) -> None:
        """A step ran: every running row moved one position on (the device did the same)."""
        for slot, owner in enumerate(self.owners):
            if owner is not None:
                self.host_positions[slot] += 1

    def flush(self) -> None:
        """The staged joins and leaves to the device: one copy of a packed `[n, 4]` block, then
        three in-place index copies (no host synchronisation)."""
        if not self._changes:
            return
        n = len(self._changes)
        staged = self._staged[:n]
        for row, (slot, (token, position, live)) in enumerate(sorted(self._changes.items())):
            staged[row, _SLOT], staged[row, _TOKEN], staged[row, _POSITION], staged[row, _LIVE] = (
                slot,
                token,
                position,
                live,
            )
        self._changes.clear()
        block = staged.to(self.device, non_blocking=True)
        slots = block[:, _SLOT]
        self.tokens.index_copy_(0, slots, block[:, _TOKEN])
        self.positions.index_copy_(0, slots, block[:, _POSITION])
        self.live.index_copy_(0, slots, block[:, _LIVE])

    def read_next(self, rows: int) -> list[int]:
        """The tokens the last step chose for slots [0, rows): one non-blocking copy to pinned
        memory and one wait on it (the step's only host synchronisation)."""
        host = self.host_next[:rows]
        host.copy_(self.next[:rows], non_blocking=True)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            event.synchronize()
        return host.tolist()
