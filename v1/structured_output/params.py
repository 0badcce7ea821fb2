"""What a request asks of structured outputs, and its llguidance grammar (no torch here).

llguidance is the grammar engine: it installs from a wheel on CPU and GPU machines alike (no
compiler, no CUDA build) and computes a packed per-request token bitmask from a matcher advanced
token by token, which is exactly the per-step sampler mask this engine applies.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

_COMPACT: Any = {"whitespace_flexible": False}
"""JSON without free whitespace between tokens (a schema's "x-guidance" may turn it back on):
a model cannot spend its token budget on endless indentation."""


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Constrains generation to a JSON document; exactly one field is set.

    `json`: a JSON schema (dict or its JSON text; kept as text so it crosses processes as-is);
    `json_object`: any JSON object (OpenAI's `response_format={"type": "json_object"}`).
    """

    json: str | dict[str, Any] | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            self.json = _dumps(self.json)
        if (self.json is not None) == bool(self.json_object):
            raise ValueError(
                "structured_outputs needs exactly one of json (a JSON schema) and json_object"
            )

    def grammar(self) -> str:
        """The llguidance grammar (its JSON form); raises ValueError for a schema that is not
        a JSON object."""
        from llguidance import LLMatcher

        if self.json_object:
            schema: Any = {"type": "object"}
        else:
            assert isinstance(self.json, str)
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from e
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=_COMPACT)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json is not a usable JSON schema: {e}") from e

    def validate(self) -> str:
        """Compiles the grammar without a tokenizer (cheap); returns it, or raises ValueError
        with llguidance's reason (unknown type, bad $ref, unsupported keyword...)."""
        from llguidance import LLMatcher

        grammar = self.grammar()
        error = LLMatcher.validate_grammar(grammar)
        if error:
            raise ValueError(f"structured_outputs.json is not a usable JSON schema: {error}")
        return grammar


def _dumps(schema: dict[str, Any]) -> str:
    try:
        return json.dumps(schema)
    except (TypeError, ValueError) as e:
        raise ValueError(f"structured_outputs.json is not JSON-serializable: {e}") from e
