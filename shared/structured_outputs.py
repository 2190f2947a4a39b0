"""vLLM's `structured_outputs` in a job request: the reply follows exactly one constraint, enforced
by constrained decoding with llguidance (shared/grammars.py builds its grammar, the API checks it
compiles at submit, worker/rules/constrained.py masks the logits by it).

- `json`: a JSON Schema (an object, or the same written as a JSON string, as vLLM takes both): the
  reply is JSON valid under it, as with `response_format` json_schema (objects that list
  `properties` closed to other keys: shared/closed_schemas.py);
- `json_object: true`: any JSON object;
- `regex`: the whole reply matches the regular expression (llguidance's syntax, Rust's `regex`
  crate: no look-around, no backreferences);
- `choice`: the reply is exactly one of the strings;
- `grammar`: a Lark grammar, in llguidance's syntax (what vLLM's `guidance` backend takes; its
  `start` rule is the reply). GBNF (`root ::= ...`, xgrammar's) is not read.

vLLM's other keys (`structural_tag`, `whitespace_pattern`, `disable_any_whitespace`, ...) are
refused, naming the key. vLLM's deprecated `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar` are the same constraints under their old names: the OpenAI routes take them
(api/openai_requests.py) and send them here."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    field_validator,
    model_serializer,
    model_validator,
)

from shared.schema_checks import MAX_SCHEMA_CHARS

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[Kind, ...] = ("json", "json_object", "regex", "choice", "grammar")
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 10_000
MAX_GRAMMAR_CHARS = MAX_SCHEMA_CHARS  # a regex or a grammar, as a schema is bounded


class StructuredOutputs(BaseModel):
    """Exactly one of `json`, `json_object`, `regex`, `choice`, `grammar` (see the module)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)
    json_: dict[str, Any] | None = Field(default=None, alias="json")  # checked at submit: shared/schema_checks.py
    json_object: StrictBool | None = None
    regex: Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | None = None
    choice: (
        Annotated[
            list[Annotated[str, Field(min_length=1, max_length=MAX_CHOICE_CHARS)]],
            Field(min_length=1, max_length=MAX_CHOICES),
        ]
        | None
    ) = None
    grammar: Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        unknown = [key for key in data if key not in KINDS]
        if unknown:
            raise ValueError(
                f"structured_outputs.{unknown[0]} is not supported: actq constrains a reply by one of "
                f"{', '.join(KINDS)}; leave {unknown[0]} out"
            )
        return data

    @field_validator("json_", mode="before")
    @classmethod
    def _schema_text(cls, value: Any) -> Any:
        """vLLM takes the schema as an object or as JSON text: the text is parsed (JSON only)."""
        if not isinstance(value, str):
            return value
        if len(value) > MAX_SCHEMA_CHARS:
            raise ValueError(f"the schema is {len(value):,} characters; one schema has at most {MAX_SCHEMA_CHARS:,}")
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"a schema given as a string must be JSON: {str(exc)[:200]}") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"a schema is a JSON object, not {type(parsed).__name__}")
        return parsed

    @model_validator(mode="after")
    def _one_kind(self) -> StructuredOutputs:
        given = self.kinds
        if len(given) != 1:
            what = f"gives {' and '.join(given)}" if given else "gives none"
            raise ValueError(
                f"structured_outputs takes exactly one kind of constraint (json, json_object, regex, choice or "
                f"grammar); this {what}"
            )
        return self

    @model_serializer(mode="wrap")
    def _given_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Stored and shown as sent: the one constraint given, `{"regex": ...}`."""
        return {key: value for key, value in handler(self).items() if value is not None}

    @property
    def kinds(self) -> list[Kind]:
        """The constraints given (json_object only when true)."""
        values = {
            "json": self.json_,
            "json_object": self.json_object or None,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
        }
        return [k for k in KINDS if values[k] is not None]

    @property
    def kind(self) -> Kind:
        return self.kinds[0]

    def json_schema(self) -> dict[str, Any] | None:
        """The schema the reply must satisfy, for `json` and `json_object` (None for the others)."""
        from shared.closed_schemas import closed

        if self.json_object:
            return {"type": "object"}
        return closed(self.json_) if self.json_ is not None else None
