"""What a request asks of structured outputs, and its llguidance grammar (no torch here).

llguidance is the grammar engine: it installs from a wheel on CPU and GPU machines alike (no
compiler, no CUDA build) and computes a packed per-request token bitmask from a matcher advanced
token by token, which is exactly the per-step sampler mask this engine applies. Every kind of
constraint (JSON schema, any JSON object, a regular expression, a choice of strings, a Lark or
GBNF/EBNF grammar) compiles to one llguidance grammar.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

_COMPACT: Any = {"whitespace_flexible": False}
"""JSON without free whitespace between tokens (a schema's "x-guidance" may turn it back on):
a model cannot spend its token budget on endless indentation."""

KINDS = ("json", "json_object", "regex", "choice", "grammar")
"""The constraint fields of StructuredOutputsParams (exactly one is set)."""


_KIND_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON schema",
    "regex": "regular expression",
    "choice": "choice list",
    "grammar": "grammar (Lark or GBNF)",
}
"""What each kind of constraint is, for error messages."""


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Constrains generation; exactly one field is set (vLLM's names).

    `json`: a JSON schema (dict or its JSON text; kept as text so it crosses processes as-is);
    `json_object`: any JSON object (OpenAI's `response_format={"type": "json_object"}`);
    `regex`: the output fully matches this regular expression (Rust `regex` syntax);
    `choice`: the output is exactly one of these strings;
    `grammar`: a context-free grammar, in llguidance's Lark syntax (`start: ...`) or GBNF/EBNF
    (`root ::= ...`, as llama.cpp and vLLM's xgrammar take it).
    """

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            self.json = _dumps(self.json)
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        set_fields = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_fields) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json (a JSON schema), json_object, "
                f"regex, choice and grammar; got {set_fields or 'none'}"
            )
        if self.json_object is not False and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be a boolean")
        if self.json is not None and not isinstance(self.json, str):
            raise ValueError("structured_outputs.json must be a JSON schema (object or its text)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a list of non-empty strings")

    @property
    def kind(self) -> str:
        """The name of the field that is set."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def grammar_spec(self) -> str:
        """The llguidance grammar (its serialized form); raises ValueError naming the field
        for a constraint llguidance cannot read."""
        from llguidance import LLMatcher, grammar_from

        kind = self.kind
        try:
            if kind == "json_object":
                return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_COMPACT)
            if kind == "json":
                assert isinstance(self.json, str)
                try:
                    schema = json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise ValueError(f"not valid JSON: {e}") from e
                if not isinstance(schema, (dict, bool)):
                    raise ValueError("must be a JSON schema (an object)")
                return LLMatcher.grammar_from_json_schema(schema, defaults=_COMPACT)
            if kind == "regex":
                assert self.regex is not None
                return LLMatcher.grammar_from_regex(self.regex)
            if kind == "choice":
                return grammar_from("choice", self.choice)  # type: ignore[arg-type]
            assert self.grammar is not None
            return grammar_from("grammar", self.grammar)
        except ValueError as e:
            raise ValueError(
                f"structured_outputs.{kind} is not a usable {_KIND_NAMES.get(kind, kind)}: {e}"
            ) from e

    def validate(self) -> str:
        """Compiles the grammar without a tokenizer (cheap); returns it, or raises ValueError
        with llguidance's reason (unknown type, bad $ref, bad regex, unknown rule...)."""
        from llguidance import LLMatcher

        grammar = self.grammar_spec()
        error = LLMatcher.validate_grammar(grammar)
        if error:
            name = _KIND_NAMES.get(self.kind, self.kind)
            raise ValueError(f"structured_outputs.{self.kind} is not a usable {name}: {error}")
        return grammar


def _dumps(schema: dict[str, Any]) -> str:
    try:
        return json.dumps(schema)
    except (TypeError, ValueError) as e:
        raise ValueError(f"structured_outputs.json is not JSON-serializable: {e}") from e
