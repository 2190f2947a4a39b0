"""Constrained decoding in the batched decoder (worker/rules/constrained.py, worker/batch/decoding.py): rows
under a grammar and free rows share one batch of the tiny random Llama (SmolLM2's tokenizer).
A random model writes nonsense, so every constrained reply is checked by independent readers
(json.loads + jsonschema, worker/tool_calls.parse_tool_calls); the free rows must be untouched
(the same tokens as in a batch without constrained rows), and log-probabilities stay the
model's own (a teacher-forced forward pass)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import torch

from shared.errors import InternalError
from shared.schemas import JobRequest
from shared.tools import ToolFormat
from worker.batch import decoding
from worker.batch.decoding import Decoder
from worker.batch.sequence import Sequence, TokenScores
from worker.batch.solo import SoloDecoder
from worker.model.sampling import row_sampling
from worker.rules.constrained import Grammars
from worker.rules.tool_calls import parse_tool_calls

pytestmark = pytest.mark.model

MAX_TOKENS = 96
# bounded strings and numbers: a random model under this schema always reaches the end
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "kind", "tags"],
    "additionalProperties": False,
}
CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "maxLength": 16}},
            "required": ["expression"],
            "additionalProperties": False,
        },
    },
}
UNITS = {
    "type": "function",
    "function": {
        "name": "convert",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["cm", "in"]}, "value": {"type": "integer", "maximum": 999}},
            "required": ["unit", "value"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {"calculator": CALC["function"]["parameters"], "convert": UNITS["function"]["parameters"]}
FREE = ["Count to five.", "Name three colours."]


@pytest.fixture(scope="module")
def lm(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def grammars(lm):
    model, tokenizer = lm
    eos = model.generation_config.eos_token_id
    return Grammars(tokenizer, model.config.vocab_size, set(eos if isinstance(eos, list) else [eos]))


def request(content: str, **fields: Any) -> JobRequest:
    return JobRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": content}], **fields})


def json_request(content: str, **fields: Any) -> JobRequest:
    return request(
        content, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}, **fields
    )


def sequence(lm, grammars, req: JobRequest, fmt: ToolFormat | None = None, logprobs: bool = False) -> Sequence:
    model, tokenizer = lm
    messages = [m.model_dump(exclude_none=True) for m in req.messages or []]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    ids = prompt["input_ids"]
    return Sequence(
        prompt_ids=ids,
        max_tokens=MAX_TOKENS,
        sampling=row_sampling(req),
        scores=TokenScores(2) if logprobs else None,
        constraint=grammars.constraint(req, fmt),
    )


def decode(decoder: Decoder, seqs: list[Sequence], join_at: list[int]) -> None:
    with torch.inference_mode():
        step = 0
        while step <= max(join_at) or decoder.rows:
            for seq, at in zip(seqs, join_at, strict=True):
                if at == step:
                    decoder.admit(seq)
            decoder.step()
            step += 1
    assert all(seq.ended is not None for seq in seqs)


def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def reply(lm, seq: Sequence) -> str:
    return lm[1].decode(seq.generated, skip_special_tokens=True)


def assert_person(lm, seq: Sequence) -> None:
    assert seq.ended in ("eos", "stop") and len(seq.generated) < MAX_TOKENS, (seq.ended, reply(lm, seq))
    jsonschema.validate(json.loads(reply(lm, seq)), PERSON)


def assert_calls(lm, seq: Sequence, fmt: ToolFormat, names: set[str]) -> list[str]:
    assert seq.ended in ("eos", "stop") and len(seq.generated) < MAX_TOKENS, (seq.ended, reply(lm, seq))
    parsed = parse_tool_calls(reply(lm, seq), fmt, names)
    assert parsed.calls and not parsed.problems and parsed.content is None, reply(lm, seq)
    for call in parsed.calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return [call.name for call in parsed.calls]


def test_constrained_and_free_rows_share_a_batch(lm, grammars):
    """JSON, a named HERMES call, a required LLAMA3_JSON call, a seeded sampled JSON row and two
    free rows, joining at different steps: every constrained reply parses and validates, and
    the free rows decode exactly as in a batch of free rows alone."""
    model, tokenizer = lm
    tools = {"tools": [CALC, UNITS]}
    named = {"type": "function", "function": {"name": "calculator"}}
    constrained = [
        (json_request("Describe a pet."), None),
        (request("What is 2+3?", **tools, tool_choice=named), ToolFormat.HERMES),
        (request("Convert 3 inches.", **tools, tool_choice="required"), ToolFormat.LLAMA3_JSON),
        (json_request("Another pet.", temperature=1.0, seed=11), None),
        (request("Convert 3 cm.", **tools, tool_choice="required", temperature=1.0, seed=5), ToolFormat.HERMES),
    ]
    seqs = [sequence(lm, grammars, req, fmt, logprobs=i == 0) for i, (req, fmt) in enumerate(constrained)]
    free = [sequence(lm, grammars, request(q)) for q in FREE]
    decoder = Decoder(model, tokenizer, pad_id(tokenizer))
    decode(decoder, [*seqs, *free], join_at=[0, 0, 2, 3, 3, 0, 2])

    assert_person(lm, seqs[0])
    assert assert_calls(lm, seqs[1], ToolFormat.HERMES, {"calculator", "convert"}) == ["calculator"]
    assert_calls(lm, seqs[2], ToolFormat.LLAMA3_JSON, {"calculator", "convert"})
    assert_person(lm, seqs[3])
    assert_calls(lm, seqs[4], ToolFormat.HERMES, {"calculator", "convert"})
    assert all(seq.ended == "length" for seq in free)  # the random model never picks EOS freely

    alone = [sequence(lm, grammars, request(q)) for q in FREE]
    decode(Decoder(model, tokenizer, pad_id(tokenizer)), alone, join_at=[0, 2])
    for got, want in zip(free, alone, strict=True):
        assert got.generated == want.generated

    # log-probabilities are the model's own distribution, not the masked one
    seq = seqs[0]
    assert seq.scores is not None
    ids = torch.cat([seq.prompt_ids, torch.tensor([seq.generated])], dim=1)
    with torch.inference_mode():
        logits = model(ids).logits[0, seq.prompt_tokens - 1 : -1].float()
    want = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(seq.generated).view(-1, 1))[:, 0]
    assert torch.allclose(torch.tensor(seq.scores.values), want, atol=1e-4)


def test_a_sampled_constrained_row_is_its_seed_whatever_its_batch(lm, grammars):
    model, tokenizer = lm
    req = json_request("A pet, please.", temperature=1.0, seed=3)
    alone = sequence(lm, grammars, req)
    decode(Decoder(model, tokenizer, pad_id(tokenizer)), [alone], join_at=[0])
    assert_person(lm, alone)
    batched = sequence(lm, grammars, req)
    others = [sequence(lm, grammars, request(q)) for q in FREE]
    decode(Decoder(model, tokenizer, pad_id(tokenizer)), [*others, batched], join_at=[0, 0, 1])
    assert batched.generated == alone.generated


def test_the_solo_decoder_constrains_too(lm, grammars):
    model, tokenizer = lm
    req = request("What is 2+3?", tools=[CALC], tool_choice="required")
    solo = sequence(lm, grammars, req, ToolFormat.HERMES)
    decode(SoloDecoder(model, tokenizer, pad_id(tokenizer)), [solo], join_at=[0])
    batched = sequence(lm, grammars, req, ToolFormat.HERMES)
    decode(Decoder(model, tokenizer, pad_id(tokenizer)), [batched], join_at=[0])
    assert assert_calls(lm, solo, ToolFormat.HERMES, {"calculator"}) == ["calculator"]
    assert solo.generated == batched.generated


def test_a_failed_prefill_puts_the_matcher_back(lm, grammars, monkeypatch):
    """A constrained sequence's prefill runs out of memory after its first token was taken (while
    joining the running batch): the matcher is rolled back with the rest, and the sequence,
    admitted again, decodes exactly as if the failure never happened."""
    model, tokenizer = lm
    req = json_request("Describe a pet.")
    want = sequence(lm, grammars, req)
    decode(Decoder(model, tokenizer, pad_id(tokenizer)), [want], join_at=[0])

    decoder = Decoder(model, tokenizer, pad_id(tokenizer))
    seq = sequence(lm, grammars, req)
    concat = decoding.kvcache.concat

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    with torch.inference_mode():
        decoder.admit(sequence(lm, grammars, request(FREE[0])))  # a running batch to join
        monkeypatch.setattr(decoding.kvcache, "concat", failing)
        with pytest.raises(torch.OutOfMemoryError):
            decoder.admit(seq)
        monkeypatch.setattr(decoding.kvcache, "concat", concat)
    assert seq.constraint is not None and seq.constraint.consumed == 0 and not seq.generated
    decode(decoder, [seq], join_at=[0])
    assert seq.generated == want.generated
    assert_person(lm, seq)


def test_a_token_the_matcher_refuses_fails_that_row_only(lm, grammars, monkeypatch):
    """If the mask ever allowed a token the matcher then refuses (a bug; injected here: a mask
    that allows everything), that row fails with the matcher's reason and the others go on."""
    model, tokenizer = lm
    decoder = Decoder(model, tokenizer, pad_id(tokenizer))
    bad = sequence(lm, grammars, json_request("Describe a pet."))
    free = sequence(lm, grammars, request(FREE[0]))
    with torch.inference_mode():
        decoder.admit_many([bad, free])
        assert bad.constraint is not None and bad.ended is None
        monkeypatch.setattr(bad.constraint, "fill", lambda bitmask, row: bitmask[row].fill_(-1))
        ended = decoder.step()
    assert ended == [bad] and bad.ended == "failed", reply(lm, bad)
    assert isinstance(bad.failure, InternalError) and "outside the reply's grammar" in str(bad.failure)
    assert decoder.rows == [free] and free.ended is None


def test_a_grammar_that_allows_no_value_fails_the_job_rather_than_answer_nothing(grammars):
    """The API refuses such schemas at submit; one that got past it (an older API, a direct
    engine call) fails its job saying why. Before, its reply was "" with finish_reason "stop"."""
    from shared.errors import JobFailure

    cycle = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
    for schema in ({"$ref": "#"}, cycle):
        req = request("hi", response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})
        with pytest.raises(JobFailure, match="allows no value"):
            grammars.constraint(req, None)
    assert grammars.constraint(json_request("hi"), None) is not None


def test_with_the_step_after_launched_early_grammars_hold_and_each_row_is_its_own(lm, grammars, monkeypatch):
    """The slots' overlap (on with CUDA graphs) forced on the CPU: with grammars in the batch, only
    the model pass of the step after is launched before the last tokens are read, and its sampler
    follows with the masks those tokens lead to. The constrained replies parse and validate, and
    every row's tokens (a seeded sampled JSON row among them) equal its run alone, in turn."""
    from worker.batch.slot_decoding import SlotDecoder
    from worker.model.sampling import RowSampling

    model, tokenizer = lm
    tools = {"tools": [CALC, UNITS]}
    specs = [
        (json_request("Describe a pet."), None, None),
        (request("What is 2+3?", **tools, tool_choice="required"), ToolFormat.HERMES, None),
        (json_request("Another pet.", temperature=1.0, seed=11), None, RowSampling(temperature=1.0, seed=11)),
        (request(FREE[0]), None, None),
        (request(FREE[1]), None, None),
    ]

    def made(i: int) -> Sequence:
        req, fmt, sampling = specs[i]
        seq = sequence(lm, grammars, req, fmt)
        seq.sampling = sampling
        return seq

    def slots(overlap: bool) -> SlotDecoder:
        decoder = SlotDecoder(model, tokenizer, pad_id(tokenizer), 8, 0)
        decoder.overlap = overlap
        return decoder

    stages: list[str | None] = []
    decide = SlotDecoder._ahead

    def recorded(self, current):
        stages.append(decide(self, current))
        return stages[-1]

    monkeypatch.setattr(SlotDecoder, "_ahead", recorded)
    batched = [made(i) for i in range(len(specs))]
    decode(slots(True), batched, join_at=[0, 0, 2, 1, 3])
    # while grammars ran, the model pass went ahead; once only free rows were left, whole steps
    assert stages.count("forward") >= 10 and stages[-2] == "step", stages
    assert_person(lm, batched[0])
    assert_calls(lm, batched[1], ToolFormat.HERMES, {"calculator", "convert"})
    assert_person(lm, batched[2])
    for i, seq in enumerate(batched):
        alone = made(i)
        decode(slots(False), [alone], join_at=[0])
        assert seq.generated == alone.generated, i
