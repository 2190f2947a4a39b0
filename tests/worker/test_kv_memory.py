"""The slots' KV cache follows the work (worker/model/slot_sizing.py): a long job grows it, and once the
long rows have left it shrinks and the process gives the memory back; rows that run across a
shrink or a grow decode exactly as in a cache that never changed size (and as forward hooks on
plain `generate`); ACTQ_KV_CACHE_MAX_BYTES holds a join back or refuses it naming the setting;
and the shrink check costs a decoding step nothing.

A tiny random Llama with a long context (4 layers, 2 KV heads of 16: 1 KiB per slot position), so
one long job's cache is large enough to see in the process's resident size."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shared.capture_spec import resolve
from shared.errors import OutOfMemory
from shared.schemas import JobRequest
from shared.settings import Settings
from tests.support.reference import hooked_generate, select
from tests.support.tiny_model import build
from worker.batch.sequence import Sequence
from worker.engine.core import EngineCore
from worker.engine.scheduler import Entry
from worker.model.slot_sizing import CacheLimits

pytestmark = pytest.mark.model

QUESTIONS = [
    "What is 2+3?",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many?",
    "Name three colours.",
    "Write a haiku about the sea.",
    "Count to five.",
    "Weng earns $12 an hour for babysitting. How much did she earn?",
]
CAPTURE = {"modules": ["model.layers.{0,3}", "model.layers.1.mlp", "model.norm"], "positions": "all"}
LONG = 16_000  # a long job's max_tokens: its slot needs 16,384 positions
POSITION_BYTES = 4 * 2 * 2 * 16 * 4  # layers x (keys, values) x KV heads x head size x float32
FRESH = "TESTS_FRESH_PROCESS"  # set in the process a test runs itself again in (ACTQ_* are cleared)


@pytest.fixture(scope="module")
def served(tmp_path_factory, smol_dir):
    from worker.batch.served import ServedModel
    from worker.model.loading import load

    folder = build(tmp_path_factory.mktemp("models") / "tiny-long", smol_dir, max_position_embeddings=32_768)
    return ServedModel(load(Settings(model=str(folder), model_name="m")))


def request(question: str, capture: dict | None = None) -> JobRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": question}], "capture": capture}
    return JobRequest.model_validate(body)


def prepare(served, req: JobRequest, max_tokens: int, stop_after: int | None = None) -> Sequence:
    """A job's sequence; with `stop_after`, its watch ends it after that many tokens (a long job
    that ends early, as a cancelled or stopped one does)."""
    watch = None if stop_after is None else (lambda n: "cancelled" if n >= stop_after else None)
    points = resolve(req.capture, served.info) if req.capture else []
    return served.prepare(req, points, max_tokens, watch)


def resident() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def shape(decoder) -> tuple[int, int]:
    cache = decoder.runner.cache
    return cache.slots, cache.slot_tokens


def test_after_a_long_job_leaves_the_cache_shrinks_and_the_memory_goes_back(served, monkeypatch):
    """Seven short jobs and one long one: the long one grows every slot to 16,384 positions
    (128 MiB). Once it has left (ACTQ_KV_CACHE_SHRINK_SECONDS=0), the next step's cache is the
    short jobs' own (8 slots of 256) and the process's resident size drops by most of the
    difference; idle, it shrinks to one slot. The resident size is measured in a fresh process (the
    test runs itself again in one): in a process that has run other tests, the heap's history
    decides how much of a block was resident before it was freed."""
    if not os.environ.get(FRESH):
        test = f"{__file__}::test_after_a_long_job_leaves_the_cache_shrinks_and_the_memory_goes_back"
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
            env={**os.environ, FRESH: "1"},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-6000:] + done.stderr[-2000:]
        return
    monkeypatch.setattr(served, "cache_limits", CacheLimits(shrink_seconds=0.0))
    shorts = [prepare(served, request(QUESTIONS[i % len(QUESTIONS)]), 40) for i in range(7)]
    long = prepare(served, request(QUESTIONS[1]), LONG, stop_after=3)
    with torch.inference_mode():
        decoder = served.decoder(8)
        try:
            decoder.admit_many(shorts)
            short_shape, short_bytes = shape(decoder), decoder.runner.cache.nbytes
            decoder.admit(long)
            grown_bytes = decoder.runner.cache.nbytes
            assert shape(decoder) == (8, 16_384) and grown_bytes == 8 * 16_384 * POSITION_BYTES
            gc.collect()
            before = resident()
            while long.ended is None:
                decoder.step()
            assert long.ended == "watch" and len(decoder.rows) == 7
            decoder.step()  # the long row left: this step's cache is what the short rows need
            gc.collect()
            after = resident()
            assert shape(decoder) == short_shape == (8, 256)
            assert decoder.runner.cache.nbytes == short_bytes and decoder.cache_size() == (short_bytes, 8, 256)
            freed = grown_bytes - short_bytes
            assert before - after > 0.75 * freed, (before - after, freed)
            while decoder.rows:
                decoder.step()
            decoder.idle()
            assert decoder.cache_size() == (256 * POSITION_BYTES, 1, 256)
        finally:
            decoder.close()
    assert all(seq.failure is None and seq.ended in ("length", "eos") for seq in shorts)


def run_schedule(served, jobs, join_at: list[int], overlap: bool) -> tuple[list, list[tuple[int, int]]]:
    """Run `jobs` ((question, capture, max_tokens, stop_after)) in one decoder of 8 slots, job i
    joining before step join_at[i] (with `overlap`, each step launched before the last one's
    tokens are read, as with CUDA graphs); returns each job's result and the cache's shape at
    every step."""
    requests = [request(question, capture) for question, capture, _, _ in jobs]
    seqs = [prepare(served, req, n, stop) for req, (_, _, n, stop) in zip(requests, jobs, strict=True)]
    shapes: list[tuple[int, int]] = []
    with torch.inference_mode():
        decoder = served.decoder(8)
        decoder.overlap = overlap
        try:
            step = 0
            while step <= max(join_at) or decoder.rows:
                for i, seq in enumerate(seqs):
                    if join_at[i] == step:
                        decoder.admit(seq)
                decoder.step()
                if decoder.runner is not None:
                    shapes.append(shape(decoder))
                step += 1
        finally:
            decoder.close()
    return [served.finish(seq, req) for seq, req in zip(seqs, requests, strict=True)], shapes


def changes(shapes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The slots' lengths from step to step, where they changed."""
    lengths = [tokens for _, tokens in shapes]
    return [(a, b) for a, b in zip(lengths, lengths[1:], strict=False) if a != b]


@pytest.mark.parametrize("overlap", [False, True], ids=["in-turn", "overlapped"])
def test_rows_running_across_shrinks_and_grows_decode_as_in_a_cache_that_never_resized(served, monkeypatch, overlap):
    """Three capturing jobs run while two long jobs come and go: the cache grows for each long
    one and shrinks after it, the short rows' keys and values copied over each time (also with a
    step in flight as it resizes: the overlap). Their tokens and captures are bit for bit those of
    the same schedule in a cache that never shrinks, and equal forward hooks on plain `generate`
    alone (tokens exactly, values within 1e-4 of scale)."""
    jobs = [
        (QUESTIONS[0], CAPTURE, 30, None),
        (QUESTIONS[2], {**CAPTURE, "positions": "generated"}, 36, None),
        (QUESTIONS[3], CAPTURE, 40, None),
        (QUESTIONS[1], None, LONG, 3),
        (QUESTIONS[5], None, LONG, 4),
    ]
    join_at = [0, 0, 1, 3, 12]
    monkeypatch.setattr(served, "cache_limits", CacheLimits(shrink_seconds=0.0))
    resized, shapes = run_schedule(served, jobs, join_at, overlap)
    monkeypatch.setattr(served, "cache_limits", CacheLimits(shrink_seconds=1e9))
    kept, kept_shapes = run_schedule(served, jobs, join_at, overlap)
    assert changes(shapes) == [(256, 16_384), (16_384, 256), (256, 16_384), (16_384, 256)], shapes
    assert changes(kept_shapes) == [(256, 16_384)], kept_shapes  # the same schedule, never shrunk
    for i, (question, capture, n, _) in enumerate(jobs[:3]):
        got, same = resized[i], kept[i]
        assert torch.equal(got.token_ids, same.token_ids) and got.text == same.text, i
        for a, b in zip(got.captured, same.captured, strict=True):
            assert torch.equal(a.tensor, b.tensor), (i, a.point.name)
        modules = [c.point.module for c in got.captured]
        messages = [{"role": "user", "content": question}]
        ids, rows, prompt_tokens = hooked_generate(served.hf, served.tokenizer, messages, n, modules)
        assert torch.equal(got.token_ids, ids), i
        for captured in got.captured:
            want = select(rows[captured.point.module], capture["positions"], prompt_tokens, n)
            assert captured.tensor.shape == want.shape, (i, captured.point.name)
            scale = float(want.abs().max())
            assert float((captured.tensor.float() - want).abs().max()) <= 1e-4 * scale, (i, captured.point.name)


def test_a_join_past_the_cap_waits_and_a_job_over_it_alone_is_refused_naming_the_setting(served, monkeypatch):
    """ACTQ_KV_CACHE_MAX_BYTES at three slots of 3,100 positions. Four short jobs run in slots
    0-3; a long one (about 3,030 positions) beside them would need five such slots: it waits until
    short ones have left, then joins beside those still running. A job whose own cache passes the
    cap fails at once as out_of_memory naming the setting, and the others never notice. The cache
    never passes the cap."""
    cap = 3 * 3_100 * POSITION_BYTES
    monkeypatch.setattr(served, "cache_limits", CacheLimits(max_bytes=cap, shrink_seconds=0.0))
    events: list[tuple[str, int]] = []
    outcomes: dict[int, object] = {}

    def entry(i: int, seq: Sequence) -> Entry:
        def done(outcome: object) -> None:
            outcomes[i] = outcome
            events.append(("done", i))

        return Entry(seq=seq, done=done, started=lambda: events.append(("started", i)))

    shorts = [prepare(served, request(QUESTIONS[i]), 50 - 10 * i) for i in range(4)]
    huge = prepare(served, request(QUESTIONS[5]), 20_000)
    long = prepare(served, request(QUESTIONS[4]), 3_000, stop_after=5)
    core = EngineCore(served, max_batch=8, on_death=lambda exc: pytest.fail(f"the engine died: {exc!r}"))
    sizes: list[int] = []
    with served.lock, torch.inference_mode():
        decoder = served.decoder(8)
        try:
            for i, seq in enumerate(shorts):
                core.submit(entry(i, seq))
            while len(decoder.rows) < 4 and not outcomes:  # prefill passes, between decoding steps
                core.tick(decoder)
            assert len(decoder.rows) == 4 and decoder.batch.span_rows == 4
            core.submit(entry(4, huge))
            core.submit(entry(5, long))
            for _ in range(400):
                core.tick(decoder)
                sizes.append(decoder.cache_size()[0])
                if len(outcomes) == 6:
                    break
        finally:
            decoder.close()
    assert len(outcomes) == 6, events
    assert all(outcomes[i] is shorts[i] and shorts[i].failure is None for i in range(4))
    refused = outcomes[4]
    assert isinstance(refused, OutOfMemory) and "ACTQ_KV_CACHE_MAX_BYTES" in refused.message, refused
    assert events.index(("done", 4)) < events.index(("done", 3)), events  # refused at once, not after a drain
    assert outcomes[5] is long and long.failure is None and long.ended == "watch"
    joined = events.index(("started", 5))
    ended = [events.index(("done", i)) for i in range(4)]
    assert min(ended) < joined < max(ended), events  # it waited for room, then ran beside the others
    assert 5 * (long.prompt_tokens + 3_000) * POSITION_BYTES > cap  # what joining at once would have needed
    assert 3_000 * POSITION_BYTES <= max(sizes) <= cap, (max(sizes), cap)


class Copies(TorchDispatchMode):
    """Counts `aten::copy_` (what a resize costs: every kept slot's keys and values copied)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_the_shrink_check_costs_a_step_no_copy(served, monkeypatch):
    """Steps of a batch whose cache is larger than its rows need, waiting out
    ACTQ_KV_CACHE_SHRINK_SECONDS, copy exactly what steps of a batch whose cache fits its rows
    copy; the step that shrinks copies every layer's keys and values (what the counter sees)."""

    def copies_per_step(limits: CacheLimits, steps: int, grow: bool) -> list[int]:
        monkeypatch.setattr(served, "cache_limits", limits)
        rows = [prepare(served, request(QUESTIONS[i]), 40) for i in range(3)]
        long = prepare(served, request(QUESTIONS[1]), LONG, stop_after=2)
        counts = []
        with torch.inference_mode():
            decoder = served.decoder(4)
            try:
                decoder.admit_many(rows)
                if grow:
                    decoder.admit(long)
                    while long.ended is None:
                        decoder.step()
                decoder.step()
                for _ in range(steps):
                    with Copies() as mode:
                        decoder.step()
                    counts.append(mode.count)
            finally:
                decoder.close()
        return counts

    fitting = copies_per_step(CacheLimits(shrink_seconds=1e9), 6, grow=False)
    waiting = copies_per_step(CacheLimits(shrink_seconds=1e9), 6, grow=True)
    assert waiting == fitting and len(set(fitting)) == 1, (waiting, fitting)
    tensors = 2 * served.hf.config.num_hidden_layers
    monkeypatch.setattr(served, "cache_limits", CacheLimits(shrink_seconds=0.0))
    with torch.inference_mode():
        decoder = served.decoder(4)
        try:
            decoder.admit_many([prepare(served, request(QUESTIONS[i]), 40) for i in range(3)])
            long = prepare(served, request(QUESTIONS[1]), LONG, stop_after=2)
            decoder.admit(long)
            while long.ended is None:
                decoder.step()
            with Copies() as mode:
                decoder.step()  # this one shrinks
            assert shape(decoder) == (4, 256)
        finally:
            decoder.close()
    assert mode.count >= fitting[0] + tensors, (mode.count, fitting[0], tensors)
