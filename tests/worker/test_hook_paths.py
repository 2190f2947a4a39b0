"""The one capture interface and the one edit interface (worker/hooks/paths.py): the step-table
path (device rings, edit tables) and the hook fallback both serve it, and a batch in slots run
through either gives each row what plain PyTorch forward hooks on plain `generate` give it alone
(tests/support/edit_reference.py): its tokens, and its captured rows with its edits applied."""

from __future__ import annotations

import pytest
import torch

from shared.schemas import CapturePoint
from tests.support import edit_reference as ref
from tests.worker.test_slots import SLOT_TOKENS, Row, load, prefill, rows_of
from worker.hooks.capture import JobCapture
from worker.hooks.capture_hooks import BatchHooks
from worker.hooks.edits import BatchEdits, JobEdits, RowEdit
from worker.hooks.paths import CapturePath, EditPath, PassRows
from worker.hooks.step_capture import StepRings
from worker.hooks.step_edits import StepEdits
from worker.model.input_batch import POSITION, InputBatch
from worker.model.runner import DecodeStep
from worker.model.sampling import RowSampling
from worker.model.slots import SlotCache

pytestmark = pytest.mark.model

MODULES = ["model.layers.0", "model.layers.2", "model.norm"]
NEW = 6  # tokens each row generates: its prompt pass, then 5 decoding steps
EVERYWHERE = [(0, 1000)]


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load(tiny_dir)


def test_the_step_tables_and_the_hooks_serve_one_interface(tiny) -> None:
    model, _ = tiny
    batch = InputBatch(2, SLOT_TOKENS, model.config.vocab_size, set(), "cpu", pad_id=0)
    for capture in (StepRings(model, 2, batch.device), BatchHooks(model)):
        assert isinstance(capture, CapturePath), type(capture)
    for edits in (StepEdits(model, batch.state, POSITION, SLOT_TOKENS), BatchEdits(model)):
        assert isinstance(edits, EditPath), type(edits)


def _jobs(width: int, prompts: list[int]) -> tuple[list[JobEdits | None], list[list]]:
    """Row 0 adds a vector at layer 1 from its third decoding position on; row 1 scales some
    features of layer 2 and takes a direction out of layer 0's attention input; row 2 edits
    nothing. With each row's reference edits (tests/support/edit_reference.py)."""
    generator = torch.Generator().manual_seed(1)
    vector, direction = torch.randn(width, generator=generator), torch.randn(width, generator=generator)
    unit = direction / direction.norm()
    chosen = torch.zeros(width, dtype=torch.bool)
    chosen[:6] = True
    start = prompts[0] + 2
    first = JobEdits([RowEdit(0, "model.layers.1", "output", "add", [(start, 1000)], vector=vector)], prompts[0])
    second = JobEdits(
        [
            RowEdit(0, "model.layers.2", "output", "scale", EVERYWHERE, factor=torch.where(chosen, -2.0, 1.0)),
            RowEdit(1, "model.layers.0.self_attn", "input", "project_out", EVERYWHERE, vector=unit, value=0.5),
        ],
        prompts[1],
    )
    every = set(range(1000))
    reference = [
        [("model.layers.1", "output", ref.add(vector, 1.0, set(range(start, 1000))))],
        [
            ("model.layers.2", "output", ref.scale(-2.0, list(range(6)), every)),
            ("model.layers.0.self_attn", "input", ref.project_out(direction, 0.5, every)),
        ],
        [],
    ]
    return [first, second, None], reference


def _run(model, rows: list[Row], step_path: bool) -> list[tuple[list[int], JobCapture]]:
    """Each row's prompt pass through the hook fallback (a prefill is no slot step), then the rows
    decoded together in slots, the steps through the step tables (`step_path`) or the hooks."""
    width = model.config.hidden_size
    prompts = [int(row.ids.shape[1]) for row in rows]
    edits, _ = _jobs(width, prompts)
    points = [CapturePoint(name=path, module=path, hook="output") for path in MODULES]
    captures = [JobCapture(points, [width] * len(points), "all", p, NEW, torch.float32) for p in prompts]
    first = prefill(model, Row(ids=rows[0].ids[:, :1], new=1))
    cache = SlotCache.like(first, 4, SLOT_TOKENS)
    batch = InputBatch(4, SLOT_TOKENS, model.config.vocab_size, set(), "cpu", pad_id=0)
    step = DecodeStep(model, batch, cache)
    hooks, hook_edits = BatchHooks(model), BatchEdits(model)
    for row, capture, job, prompt in zip(rows, captures, edits, prompts, strict=True):
        at = PassRows([(0, prompt)], prompt)
        hooks.begin([capture], at)
        hook_edits.begin([job], at)
        with hook_edits.record(at), hooks.record(at):
            prefilled = prefill(model, row)
        assert hooks.finish() == {}
        hook_edits.finish()
        row.slot = batch.join(row, torch.cat([row.ids[0], torch.tensor(row.tokens)]), prompt, RowSampling())
        cache.write(row.slot, prefilled, 0, 0, prompt)
    capture_path: CapturePath = step.rings if step_path else hooks
    edit_path: EditPath = step.edits if step_path else hook_edits
    if step_path:
        hooks.close()
        hook_edits.close()
    for _ in range(NEW - 1):
        batch.flush()
        at = PassRows.step(batch.host_positions[: len(rows)])
        capture_path.begin(list(captures), at)
        edit_path.begin(list(edits), at)
        with edit_path.record(at), capture_path.record(at):
            step.decode(0, *step.shape())
        assert capture_path.finish() == {}
        edit_path.finish()
        batch.advanced()
        for row, token in zip(rows, batch.read_next(len(rows)), strict=True):
            row.tokens.append(token)
    capture_path.hand_over()
    for path in (capture_path, edit_path):
        path.close()
    return [(row.tokens, capture) for row, capture in zip(rows, captures, strict=True)]


def test_a_batch_in_slots_through_either_path_gives_each_row_its_forward_hooks_values(tiny) -> None:
    """Three rows (two with edits of four kinds, one plain) decode together in slots: through the
    step tables and through the hooks, each row's tokens and captured rows (every position, the
    edited values) equal plain forward hooks on `generate` for that row alone, and the two paths
    equal each other bit for bit."""
    model, tokenizer = tiny
    results = {}
    with torch.inference_mode():
        for step_path in (True, False):
            results[step_path] = _run(model, rows_of(tokenizer, [NEW] * 5)[:3], step_path)
        prompts = [int(row.ids.shape[1]) for row in rows_of(tokenizer, [NEW] * 5)[:3]]
        _, reference_edits = _jobs(model.config.hidden_size, prompts)
    texts = [row.ids for row in rows_of(tokenizer, [NEW] * 5)[:3]]
    for index, (ids, row_edits) in enumerate(zip(texts, reference_edits, strict=True)):
        prompt = tokenizer.decode(ids[0])
        tokens, values, p = ref.edited_generate(model, tokenizer, prompt, NEW, row_edits, MODULES)
        assert p == prompts[index]
        if row_edits:  # the edits change what is captured: the comparison below can tell
            _, plain, _ = ref.edited_generate(model, tokenizer, prompt, NEW, [], MODULES)
            assert not all(torch.allclose(plain[m], values[m], atol=1e-3) for m in MODULES), index
        for step_path in (True, False):
            got_tokens, capture = results[step_path][index]
            assert got_tokens == tokens[p:].tolist(), (index, step_path)
            kept = {point.module: rows for point, rows, *_ in capture.tensors(NEW)}
            for path in MODULES:
                want = values[path][: p + NEW - 1]  # the last token is never fed
                assert kept[path].shape == want.shape, (index, path)
                assert torch.allclose(kept[path], want, atol=1e-4, rtol=1e-4), (index, step_path, path)
        table, hooked = results[True][index][1], results[False][index][1]
        for (_, a, *_), (_, b, *_) in zip(table.tensors(NEW), hooked.tensors(NEW), strict=True):
            assert torch.equal(a, b), index
