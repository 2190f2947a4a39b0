"""The slots' KV cache sized to its rows (the policy: worker/model/slot_sizing.py): made at the first
join, shaped as the prefill's cache; grown when a joining row needs more slots or positions;
shrunk between two steps once the long rows have left and the smaller shape has fit for
ACTQ_KV_CACHE_SHRINK_SECONDS; every running row's keys and values copied over exactly. A join that
would pass ACTQ_KV_CACHE_MAX_BYTES waits (`must_wait`, asked by the scheduler before its prefill)."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from worker.batch.sequence import Sequence
from worker.model.input_batch import InputBatch
from worker.model.memory import release_device_memory
from worker.model.runner import DecodeStep
from worker.model.slot_sizing import Shape, SlotSizing
from worker.model.slots import SlotCache, position_bytes

log = logging.getLogger(__name__)


class SlotResizing:
    """The KV cache's size, for `SlotDecoder` (worker/batch/slot_decoding.py), whose state it reads."""

    model: Any
    eos_ids: set[int]
    pad_id: int
    rows: list[Sequence]
    slots: int
    graphs: bool
    sizing: SlotSizing
    position_bytes: int
    batch: InputBatch | None
    runner: DecodeStep | None
    _launched: object | None  # a step in flight
    _resizable: bool  # rows joined or left since the shrink check last looked
    _smaller: Shape | None  # a smaller shape the running rows fit, and since when
    _smaller_since: float

    def _needs(self, joining: list[Sequence]) -> Shape:
        """(slots, positions) the running rows and `joining` need at once: slots up to the highest
        one in use once they took the lowest free ones, and each row's prompt and max_tokens."""
        owners = self.batch.owners if self.batch is not None else [None] * self.slots
        used = [slot for slot, owner in enumerate(owners) if owner is not None]
        slots = used[-1] + 1 if used else 0
        if joining:
            free = [slot for slot, owner in enumerate(owners) if owner is None]
            slots = max(slots, free[len(joining) - 1] + 1 if len(free) >= len(joining) else len(joining))
        rows = [owner for owner in owners if isinstance(owner, Sequence)] + joining
        return slots, max((row.prompt_tokens + row.max_tokens for row in rows), default=0)

    def _ensure(self, prefilled: Any, joining: list[Sequence]) -> None:
        """The slots' KV cache holds the running rows and `joining`: made at the first join (shaped
        as the prefill's cache), resized when they need more (see worker/model/slot_sizing.py). Raises
        the join's refusal, before anything changed, when they would pass ACTQ_KV_CACHE_MAX_BYTES."""
        need = self._needs(joining)
        beside = len(self.rows)
        if self.runner is None:
            shape = self.sizing.joined(None, need, position_bytes(prefilled), beside)
            assert shape is not None
            cache = SlotCache.like(prefilled, *shape)
            vocab = self.model.get_output_embeddings().weight.shape[0]
            self.batch = InputBatch(self.slots, shape[1], vocab, self.eos_ids, cache.device, self.pad_id)
            self.runner = DecodeStep(self.model, self.batch, cache, graphs=self.graphs)
            log.info("KV cache: %d slots of %d positions (%.1f MB)", cache.slots, cache.slot_tokens, cache.nbytes / 1e6)
            return
        cache = self.runner.cache
        shape = self.sizing.joined((cache.slots, cache.slot_tokens), need, cache.position_bytes, beside)
        if shape is not None:
            self._resize(shape)

    def _resize(self, shape: Shape) -> None:
        """The cache made `shape` (every running row's keys and values copied over exactly), the
        graphs that read the old one dropped; a smaller one's memory given back at once."""
        assert self.runner is not None
        old = self.runner.cache
        if self._launched is not None and old.device.type == "cuda":
            torch.cuda.synchronize(old.device)  # the step in flight replays the graphs about to be dropped
        cache = old.resized(*shape)
        self.runner.rings.hand_over(rewind=True)  # the running rows' recorded steps, before the rings are made anew
        self.runner.use_cache(cache)
        smaller, before = cache.nbytes < old.nbytes, old.nbytes
        del old
        self._smaller, self._resizable = None, True
        log.info(
            "KV cache: %d slots of %d positions (%.1f MB, was %.1f MB)",
            cache.slots,
            cache.slot_tokens,
            cache.nbytes / 1e6,
            before / 1e6,
        )
        if smaller:
            release_device_memory(cache.device)

    def _shrink(self) -> None:
        """Between steps: the cache made smaller once the running rows (none, when idle) have fit a
        smaller shape for ACTQ_KV_CACHE_SHRINK_SECONDS. Touches no tensor until it shrinks; reads
        the clock only while a smaller shape waits out the delay (nothing while the cache fits)."""
        if self.runner is None:
            return
        if self._resizable:
            self._resizable = False
            cache = self.runner.cache
            smaller = self.sizing.smaller((cache.slots, cache.slot_tokens), self._needs([]))
            if smaller is not None and self._smaller is None:
                self._smaller_since = time.monotonic()
            self._smaller = smaller
        if self._smaller is not None and time.monotonic() - self._smaller_since >= self.sizing.limits.shrink_seconds:
            try:
                self._resize(self._smaller)
            except Exception as exc:  # noqa: BLE001 - nothing changed (the new tensors come first): it keeps its size
                log.warning("shrinking the KV cache failed (%s: %s); it keeps its size", type(exc).__name__, exc)
                self._smaller = None

    def must_wait(self, joining: list[Sequence]) -> bool:
        """Whether `joining` (the newest last) must wait for running rows to leave before the KV
        cache can hold them all under ACTQ_KV_CACHE_MAX_BYTES (the scheduler asks before their
        prefill). A trace never joins the slots."""
        joining = [seq for seq in joining if not seq.trace]
        if not joining or not self.sizing.limits.max_bytes:
            return False
        size = self.runner.cache.position_bytes if self.runner is not None else self.position_bytes
        newest = joining[-1].prompt_tokens + joining[-1].max_tokens
        return self.sizing.must_wait(self._needs(joining), newest, size)

    def idle(self) -> None:
        """Nothing runs (the engine core asks while it waits for jobs): the shrink check."""
        if not self.rows:
            self._shrink()

    def cache_size(self) -> tuple[int, int, int]:
        """The KV cache now: (bytes, slots, positions per slot); zeros before the first join."""
        cache = self.runner.cache if self.runner is not None else None
        return (cache.nbytes, cache.slots, cache.slot_tokens) if cache is not None else (0, 0, 0)
