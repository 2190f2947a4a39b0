"""The model runner's decoding step over the persistent batch, and its CUDA graphs.

`DecodeStep.decode(rows, span)` is one function that reads only persistent tensors and writes
only persistent tensors: the tokens of slots [0, rows) at their positions through the model
(keys and values into their slots, attention over [0, span)), the logits into the batch's
logits buffer, the sampler's choice into `next`, and each live row's token and position moved
on. It does not read anything back to the host, allocate anything that outlives it, or branch in
Python on a tensor's value: on CUDA it is captured once per (rows, span) bucket as a CUDA graph
and replayed (`run`); elsewhere, or with graphs off, it runs eagerly. Buckets are powers of two
(rows up to the batch's slots, positions from 64 up to the slot length); rows past the running
ones are free slots that feed padding at position 0, and positions past a row's own are masked:
neither changes what a running row computes.

Prefill, trace passes, chunked prompts and scoring prompts stay eager (worker/decoding.py).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from worker.input_batch import InputBatch
from worker.sampling import sample
from worker.slots import SlotCache, causal_mask

log = logging.getLogger(__name__)
MIN_SPAN = 64  # the smallest positions bucket


def bucket(n: int, most: int, least: int = 1) -> int:
    """The power of two >= n (at least `least`), capped at `most`."""
    size = least
    while size < n:
        size *= 2
    return min(size, most)


class DecodeStep:
    def __init__(self, model: Any, batch: InputBatch, cache: SlotCache, graphs: bool = False) -> None:
        self.model, self.batch, self.cache = model, batch, cache
        self.dtype = next(model.parameters()).dtype
        self.graphs = graphs and batch.device.type == "cuda"
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool: Any = None

    def decode(self, rows: int, span: int) -> None:
        """One decoding step of slots [0, rows) over positions [0, span) (graph-safe)."""
        b = self.batch
        positions = b.positions[:rows]
        self.cache.prepare(rows, span, positions)
        out = self.model(
            input_ids=b.tokens[:rows].view(rows, 1),
            position_ids=positions.view(rows, 1),
            attention_mask=causal_mask(positions, span, self.dtype),
            past_key_values=self.cache,
            use_cache=True,
            return_dict=True,
        )
        logits = b.logits[:rows]
        logits.copy_(out.logits[:, -1])
        chosen = sample(logits, b.sampling, out=b.next)
        b.sampling.observe(chosen, rows)
        live = b.live[:rows]
        b.tokens[:rows].copy_(torch.where(live.bool(), chosen, b.tokens[:rows]))
        positions.add_(live)

    # -- running it ----------------------------------------------------------------------------

    def shape(self) -> tuple[int, int]:
        """The (rows, span) the next step runs: exact when eager; its bucket with graphs."""
        rows, span = self.batch.span_rows, self.batch.span_positions()
        if not self.graphs:
            return rows, span
        return bucket(rows, self.batch.slots), bucket(span, self.cache.slot_tokens, MIN_SPAN)

    def run(self) -> list[int]:
        """Flush the batch's staged joins and leaves, run one step, and return the chosen token of
        every slot up to the last running one (free slots' entries are meaningless)."""
        b = self.batch
        rows = b.span_rows
        if not rows:
            return []
        b.flush()
        shape = self.shape()
        if self.graphs:
            self._graph(shape).replay()
        else:
            self.decode(*shape)
        b.advanced()
        return b.read_next(rows)

    def _graph(self, shape: tuple[int, int]) -> torch.cuda.CUDAGraph:
        """The graph of one bucket, captured the first time it is needed (after warm-up runs on a
        side stream, as CUDA graph capture requires). Graphs share one memory pool."""
        graph = self._graphs.get(shape)
        if graph is not None:
            return graph
        saved = self._save()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.decode(*shape)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self.decode(*shape)
        self._pool = graph.pool()
        self._restore(saved)  # warm-up and capture ran the step: undo what they moved on
        self._graphs[shape] = graph
        log.info("captured the decoding step for %d rows over %d positions", *shape)
        return graph

    def _save(self) -> list[torch.Tensor]:
        b = self.batch
        t = b.sampling
        return [x.clone() for x in (b.tokens, b.positions, b.next, t.seen, t.counts, t.generated)]

    def _restore(self, saved: list[torch.Tensor]) -> None:
        b = self.batch
        t = b.sampling
        for target, value in zip((b.tokens, b.positions, b.next, t.seen, t.counts, t.generated), saved, strict=True):
            target.copy_(value)
