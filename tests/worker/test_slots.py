"""The persistent batch in slots (worker/model/slots.py, worker/model/input_batch.py, worker/model/runner.py)
against plain `generate`: sequences prefilled eagerly, their keys and values written into free
slots, decoded together with rows joining and leaving at any step and slots reused; every
sequence's greedy tokens equal `generate`'s for it alone, in float32, on each architecture the
slots take. Seeded sampled rows draw the same tokens whatever slot or batch they run in."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from tests.support.architectures import BY_KEY, available, build
from worker.model.input_batch import InputBatch
from worker.model.runner import DecodeStep
from worker.model.sampling import RowSampling
from worker.model.slots import SlotCache, unsupported

pytestmark = pytest.mark.model

PROMPTS = [
    "What is 2+3?",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May.",
    "Name three colours.",
    "Write a haiku about the sea, and then explain it line by line.",
    "Count to five.",
]
SLOT_TOKENS = 96


@dataclass(eq=False)
class Row:
    ids: torch.Tensor  # [1, P]
    new: int
    sampling: RowSampling = field(default_factory=RowSampling)
    tokens: list[int] = field(default_factory=list)
    slot: int = -1


def load(folder):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def prefill(model, row: Row) -> DynamicCache:
    """The prompt alone through the model (what joining does): its cache, its first token."""
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    out = model(input_ids=row.ids, past_key_values=cache, use_cache=True)
    row.tokens.append(int(out.logits[0, -1].argmax()))
    return cache


def run_slots(model, rows: list[Row], join_at: list[int], slots: int = 4) -> DecodeStep:
    """Decode `rows`, row i joining before step join_at[i] (when a slot is free; else later)."""
    first = prefill(model, Row(ids=rows[0].ids[:, :1], new=1))
    cache = SlotCache.like(first, slots, SLOT_TOKENS)
    eos = set()
    batch = InputBatch(slots, SLOT_TOKENS, model.config.vocab_size, eos, "cpu", pad_id=0)
    step = DecodeStep(model, batch, cache)
    waiting = sorted(range(len(rows)), key=lambda i: join_at[i])
    running: dict[int, Row] = {}
    count = 0
    while waiting or running:
        while waiting and join_at[waiting[0]] <= count and batch.free():
            row = rows[waiting.pop(0)]
            prefilled = prefill(model, row)
            prompt = int(row.ids.shape[1])
            row.slot = batch.join(row, torch.cat([row.ids[0], torch.tensor(row.tokens)]), prompt, row.sampling)
            cache.write(row.slot, prefilled, 0, 0, prompt)
            running[row.slot] = row
        if running:
            chosen = step.run()
            for slot, row in list(running.items()):
                row.tokens.append(chosen[slot])
                if len(row.tokens) >= row.new:
                    batch.leave(slot)
                    del running[slot]
        count += 1
    return step


def reference(model, row: Row) -> list[int]:
    out = model.generate(
        input_ids=row.ids,
        attention_mask=torch.ones_like(row.ids),
        max_new_tokens=row.new,
        min_new_tokens=row.new,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, row.ids.shape[1] :].tolist()


def rows_of(tokenizer, lengths: list[int]) -> list[Row]:
    return [Row(ids=tokenizer(p, return_tensors="pt").input_ids, new=n) for p, n in zip(PROMPTS, lengths, strict=True)]


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load(tiny_dir)


def test_rows_joining_and_leaving_decode_as_generate_alone(tiny) -> None:
    """Five sequences through four slots, joining at steps 0, 0, 3, 5 and 9, lengths 6 to 20
    (the fourth reuses the slot of the first to end): each one's tokens are `generate`'s alone."""
    model, tokenizer = tiny
    rows = rows_of(tokenizer, [12, 6, 20, 9, 14])
    with torch.inference_mode():
        run_slots(model, rows, [0, 0, 3, 5, 9])
        for row in rows:
            assert row.tokens == reference(model, row), PROMPTS[rows.index(row)]
    assert {row.slot for row in rows} <= {0, 1, 2, 3}
    assert rows[3].slot == rows[1].slot  # the lowest free slot: the one the first row to end freed


@pytest.mark.parametrize(
    "key", ["llama", "qwen2", "qwen3", "mistral", "phi3", "gpt_neox", "gpt2", "opt", "gemma2", "gemma3", "deepseek_v2"]
)
def test_architectures_in_slots_decode_as_generate(key, tmp_path, smol_dir) -> None:
    arch = BY_KEY[key]
    if (why := available(arch)) is not None:
        pytest.skip(why)
    model, tokenizer = load(build(arch, tmp_path / key, smol_dir))
    assert unsupported(model.config) is None  # sliding windows too (Gemma 2 and 3, Mistral: 8 tokens, crossed)
    rows = rows_of(tokenizer, [8, 5, 11, 6, 7])
    with torch.inference_mode():
        step = run_slots(model, rows, [0, 2, 2, 4, 6])
        for row in rows:
            assert row.tokens == reference(model, row), (key, PROMPTS[rows.index(row)])
    cache = step.cache
    for window, keys in zip(cache.windows, cache.keys, strict=True):  # a sliding layer holds its window
        if keys is not None:
            assert keys.shape[2] == (SLOT_TOKENS if window is None else min(window, SLOT_TOKENS)), key
    if cache.window is not None:  # in a ring, which the longer rows wrap
        assert cache.window < max(int(row.ids.shape[1]) + row.new for row in rows) <= SLOT_TOKENS, key


def test_a_seeded_rows_draws_do_not_depend_on_its_slot_or_batch(tiny) -> None:
    model, tokenizer = tiny
    settings = RowSampling(temperature=1.3, top_p=0.95, top_k=50, seed=1234)

    def sampled(join_at: list[int], order: list[int]) -> list[int]:
        rows = rows_of(tokenizer, [10, 10, 10, 10, 10])
        for row in rows:
            row.sampling = settings if row is rows[0] else RowSampling(temperature=0.9, seed=id(row) % 1000)
        picked = [rows[i] for i in order]
        with torch.inference_mode():
            run_slots(model, picked, join_at)
        return rows[0].tokens

    alone = sampled([0], [0])
    crowded = sampled([3, 0, 0, 0, 1], [0, 1, 2, 3, 4])  # joins last, in slot 3 or later
    assert alone == crowded


def test_a_grown_cache_keeps_every_slots_keys_and_values(tiny) -> None:
    model, tokenizer = tiny
    rows = rows_of(tokenizer, [3, 3, 3, 3, 3])
    with torch.inference_mode():
        prefilled = prefill(model, rows[1])
        cache = SlotCache.like(prefilled, 2, 32)
        length = int(rows[1].ids.shape[1])
        cache.write(1, prefilled, 0, 0, length)
        bigger = cache.resized(8, 64)
    assert (bigger.slots, bigger.slot_tokens) == (8, 64)
    for old, new in zip(cache.tensors(), bigger.tensors(), strict=True):
        assert torch.equal(new[:2, :, :32], old) and not new[2:].any() and not new[:, :, 32:].any()
    assert bigger.tensors()[0][1, :, :length].abs().sum() > 0


def test_a_shrunk_cache_keeps_the_kept_slots_first_positions_exactly(tiny) -> None:
    """Fewer and shorter slots: each kept slot's first positions, bit for bit, and nothing else;
    the bytes are the new shape's."""
    model, tokenizer = tiny
    rows = rows_of(tokenizer, [3, 3, 3, 3, 3])
    with torch.inference_mode():
        cache = SlotCache.like(prefill(model, rows[0]), 8, 64)
        lengths = []
        for slot in (0, 1, 5):
            prefilled = prefill(model, rows[slot % len(rows)])
            lengths.append(int(rows[slot % len(rows)].ids.shape[1]))
            cache.write(slot, prefilled, 0, 0, lengths[-1])
        smaller = cache.resized(2, 32)
    assert (smaller.slots, smaller.slot_tokens) == (2, 32) and max(lengths[:2]) <= 32
    assert smaller.nbytes * 8 == cache.nbytes and smaller.position_bytes == cache.position_bytes
    for old, new in zip(cache.tensors(), smaller.tensors(), strict=True):
        assert new.shape[0] == 2 and new.shape[2] == 32
        assert torch.equal(new, old[:2, :, :32])
        assert new[1, :, : lengths[1]].abs().sum() > 0
