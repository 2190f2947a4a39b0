"""What constraining promises, over a corpus: a constrained reply is JSON that validates against
its schema, or it ends with finish_reason "length" (cut by max_tokens); a schema for which that
cannot hold is refused at submit. The corpus: the hostile schemas of issue 33, real public schemas
(SchemaStore's, as check-jsonschema vendors them) and schemas Hypothesis generates (references,
cycles, unsatisfiable parts). Each accepted schema is decoded by the tiny random-weight Llama,
sampling, so the grammar alone decides what it writes; the reply is read back by json.loads and
validated by jsonschema, independently of llguidance."""

from __future__ import annotations

import json
from importlib.resources import files
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings

from shared.grammars import grammar_problem
from shared.schema_checks import check_schema
from shared.schemas import JobRequest
from tests.support.hostile import nested
from tests.support.schema_strategies import schemas
from tests.worker.test_constrained import MAX_TOKENS, decode, grammars, lm, pad_id, reply, request, sequence
from worker.batch.decoding import Decoder

pytestmark = pytest.mark.model
__all__ = ["grammars", "lm"]  # the fixtures, shared with test_constrained

HOSTILE: dict[str, tuple[dict[str, Any], bool]] = {  # name: (schema, accepted at submit)
    "a $ref to itself": ({"$ref": "#"}, False),
    "a -> b -> a": ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}, False),
    "an object that requires itself": (
        {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
        False,
    ),
    "an array that requires itself": ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, False),
    "endless either way": (  # a choice at each level, but no value ends: refused (shared/endless_schemas.py)
        {
            "anyOf": [
                {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
                {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
            ]
        },
        False,
    ),
    "an endless item reachable through an optional array": (  # the gap a Hypothesis draw found
        {
            "$defs": {"d": {"type": "object", "properties": {"a": {"$ref": "#/$defs/d"}}, "required": ["a"]}},
            "anyOf": [{"type": "array", "items": {"$ref": "#/$defs/d"}, "maxItems": 1}],
        },
        False,
    ),
    "a list that may end": ({"type": "object", "properties": {"v": {"type": "boolean"}, "n": {"$ref": "#"}}}, True),
    "70 levels of properties": (nested("properties", 70), False),
    "300 levels of anyOf": (nested("anyOf", 300), False),
    "a string that is an integer": ({"allOf": [{"type": "string"}, {"type": "integer"}]}, False),
    "minimum over maximum": ({"type": "integer", "minimum": 5, "maximum": 3}, False),
    "not": ({"not": {"type": "string"}}, False),
}
VENDOR = files("check_jsonschema") / "builtin_schemas" / "vendor"
REAL = {
    f.name: json.loads(f.read_text())
    for f in sorted(VENDOR.iterdir(), key=lambda f: f.name)
    if f.name.endswith(".json")
}


def submit_problem(req: JobRequest) -> str | None:
    """What the API says at submit (api/submit.check_schemas, without the budget)."""
    for where, schema in req.schemas():
        try:
            check_schema(schema, where)
        except ValueError as exc:
            return str(exc)
    return grammar_problem(req, None)


def holds(lm, grammars, schema: dict[str, Any], seed: int) -> bool:
    """Decode under `schema` (sampled, `seed`); assert the promise. False when refused at submit."""
    req = request(
        "Reply in JSON.",
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
        temperature=1.0,
        seed=seed,
    )
    if submit_problem(req) is not None:
        return False
    seq = sequence(lm, grammars, req)
    decode(Decoder(lm[0], lm[1], pad_id(lm[1])), [seq], join_at=[0])
    if seq.ended == "length":
        assert len(seq.generated) == MAX_TOKENS
    else:
        assert seq.ended in ("eos", "stop"), seq.ended
        jsonschema.validate(json.loads(reply(lm, seq)), schema)
    return True


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_schemas_are_refused_or_kept(lm, grammars, name):
    schema, accepted = HOSTILE[name]
    assert all(holds(lm, grammars, schema, seed) == accepted for seed in range(3))


def test_real_public_schemas_are_refused_or_kept(lm, grammars):
    kept = [name for name, schema in REAL.items() if all([holds(lm, grammars, schema, seed) for seed in range(2)])]
    assert len(REAL) >= 25 and len(kept) >= 5, kept  # the rest use keywords llguidance cannot enforce, or are too big


# Derandomized: the same 40 schemas every run, so CI judges the code, not the draw. A random draw
# found a gap (a required self-reference reachable only through an optional branch, e.g. the items
# of an array with minItems 0: accepted at submit, the job failed mid-reply when the model took
# that branch); shared/endless_schemas.py refuses such schemas now ("an endless item reachable
# through an optional array" above).
@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(schemas(max_leaves=8))
def test_generated_schemas_are_refused_or_kept(lm, grammars, schema):
    holds(lm, grammars, schema, seed=7)
