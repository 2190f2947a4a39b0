"""The engine on CUDA, on the tiny random Llama (tests/support/tiny_model.py), in float32 and bfloat16:

- each job run alone equals plain forward hooks (cloning) on a plain Hugging Face model bit for bit
  (tests/support/reference.py), as tests/worker/test_engine.py checks on the CPU;
- jobs run batched (joining at different steps) each get their solo result: the same token ids,
  and activations with max |batched - solo| at most a tolerance times the solo tensor's max
  |value|: 1e-4 in float32 (tests/worker/test_batching.py's), 4 * 2^-7 = 0.03125 in bfloat16 (four
  of its rounding steps at that value: a batch runs other kernels, a padded attention and matrix
  products of B rows, whose bfloat16 results round differently from a lone row's). In bfloat16 that
  rounding can also break a near tie the other way (on a CPU, 2 of 16 jobs of 16 greedy tokens):
  a batched job's tokens may leave its solo run's only at a step where the token it took has a
  solo logit within the same tolerance (of the largest |logit|) of the solo run's best; its
  activations are then compared for the positions fed up to that step;
- a model loaded with ACTQ_DEVICE_MAP=auto (accelerate places it) captures the same, bit for bit;
- at batch 8 with captures, a decoding step reads tensor values into Python at most twice, counted
  as bench/bench_step.py counts them (tests/support/host_reads.py): on a GPU each read waits for it;
  the decoding loop never waits for the captured rows: their copies run on a side stream and the
  capture writer thread waits for them (worker/hooks/step_capture.py).

These run the engine eagerly (ACTQ_CUDA_GRAPHS off), whose solo run is bit for bit `generate`'s;
tests/gpu/test_gpu_graphs.py holds graph replay to this eager run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shared.settings import Settings
from tests.support.host_reads import HostReads
from tests.support.reference import hooked_generate, select
from tests.worker.test_batching import CAPTURE, QUESTIONS, RELATIVE_TOLERANCE, job, prepare, run_batched, solo

DEVICE = "cuda"
DTYPES = ["float32", "bfloat16"]
TOLERANCE = {"float32": RELATIVE_TOLERANCE, "bfloat16": 4 * torch.finfo(torch.bfloat16).eps}
# (question, max_tokens, capture): every positions choice, layers, a block's MLP and the final norm
JOBS: list[tuple[str, int, dict[str, Any]]] = [
    (QUESTIONS[0], 10, CAPTURE),
    (QUESTIONS[1], 8, {**CAPTURE, "positions": "generated"}),
    (QUESTIONS[2], 6, {**CAPTURE, "positions": "prompt"}),
    (QUESTIONS[4], 9, {**CAPTURE, "positions": "last"}),
    (QUESTIONS[5], 10, {"modules": ["model.layers.*"], "positions": "generated"}),
]


@dataclass
class Reference:
    """A plain Hugging Face copy of the model and its tokenizer, for forward hooks."""

    model: object
    tokenizer: object


def load_engine(folder, cuda_graphs: bool = True, **settings):
    from worker.batch.served import ServedModel
    from worker.model.loading import load

    return ServedModel(load(Settings(model=str(folder), model_name="m", **settings)), cuda_graphs=cuda_graphs)


def plain_model(folder, dtype: str) -> Reference:
    model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    model.to(DEVICE).eval()
    return Reference(model=model, tokenizer=AutoTokenizer.from_pretrained(folder))


@pytest.fixture(scope="module", params=DTYPES)
def dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def served(tiny_dir, dtype):
    return load_engine(tiny_dir, cuda_graphs=False, device=DEVICE, dtype=dtype)  # eager: tests/gpu/test_gpu_graphs.py


@pytest.fixture(scope="module")
def reference(tiny_dir, dtype) -> Reference:
    return plain_model(tiny_dir, dtype)


def assert_equals_forward_hooks(gen, question: str, max_tokens: int, positions: str, reference: Reference):
    """The same token ids as a plain `generate` with forward hooks, and each capture its rows,
    exactly. Returns the reference's logits, one row `[V]` per new token."""
    messages = [{"role": "user", "content": question}]
    modules = [c.point.module for c in gen.captured]
    hooked = [*modules, "lm_head"]
    ids, rows, prompt_tokens = hooked_generate(reference.model, reference.tokenizer, messages, max_tokens, hooked)
    assert torch.equal(gen.token_ids, ids.cpu()), question
    assert gen.prompt_tokens == prompt_tokens
    for captured in gen.captured:
        expected = select(rows[captured.point.module], positions, prompt_tokens, gen.completion_tokens)
        assert captured.tensor.dtype == torch.float32
        assert torch.equal(captured.tensor, expected.cpu()), (question, captured.point.name)
    return rows["lm_head"].cpu()


def first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """The first index at which two token id sequences differ (None: equal)."""
    shared = min(len(a), len(b))
    differ = (a[:shared] != b[:shared]).nonzero()
    if len(differ):
        return int(differ[0, 0])
    return None if len(a) == len(b) else shared


def assert_close_to_solo(batched, alone, logits: torch.Tensor | None, tolerance: float, name: str) -> None:
    """Equal tokens and text, activations within `tolerance` of the solo tensor's max |value|.
    With the solo run's `logits` (one row per new token), the tokens may part at a near tie (see
    the module's docstring); rows are then compared for the positions fed before it."""
    assert not isinstance(batched, Exception), (name, batched)
    split = first_difference(batched.token_ids, alone.token_ids)
    if split is None:
        assert batched.text == alone.text and batched.finish_reason == alone.finish_reason, name
    else:
        assert logits is not None, (name, "tokens differ", split, batched.token_ids, alone.token_ids)
        row = logits[split - alone.prompt_tokens]
        took = int(batched.token_ids[split])
        gap, scale = float(row.max() - row[took]), float(row.abs().max())
        assert gap <= tolerance * scale, (name, "tokens part at no near tie", split, took, gap, scale)
    for got, want in zip(batched.captured, alone.captured, strict=True):
        assert got.point == want.point and got.start == want.start, name
        if split is None:
            assert (got.stop, got.tensor.shape) == (want.stop, want.tensor.shape), name
            fed = want.tensor.shape[0]
        else:
            fed = max(0, min(split - want.start, got.tensor.shape[0], want.tensor.shape[0]))
        if fed == 0:
            continue
        scale = float(want.tensor[:fed].abs().max())
        diff = float((got.tensor[:fed].float() - want.tensor[:fed].float()).abs().max())
        assert diff <= tolerance * scale, (name, got.point.name, diff, scale)


def test_batched_jobs_get_their_solo_results_and_solo_runs_equal_forward_hooks(served, reference, dtype):
    jobs = [job(question, n, capture) for question, n, capture in JOBS]
    batched, largest = run_batched(served, jobs, join_at=[0, 0, 0, 3, 5])
    assert largest >= 4
    for (question, n, capture), (req, _), got in zip(JOBS, jobs, batched, strict=True):
        alone = solo(served, req, n)
        logits = assert_equals_forward_hooks(alone, question, n, capture["positions"], reference)
        near_ties = logits if dtype == "bfloat16" else None
        assert_close_to_solo(got, alone, near_ties, TOLERANCE[dtype], question[:20])


def test_a_model_placed_by_device_map_auto_captures_exactly(tiny_dir, dtype, tmp_path):
    placed = load_engine(tiny_dir, cuda_graphs=False, device_map="auto", dtype=dtype, model_cache_dir=tmp_path)
    assert placed.loaded.device.startswith(DEVICE)
    where = {str(device) for device in getattr(placed.hf, "hf_device_map", {}).values()}
    assert not where & {"cpu", "disk"}, where  # the tiny model fits on the GPU: nothing offloaded
    reference = plain_model(tiny_dir, dtype)
    for question, n, capture in JOBS[:3]:
        req, _ = job(question, n, capture)
        assert_equals_forward_hooks(solo(placed, req, n), question, n, capture["positions"], reference)


def test_a_decoding_step_at_batch_8_with_captures_reads_the_device_at_most_twice(served, monkeypatch):
    """Prompts of different lengths capturing at generated positions; 64 steps, so the rings are
    handed over four times (every half ring) inside the count: the loop's thread waits for no
    stream (the tokens' one event per step aside; the capture writer thread waits for the copies)."""
    import threading

    waits: list[object] = []
    loop = threading.get_ident()
    original = torch.cuda.Stream.synchronize

    def counted(self):
        if threading.get_ident() == loop:
            waits.append(self)
        return original(self)

    monkeypatch.setattr(torch.cuda.Stream, "synchronize", counted)
    synchronize = torch.cuda.synchronize

    def device_wide(device=None):
        waits.append(device)
        return synchronize(device)

    monkeypatch.setattr(torch.cuda, "synchronize", device_wide)
    steps = 64
    capture = {**CAPTURE, "positions": "generated"}
    seqs = [prepare(served, *job(QUESTIONS[i % len(QUESTIONS)], steps + 4, capture)) for i in range(8)]
    assert len({seq.prompt_tokens for seq in seqs}) > 1
    with torch.inference_mode():
        decoder = served.decoder()
        decoder.eos_ids = set()  # a random model: no row ends inside the count
        try:
            for seq in seqs:
                decoder.admit(seq)
            decoder.step()  # warm
            with HostReads() as reads:
                for _ in range(steps):
                    decoder.step()
            synced = len(waits)
            assert len(decoder.rows) == 8
        finally:
            decoder.close()
    assert steps <= reads.count <= 2 * steps, reads.count / steps  # at least the tokens' one transfer
    assert synced == 0, synced
    for seq in seqs:  # and every window reached its job
        seq.capture.settle()
        assert seq.capture.failure is None
