"""The persistent input batch: every running sequence's per-row state in device tensors that keep
their addresses for the life of the engine, addressed by slot.

Per slot, one `state` row of four integers: the token it feeds next, that token's position,
whether a sequence holds the slot (`live`), and its prompt's length (so a row has generated
`position - prompt + 1` tokens). Beside it: the row's tokens so far by position (`history`, what
the penalties count), the token the last step chose (`next`), the last step's logits, its
grammar bitmask row, and its sampling settings (worker/model/sampling.py).

A decoding step reads `state` and writes the next state back in ONE copy at its very end (every
other write of the step, the keys and values at the row's position, the history entry, the logits
and `next`, is the same when the step runs again): a step that fails part-way can run again and
compute exactly what it would have.

A sequence `join`s a free slot (the lowest, so running rows stay packed at the front) and
`leave`s it; what a join or leave changes in `state` is staged on the host and reaches the device
in one packed copy before the next step (`flush`), so a step with joins and leaves costs one
host-to-device copy, and a step without costs none. Nothing here is moved when a sequence leaves:
its slot is only marked free.
"""

from __future__ import annotations

import torch

from worker.model.sampling import RowSampling, SamplingTable

TOKEN, POSITION, LIVE, PROMPT = range(4)  # the columns of `state`


class InputBatch:
    def __init__(
        self, slots: int, slot_tokens: int, vocab: int, eos_ids: set[int], device: torch.device | str, pad_id: int
    ) -> None:
        self.slots, self.vocab, self.pad_id = slots, vocab, pad_id
        self.device = torch.device(device)
        self.state = torch.zeros(slots, 4, dtype=torch.int64, device=self.device)
        self.state[:, TOKEN] = pad_id
        self.history = torch.zeros(slots, slot_tokens, dtype=torch.int64, device=self.device)
        self.next = torch.zeros(slots, dtype=torch.int64, device=self.device)
        self.logits = torch.zeros(slots, vocab, dtype=torch.float32, device=self.device)
        self.sampling = SamplingTable(slots, vocab, eos_ids, self.device)
        words = (vocab + 31) // 32
        pinned = self.device.type == "cuda"
        self.bitmask = torch.full((slots, words), -1, dtype=torch.int32, device=self.device)  # grammar rows
        self._bitmask_host = torch.full((slots, words), -1, dtype=torch.int32, pin_memory=pinned)
        # Two of each pinned block, used in turn: with a step in flight (SlotDecoder's overlap) the
        # copy of one may still be running while the other is written.
        self._staged = torch.zeros(2, slots, 5, dtype=torch.int64, pin_memory=pinned)
        self._flushes = 0
        self._changes: dict[int, tuple[int, int, int, int]] = {}
        self.host_next = torch.zeros(2, slots, dtype=torch.int64, pin_memory=pinned)  # where `next` is read
        self._reads = 0
        self.owners: list[object | None] = [None] * slots  # the host's view: who holds each slot
        self.host_positions = [0] * slots  # each slot's next position (known on the host: no read)

    def resize(self, slot_tokens: int) -> None:
        """Slots of another length: a history as long (a new tensor, each slot's first tokens kept:
        a shorter one is made only when every running row fits it)."""
        if slot_tokens == self.history.shape[1]:
            return
        kept = min(slot_tokens, self.history.shape[1])
        history = self.history.new_zeros(self.slots, slot_tokens)
        history[:, :kept].copy_(self.history[:, :kept])
        self.history = history

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

    def join(self, owner: object, tokens: torch.Tensor, prompt: int, sampling: RowSampling) -> int:
        """Give `owner` the lowest free slot. `tokens` `[P + n]` are its prompt's `prompt` tokens
        and the n >= 1 it generated in its prefill; it feeds the last one next. Returns the slot.
        All or nothing: if it raises, the slot is still free."""
        slot = self.owners.index(None)  # raises ValueError when full: the scheduler never lets it be
        count = int(tokens.shape[0])
        if count > self.history.shape[1]:
            raise ValueError(f"{count} tokens do not fit a slot of {self.history.shape[1]}")
        last = int(tokens[-1])
        # What can fail first (device writes to a slot no one holds); then only host assignments.
        self.sampling.set_row(slot, sampling)
        self.history[slot, :count].copy_(tokens)
        self.owners[slot] = owner
        self.host_positions[slot] = count - 1
        self._changes[slot] = (last, count - 1, 1, prompt)
        return slot

    def leave(self, slot: int) -> None:
        """Free `slot`: from the next step it feeds padding at position 0, which nothing reads."""
        self.owners[slot] = None
        self.sampling.clear(slot)
        self.host_positions[slot] = 0
        self._changes[slot] = (self.pad_id, 0, 0, 0)

    def advanced(self) -> None:
        """A step ran: every running row moved one position on (the device did the same)."""
        for slot, owner in enumerate(self.owners):
            if owner is not None:
                self.host_positions[slot] += 1

    def flush(self) -> None:
        """The staged joins and leaves to the device: one copy of a packed `[n, 5]` block, then
        one in-place index copy (no host synchronisation). (The two staging blocks take turns:
        the read of the tokens of the step after a flush completed that flush's copy, and at most
        one step is in flight beyond it.)"""
        if not self._changes:
            return
        n = len(self._changes)
        self._flushes += 1
        staged = self._staged[self._flushes % 2, :n]
        staged.copy_(torch.tensor([[slot, *row] for slot, row in sorted(self._changes.items())], dtype=torch.int64))
        block = staged.to(self.device, non_blocking=True)
        self.state.index_copy_(0, block[:, 0], block[:, 1:])
        self._changes.clear()

    def set_masks(self, rows: int, masks: dict[int, torch.Tensor]) -> None:
        """The grammar's allowed tokens of the next step: `masks[slot]` is that slot's bitmask row
        (int32, host); every other slot of [0, rows) allows every token. One copy."""
        host = self._bitmask_host[:rows]
        host.fill_(-1)
        for slot, row in masks.items():
            host[slot].copy_(row)
        self.bitmask[:rows].copy_(host, non_blocking=True)

    def copy_next(self, rows: int) -> Reading:
        """Start copying the tokens the step just launched chose for slots [0, rows): one
        non-blocking copy to pinned memory (the two buffers take turns, so the next step's copy
        never overwrites tokens not read yet) and an event after it."""
        self._reads += 1
        host = self.host_next[self._reads % 2, :rows]
        host.copy_(self.next[:rows], non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return Reading(host, event)

    def read_next(self, rows: int) -> list[int]:
        """The tokens the last step chose for slots [0, rows): one non-blocking copy to pinned
        memory and one wait on it (the step's only host synchronisation)."""
        return self.copy_next(rows).tokens()


class Reading:
    """A step's tokens on their way to the host: `tokens` waits for that step's copy only."""

    def __init__(self, host: torch.Tensor, event: torch.cuda.Event | None) -> None:
        self.host, self.event = host, event

    def tokens(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
