"""The decoding step (worker/model/runner.py) is what a CUDA graph can hold, shown on the CPU:
run under a dispatch mode that fails on every host synchronisation, every persistent tensor at
the address it had before the first join, and `torch.compile(fullgraph=True)` with no graph
break."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.worker.test_slots import PROMPTS, SLOT_TOKENS, Row, load, prefill, rows_of
from worker.hooks.step_edits import GATED
from worker.model.input_batch import InputBatch
from worker.model.runner import DecodeStep
from worker.model.sampling import RowSampling
from worker.model.slots import SlotCache

pytestmark = pytest.mark.model

aten = torch.ops.aten
# What reads a device value on the host, or shapes a result by the data (a sync on a GPU).
HOST_READS = {
    aten._local_scalar_dense.default,  # .item(), int(t), bool(t)
    aten.item.default,  # the same under inference mode
    aten.nonzero.default,
    aten.masked_select.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten._unique2.default,
}


class NoHostReads(TorchDispatchMode):
    """Fails on any operator that needs the data on the host, and on indexing with a boolean
    mask (its result's size is the data's). (`.tolist()` of a CPU tensor dispatches nothing; on
    a GPU it is a copy to the host, which the graph capture itself refuses.)"""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if func in HOST_READS:
            raise AssertionError(f"host synchronisation in the decoding step: {func}")
        if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
            indices = args[1]
            if any(i is not None and i.dtype == torch.bool for i in indices):
                raise AssertionError(f"boolean indexing in the decoding step: {func}")
        return func(*args, **(kwargs or {}))


def persistent(step: DecodeStep) -> dict[str, int]:
    b, t = step.batch, step.batch.sampling
    named = {
        "state": b.state,
        "history": b.history,
        "next": b.next,
        "logits": b.logits,
        "bitmask": b.bitmask,
        **{name: getattr(t, name) for name in vars(t) if isinstance(getattr(t, name), torch.Tensor)},
    }
    named.update({f"cache.{i}": tensor for i, tensor in enumerate(step.cache.tensors())})
    return {name: tensor.data_ptr() for name, tensor in named.items()}


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load(tiny_dir)


def started(model, tokenizer, slots: int = 8) -> tuple[DecodeStep, list[Row]]:
    """A batch with three rows running (one greedy, two sampled with filters and penalties)."""
    rows = rows_of(tokenizer, [40, 40, 40, 40, 40])[:3]
    settings = [
        RowSampling(),
        RowSampling(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=3, repetition_penalty=1.2),
        RowSampling(temperature=1.1, seed=4, presence_penalty=0.5, frequency_penalty=0.3, logit_bias={5: 2.0}),
    ]
    first = prefill(model, Row(ids=rows[0].ids[:, :1], new=1))
    cache = SlotCache.like(first, slots, SLOT_TOKENS)
    batch = InputBatch(slots, SLOT_TOKENS, model.config.vocab_size, {2}, "cpu", pad_id=0)
    step = DecodeStep(model, batch, cache)
    for row, s in zip(rows, settings, strict=True):
        row.sampling = s
        cache_of = prefill(model, row)
        prompt = int(row.ids.shape[1])
        row.slot = batch.join(row, torch.cat([row.ids[0], torch.tensor(row.tokens)]), prompt, s)
        cache.write(row.slot, cache_of, 0, 0, prompt)
    return step, rows


def test_the_step_reads_nothing_back_and_keeps_every_address(tiny) -> None:
    model, tokenizer = tiny
    with torch.inference_mode():
        step, rows = started(model, tokenizer)
        addresses = persistent(step)
        step.run()  # the first step after joins: the staged changes go in one copy (outside the mode)
        step.batch.flush()
        for _ in range(3):
            with NoHostReads() as mode:
                step.decode(0, *step.shape())
            step.batch.advanced()
            assert mode.ops > 0
        # a row leaves and another joins a slot; the addresses stay
        step.batch.leave(rows[1].slot)
        late = rows_of(tokenizer, [5, 5, 5, 5, 5])[4]
        cache_of = prefill(model, late)
        tokens = torch.cat([late.ids[0], torch.tensor(late.tokens)])
        slot = step.batch.join(late, tokens, int(late.ids.shape[1]), RowSampling())
        step.cache.write(slot, cache_of, 0, 0, int(late.ids.shape[1]))
        step.batch.flush()
        with NoHostReads():
            step.decode(0, *step.shape())
        assert persistent(step) == addresses
    assert slot == rows[1].slot


def test_the_step_compiles_whole_with_no_graph_break(tiny) -> None:
    """torch.compile with fullgraph=True refuses any graph break (a host read, data-dependent
    Python); the compiled step then chooses the tokens the eager one chooses."""
    model, tokenizer = tiny
    torch._dynamo.reset()
    with torch.inference_mode():
        eager, _ = started(model, tokenizer)
        compiled_step, _ = started(model, tokenizer)
        compiled = torch.compile(compiled_step.decode, fullgraph=True, backend="aot_eager", dynamic=False)
        for _ in range(4):
            for step, run in ((eager, eager.decode), (compiled_step, compiled)):
                step.batch.flush()
                run(0, *step.shape())
                step.batch.advanced()
            assert eager.batch.next[:3].tolist() == compiled_step.batch.next[:3].tolist()
            assert torch.equal(eager.batch.state, compiled_step.batch.state)
    assert len(PROMPTS) >= 3


# Six capture points: blocks' outputs, an MLP, an attention's input, the final norm and lm_head.
CAPTURED = frozenset(
    {
        ("model.layers.0", "output"),
        ("model.layers.3", "output"),
        ("model.layers.1.mlp", "output"),
        ("model.layers.2.self_attn", "input"),
        ("model.norm", "output"),
        ("lm_head", "output"),
    }
)


def values_at_step(model, step: DecodeStep, keys) -> dict:
    """Forward hooks that clone each key's value on a plain call of the model with the step's
    inputs (the reference for what the rings hold)."""
    from worker.hooks.module_rows import first_input, first_tensor

    seen: dict = {}
    handles = []
    for module_path, hook in keys:
        module = model.get_submodule(module_path)
        if hook == "output":
            handles.append(
                module.register_forward_hook(
                    lambda _m, _a, out, k=(module_path, hook): seen.__setitem__(k, first_tensor(out).clone())
                )
            )
        else:
            handles.append(
                module.register_forward_pre_hook(
                    lambda _m, a, kw, k=(module_path, hook): seen.__setitem__(
                        k, first_tensor(first_input(a, kw)).clone()
                    ),
                    with_kwargs=True,
                )
            )
    return {"seen": seen, "handles": handles}


def test_a_step_that_captures_reads_nothing_back_and_records_each_row(tiny) -> None:
    """With six capture points the step still reads nothing on the host; each point's values of
    the step land in its ring at the cursor, which the step moves on; the rings keep their
    addresses across steps."""
    model, tokenizer = tiny
    with torch.inference_mode():
        step, rows = started(model, tokenizer)
        step.batch.flush()
        with step.rings.recording(CAPTURED, 0, step.shape()[0]):
            step.decode(0, *step.shape())  # the rings are made at their first write
        step.rings.advance()
        step.batch.advanced()
        rings = {key: ring.data_ptr() for key, ring in step.rings.rings.items()}
        assert rings.keys() == CAPTURED
        for at in range(1, 4):
            step.batch.flush()
            reference = values_at_step(model, step, CAPTURED)
            with step.rings.recording(CAPTURED, 0, step.shape()[0]), NoHostReads():
                step.decode(0, *step.shape())
                step.rings.advance()
            for handle in reference["handles"]:
                handle.remove()
            step.batch.advanced()
            assert int(step.rings.cursor) == at + 1
            for key, value in reference["seen"].items():
                written = step.rings.rings[key][at, : len(rows)]
                assert torch.equal(written, value.reshape(value.shape[0], -1)[: len(rows)]), key
        assert {key: ring.data_ptr() for key, ring in step.rings.rings.items()} == rings


def test_a_step_that_captures_compiles_whole(tiny) -> None:
    """torch.compile(fullgraph=True) takes the step with its capture hooks and the cursor's move:
    no graph break; the compiled step chooses the eager step's tokens and its rings hold the
    eager values (within float32 rounding: the compiler decomposes some operators)."""
    model, tokenizer = tiny
    torch._dynamo.reset()
    keys = frozenset(sorted(CAPTURED)[:3])
    with torch.inference_mode():
        eager, _ = started(model, tokenizer)
        compiled_step, _ = started(model, tokenizer)
        assert_compiles_as_eager(eager, compiled_step, keys, frozenset(), rows=3)


def assert_compiles_as_eager(eager: DecodeStep, compiled_step: DecodeStep, keys, plan, rows: int) -> None:
    """A first step of both, eager under the dispatch mode (the rings are made there, as a graph's
    warm-up makes them); then three steps, `compiled_step`'s compiled with fullgraph=True (no
    graph break allowed): the same state, cursor and (within float32 rounding: aot_eager's
    decompositions, SiLU..., round a few ulps apart) ring values."""

    def body(step, rows, span):
        step.decode(0, rows, span)
        step.rings.advance()

    compiled = torch.compile(body, fullgraph=True, backend="aot_eager", dynamic=False)
    for at in range(4):
        for step, run in ((eager, body), (compiled_step, body if at == 0 else compiled)):
            step.batch.flush()
            with step.edits.recording(plan, 0, rows), step.rings.recording(keys, 0, rows):
                if at == 0:
                    with NoHostReads():
                        run(step, rows, step.shape()[1])
                else:
                    run(step, rows, step.shape()[1])
            step.batch.advanced()
        assert torch.equal(eager.batch.state, compiled_step.batch.state), at
        assert torch.equal(eager.rings.cursor, compiled_step.rings.cursor), at
        for key in keys:
            torch.testing.assert_close(
                compiled_step.rings.rings[key], eager.rings.rings[key], rtol=1e-4, atol=1e-4, msg=str(key)
            )


def row_edits(width: int, start: int = 45, skip: int = 43):
    """Three rows' edits, every kind the tables hold: an add at every position and a normalized
    add from position `start` at one block; a scale of some features (not at position `skip`)
    and a zero; a project_out at an attention's input; an add gated on a probe's score at the
    first block (row 2 takes none)."""
    from worker.hooks.edits import JobEdits, RowEdit

    generator = torch.Generator().manual_seed(0)

    def vector() -> torch.Tensor:
        return torch.randn(width, generator=generator)

    unit = vector()
    unit = unit / unit.norm()
    chosen = torch.zeros(width, dtype=torch.bool)
    chosen[:8] = True
    first = JobEdits(
        [
            RowEdit(0, "model.layers.1", "output", "add", [(0, 1000)], vector=2 * vector()),
            RowEdit(1, "model.layers.1", "output", "add", [(start, 1000)], vector=0.5 * unit, normalize=True),
        ],
        40,
    )
    second = JobEdits(
        [
            RowEdit(
                0,
                "model.layers.2",
                "output",
                "scale",
                [(0, skip), (skip + 1, 1000)],
                factor=torch.where(chosen, -1.5, 1.0),
            ),
            RowEdit(1, "model.layers.2", "output", "zero", [(0, 1000)], zeroed=~chosen),
            RowEdit(2, "model.layers.0.self_attn", "input", "project_out", [(0, 1000)], vector=unit, value=1.0),
            RowEdit(3, "model.layers.0", "output", "add", [(0, 1000)], vector=vector(), gate=(vector(), 0.1, 0.0, 1.0)),
        ],
        40,
    )
    return [first, second, None]


def test_a_step_that_edits_and_captures_compiles_whole_and_reads_nothing_back(tiny) -> None:
    """The edit tables' hooks and the rings' hooks in one step: no host read under the dispatch
    mode; torch.compile(fullgraph=True) takes it whole; the compiled step chooses the eager
    step's tokens and its rings hold the eager values (within float32 rounding)."""
    model, tokenizer = tiny
    torch._dynamo.reset()
    keys = frozenset({("model.layers.1", "output"), ("model.layers.2", "output"), ("model.norm", "output")})
    with torch.inference_mode():
        eager, _ = started(model, tokenizer)
        compiled_step, _ = started(model, tokenizer)
        edits = row_edits(model.config.hidden_size)
        for step in (eager, compiled_step):
            step.edits.sync(edits)
        plan = eager.edits.plan(3)
        assert {kind for _, _, kind in plan} == {1, 2, 3, 4, 5, 1 + GATED}
        assert_compiles_as_eager(eager, compiled_step, keys, plan, rows=8)


def test_the_edit_tables_give_each_row_what_the_edit_hooks_give(tiny) -> None:
    """The same step with the tables (worker/hooks/step_edits.py) and with worker/hooks/edits.py's hooks (the
    eager path of gated edits and patches): every captured value and every token identical, the
    positions each edit selects (a normalized add that starts, a scale that skips a position, both
    inside the steps run) included."""
    from worker.hooks.edits import BatchEdits

    model, tokenizer = tiny
    keys = frozenset({("model.layers.1", "output"), ("model.layers.2", "output"), ("model.norm", "output")})
    with torch.inference_mode():
        tables, _ = started(model, tokenizer)
        hooks, _ = started(model, tokenizer)
        first, second = tables.batch.host_positions[:2]
        edits = row_edits(model.config.hidden_size, start=first + 3, skip=second + 2)
        tables.edits.sync(edits)
        plan = tables.edits.plan(3)
        assert (("model.layers.0", "output"), 0, 1 + GATED) in plan
        batch_edits = BatchEdits(model)
        for at in range(8):
            tables.batch.flush()
            with tables.edits.recording(plan, 0, 3), tables.rings.recording(keys, 0, 3):
                tables.decode(0, 3, tables.shape()[1])
            hooks.batch.flush()
            positions = hooks.batch.host_positions[:3]
            batch_edits.use(edits, [(p, 1) for p in positions], 1)
            with hooks.rings.recording(keys, 0, 3):
                hooks.decode(0, 3, hooks.shape()[1])
            batch_edits.flush()
            batch_edits.use([], [], 1)  # its hooks off the model before the tables' step
            for step in (tables, hooks):
                step.rings.advance()
                step.batch.advanced()
            for key in keys:
                a, b = tables.rings.rings[key][at, :3], hooks.rings.rings[key][at, :3]
                assert torch.equal(a, b), (at, key, (a - b).abs().amax(-1).tolist())
            assert torch.equal(tables.batch.state, hooks.batch.state), at
    # where the gate fired: the tables' flags at the positions row 1 fed, the hooks' masks per step
    gated = edits[1].by_key[("model.layers.0", "output")][0]
    eager_fired = [int(where[row].sum()) for _, where, row in gated.fired]
    flags = tables.edits.tables[("model.layers.0", "output")][0].fired[1, second : second + 8]
    assert flags.tolist() == [bool(n) for n in eager_fired] and 0 < sum(eager_fired) < 8, eager_fired


@pytest.mark.parametrize("overlap", [False, True], ids=["in-turn", "overlapped"])
def test_a_running_batch_that_captures_and_edits_reads_one_value_per_step(tiny_dir, overlap) -> None:
    """The decoder's whole step (joins staged, the step, the tokens back, stop checks) at batch 8
    with 6 capture points and 3 edits per job, for 64 steps (the rings handed over every 16): one
    read of device values per step, the tokens', however many points and edits ride in it; also
    with each step launched before the last one's tokens are read (the overlap of graphs)."""
    from shared.capture_spec import resolve
    from shared.intervention_check import resolve as resolve_edits
    from shared.schemas import JobRequest
    from shared.settings import Settings
    from tests.support.host_reads import HostReads
    from worker.batch.served import ServedModel
    from worker.model.loading import load as load_model

    served = ServedModel(load_model(Settings(model=str(tiny_dir), model_name="m")))
    width = served.info.hidden_size
    capture = {"modules": ["model.layers.*", "model.layers.1.mlp", "model.norm"], "positions": "generated"}
    edits = [{"module": f"model.layers.{i}", "op": "add", "vector": [0.01] * width} for i in (0, 1, 3)]
    steps = 64
    seqs = []
    for i in range(8):
        body = {"model": "m", "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]}
        req = JobRequest.model_validate({**body, "capture": capture, "interventions": edits})
        points = resolve(req.capture, served.info)
        assert len(points) == 6
        seqs.append(
            served.prepare(
                req, points, steps + 4, None, resolve_edits(req.interventions, served.info, False, steps + 4)
            )
        )
    with torch.inference_mode():
        decoder = served.decoder(8)
        decoder.eos_ids = set()  # a random model: no row ends inside the count
        decoder.overlap = overlap
        try:
            for seq in seqs:
                decoder.admit(seq)
            decoder.step()
            assert (decoder._launched is not None) == overlap
            with HostReads() as reads:
                for _ in range(steps):
                    assert decoder.step() == []
            assert len(decoder.rows) == 8 and decoder.runner.rings.rings
            assert decoder.runner.edits.plan(8)
        finally:
            decoder.close()
    assert reads.count <= steps, reads.count / steps


def test_a_leaving_row_s_gate_counts_stay_when_the_next_job_takes_its_slot() -> None:
    """A row's gate flags are read into its report as it leaves (`collect`); the next gated job in
    that slot clears the slot's flags (`sync`). The report must keep what it read: on the CPU,
    `.cpu()` is the table itself, and a view of it read zeros once the slot was reused."""
    from worker.hooks.edits import JobEdits, RowEdit
    from worker.hooks.step_edits import StepEdits

    model = torch.nn.Sequential(torch.nn.Identity())
    fed = torch.zeros((2, 1), dtype=torch.long)
    tables = StepEdits(model, fed, 0, 16)
    ones = torch.ones(4)

    def gated() -> JobEdits:
        return JobEdits([RowEdit(0, "0", "output", "add", [(0, 1000)], vector=ones, gate=(ones, 0.0, 0.0, 1.0))], 3)

    first = gated()
    tables.sync([first, None])
    for position in (3, 4, 5):  # decoding steps 1, 2, 3: the score 4 passes the gate at each
        fed[0, 0] = position
        with tables.recording(tables.plan(2), 0, 2):
            model(torch.ones(2, 1, 4))
    tables.collect(0, first, 3, 4)
    assert first.reports(["add"], 4)[0].applied == [0, 1, 1, 1]
    tables.sync([gated(), None])  # the next job in slot 0
    assert first.reports(["add"], 4)[0].applied == [0, 1, 1, 1]
