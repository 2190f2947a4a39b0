"""The model runner's decoding step over the persistent batch, and its CUDA graphs.

`DecodeStep.decode(rows, span)` is one function that reads only persistent tensors and writes
only persistent tensors: the tokens of slots [0, rows) at their positions through the model
(keys and values into their slots, attention over [0, span)), the logits into the batch's
logits buffer, the sampler's choice into `next`, and each live row's token and position moved
on. It does not read anything back to the host, allocate anything that outlives it, or branch in
Python on a tensor's value: on CUDA it is captured once per (rows, span) bucket as a CUDA graph
and replayed (`replay`); elsewhere, or with graphs off, it runs eagerly. Buckets are powers of two
(rows up to the batch's slots, positions from 64 up to the slot length); rows past the running
ones are free slots that feed padding at position 0, and positions past a row's own are masked:
neither changes what a running row computes.

Prefill, trace passes, chunked prompts and scoring prompts stay eager (worker/batch/decoding.py).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from worker.hooks.step_capture import Key, StepRings
from worker.hooks.step_edits import EditPlan, StepEdits
from worker.model.input_batch import LIVE, POSITION, PROMPT, TOKEN, InputBatch
from worker.model.sampling import EVERYTHING, Features, sample, token_counts
from worker.model.slots import SlotCache

log = logging.getLogger(__name__)
MIN_SPAN = 64  # the smallest positions bucket
# (rows, span, grammar, sampler parts, captured keys, edit ops, "step" | "forward" | "sample")
GraphKey = tuple[int, int, bool, Features, frozenset[Key], EditPlan, str]


def bucket(n: int, most: int, least: int = 1) -> int:
    """The power of two >= n (at least `least`), capped at `most`."""
    size = least
    while size < n:
        size *= 2
    return min(size, most)


class DecodeStep:
    """The decoding step of one persistent batch and its slots, run eagerly (`decode`) or as the
    CUDA graph of its bucket (`replay`)."""

    def __init__(self, model: Any, batch: InputBatch, cache: SlotCache, graphs: bool = False) -> None:
        self.model, self.batch, self.cache = model, batch, cache
        self.dtype = next(model.parameters()).dtype
        self.graphs = graphs and batch.device.type == "cuda"
        self.rings = StepRings(model, cache.slots, batch.device)  # captures recorded inside the step
        self.edits = StepEdits(model, batch.state, POSITION, batch.history.shape[1])  # edits applied inside the step
        self._graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self._pool: Any = None

    def use_cache(self, cache: SlotCache) -> None:
        """A resized cache (new tensors, a history as long too): the graphs, which read the old
        ones, are dropped, and their memory pool with them."""
        self.batch.resize(cache.slot_tokens)
        self.cache = cache
        self.rings.resized(cache.slots)
        self.edits.grown(cache.slot_tokens)
        self._graphs.clear()
        self._pool = None  # a pool whose graphs are all gone cannot take another capture

    def decode(
        self,
        lo: int,
        hi: int,
        span: int,
        constrained: bool = False,
        full: bool = False,
        features: Features = EVERYTHING,
    ) -> None:
        """One decoding step of slots [lo, hi) over positions [0, span) (graph-safe): `forward`
        then `sample`. With `constrained`, each row samples only the tokens its row of the
        batch's bitmask allows; `features`: the sampler's parts the rows need. Values captured at
        the step are written by the rings' hooks, registered around it (`StepRings.recording`;
        hooks are host bookkeeping, kept out of the step so that it compiles whole).
        `full`: every row sees all `span` positions (eager only, known on the host), so no mask
        is passed: the attention `generate` runs for an unpadded batch, bit for bit."""
        self.forward(lo, hi, span, full)
        self.sample(lo, hi, span, constrained, features)

    def forward(self, lo: int, hi: int, span: int, full: bool = False) -> None:
        """The model's pass of slots [lo, hi): each row's token at its position, its key and value
        into its slot, its logits into the batch's logits buffer (graph-safe)."""
        b = self.batch
        part = slice(lo, hi)
        rows = hi - lo
        state = b.state[part]
        tokens, positions = state[:, TOKEN], state[:, POSITION]
        self.cache.prepare(part, span, positions)
        out = self.model(
            input_ids=tokens.reshape(rows, 1),
            position_ids=positions.reshape(rows, 1),
            attention_mask=self.cache.attention_mask(positions, span, self.dtype, full),
            past_key_values=self.cache,
            use_cache=True,
            return_dict=True,
        )
        b.logits[part].copy_(out.logits[:, -1])

    def sample(self, lo: int, hi: int, span: int, constrained: bool = False, features: Features = EVERYTHING) -> None:
        """The sampler over slots [lo, hi)'s logits (graph-safe): each row's token into `next`
        and its history, and the row's state moved on (the step's one write of its state, last)."""
        b = self.batch
        part = slice(lo, hi)
        rows = hi - lo
        state = b.state[part]
        tokens, positions, live, prompt = state[:, TOKEN], state[:, POSITION], state[:, LIVE], state[:, PROMPT]
        logits = b.logits[part]
        generated = positions - prompt + 1  # the fed token is the last one generated
        penalties = None
        if features.penalties:
            penalties = token_counts(b.history[part, :span], torch.zeros_like(prompt), positions, prompt, b.vocab)
        allowed = allowed_tokens(b.bitmask[part], b.vocab) if constrained else None
        chosen = sample(logits, b.sampling, generated, penalties, allowed, part, out=b.next[part], features=features)
        last = b.history.shape[1] - 1
        b.history[part].scatter_(1, (positions + 1).clamp(max=last).reshape(rows, 1), chosen.reshape(rows, 1))
        moved = torch.stack([torch.where(live.bool(), chosen, tokens), positions + live], dim=1)
        state[:, TOKEN : POSITION + 1].copy_(moved)  # the step's one write of its state: last

    def run(self, constrained: bool = False) -> list[int]:
        """Flush the batch's staged joins and leaves, run one step of every running row (its
        graph, or eagerly), and return the chosen token of every slot up to the last running one
        (free slots' entries are meaningless)."""
        b = self.batch
        rows = b.span_rows
        if not rows:
            return []
        b.flush()
        features = b.sampling.features(slice(0, rows))
        if self.graphs:
            self.replay(constrained, features)
        else:
            self.decode(0, *self.shape(), constrained, features=features)
        b.advanced()
        return b.read_next(rows)

    # -- shapes and graphs -----------------------------------------------------------------------

    def shape(self) -> tuple[int, int]:
        """The (rows, span) the next step runs: exact when eager; its bucket with graphs."""
        rows, span = self.batch.span_rows, self.batch.span_positions()
        if not self.graphs:
            return rows, span
        return bucket(rows, self.cache.slots), bucket(span, self.cache.slot_tokens, MIN_SPAN)

    def replay(
        self,
        constrained: bool = False,
        features: Features = EVERYTHING,
        capture: frozenset[Key] = frozenset(),
        edits: EditPlan = frozenset(),
    ) -> None:
        """The step of every running row as the CUDA graph of its bucket, sampler parts, captured
        keys and edit ops (recorded the first time they run); a step that captures moves the
        rings' cursor on inside the graph."""
        rows, span = self.shape()
        self._graph((rows, span, constrained, features, capture, edits, "step")).replay()

    def replay_forward(self, capture: frozenset[Key] = frozenset(), edits: EditPlan = frozenset()) -> tuple[int, int]:
        """The step's model pass alone, as its graph (a step whose sampler waits for the host: a
        grammar's masks filled meanwhile). Returns the bucket `replay_sample` then runs."""
        rows, span = self.shape()
        self._graph((rows, span, False, EVERYTHING, capture, edits, "forward")).replay()
        return rows, span

    def replay_sample(self, rows: int, span: int, constrained: bool, features: Features) -> None:
        """The sampler of the step whose model pass `replay_forward` ran, as its graph."""
        self._graph((rows, span, constrained, features, frozenset(), frozenset(), "sample")).replay()

    def _graph(self, key: GraphKey) -> torch.cuda.CUDAGraph:
        """After warm-up runs on a side stream (as capture requires; the rings are allocated
        there), the step (or its part, `key[-1]`) recorded once; graphs share one memory pool.
        What warm-up and capture moved on is put back."""
        graph = self._graphs.get(key)
        if graph is not None:
            return graph
        rows, span, constrained, features, capture, edits, kind = key
        saved = self._save()

        def body() -> None:
            if kind != "sample":
                self.forward(0, rows, span)
                if capture:
                    self.rings.advance()
            if kind != "forward":
                self.sample(0, rows, span, constrained, features)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with self.edits.recording(edits, 0, rows), self.rings.recording(capture, 0, rows):
            with torch.cuda.stream(stream):
                for _ in range(2):
                    # each warm-up from the same state: it writes the ring row the real step then
                    # writes, never a row recorded and not yet handed over
                    self._restore(saved)
                    body()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                body()
        self._pool = graph.pool()
        self._restore(saved)
        self._graphs[key] = graph
        log.info(
            "captured the decoding %s: %d rows, %d positions, grammar %s, %s, %d captured values, %d edit ops",
            kind,
            rows,
            span,
            constrained,
            features,
            len(capture),
            len(edits),
        )
        return graph

    def _state(self) -> tuple[torch.Tensor, ...]:
        return (self.batch.state, self.batch.next, self.batch.history, self.rings.cursor)

    def _save(self) -> list[torch.Tensor]:
        return [x.clone() for x in self._state()]

    def _restore(self, saved: list[torch.Tensor]) -> None:
        for target, value in zip(self._state(), saved, strict=True):
            target.copy_(value)


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """`[B, vocab]` bool from a bitmask `[B, words]` (int32, bit j of word w: token 32w + j)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
