"""Structured-output request fields (response_format, guided_*, structured_outputs) as
`StructuredOutputsParams`, checked (400 naming the field)."""

from __future__ import annotations

import msgspec

from v1.entrypoints.openai.errors import bad_request
from v1.entrypoints.openai.protocol import SamplingFields
from v1.structured_output import StructuredOutputsParams
from v1.structured_output.params import KINDS as STRUCTURED_KINDS

_CONSTRAINT_FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)
"""Request fields that constrain the output (at most one per request)."""


def _constraint_fields(body: SamplingFields) -> list[str]:
    """The constraint fields the request sets (a text response_format is none)."""
    names = [n for n in _CONSTRAINT_FIELDS if getattr(body, n) is not None]
    fmt = body.response_format
    if fmt is not None and fmt.get("type", "text") == "text":
        names.remove("response_format")
    return names


def _structured_outputs(body: SamplingFields) -> StructuredOutputsParams | None:
    """The request's constraint (response_format, guided_*, structured_outputs) as
    StructuredOutputsParams, None for none / text; 400 naming the field for two constraints, an
    unknown kind or one llguidance cannot compile."""
    names = _constraint_fields(body)
    if not names:
        return None
    if len(names) > 1:
        raise bad_request(
            f"at most one of {', '.join(_CONSTRAINT_FIELDS)} may be given; got {', '.join(names)}",
            param=names[1],
        )
    name = names[0]
    try:
        params = _constraint(body, name)
        params.validate()
    except ValueError as e:
        message = str(e)
        if name.startswith("guided_"):
            message = message.replace(f"structured_outputs.{name[len('guided_') :]}", name)
        raise bad_request(message, param=name) from e
    return params


def _constraint(body: SamplingFields, name: str) -> StructuredOutputsParams:
    if name == "guided_json":
        assert body.guided_json is not None
        return StructuredOutputsParams(json=body.guided_json)
    if name == "guided_regex":
        return StructuredOutputsParams(regex=body.guided_regex)
    if name == "guided_choice":
        return StructuredOutputsParams(choice=body.guided_choice)
    if name == "guided_grammar":
        return StructuredOutputsParams(grammar=body.guided_grammar)
    if name == "structured_outputs":
        spec = body.structured_outputs or {}
        unknown = [k for k in spec if k not in STRUCTURED_KINDS]
        if unknown:
            raise ValueError(
                f"structured_outputs.{unknown[0]} is not supported (supported: "
                f"{', '.join(STRUCTURED_KINDS)})"
            )
        try:
            return msgspec.convert(spec, StructuredOutputsParams)
        except msgspec.ValidationError as e:
            raise ValueError(f"structured_outputs: {e}") from e
    fmt = body.response_format or {}
    kind = fmt.get("type", "text")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(
                "response_format json_schema needs {'json_schema': {'name': ..., "
                "'schema': {...}}} with the schema as a JSON object"
            )
        try:
            return StructuredOutputsParams(json=schema if isinstance(schema, dict) else {})
        except ValueError as e:
            raise ValueError(str(e).replace("structured_outputs.json", "response_format")) from e
    raise ValueError(
        f"response_format type {kind!r} is not one of 'text', 'json_object', 'json_schema'"
    )
