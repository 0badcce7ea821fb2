"""Unknown multipart form fields are a 400, as unknown JSON fields are (OpenAI's rule): the
audio routes' known fields are the form parameters their endpoint declares, itself or through a
dependency such as `decoding_form` (read from the route, so a field added there is known at
once), plus OpenAI fields refused as not supported.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from v1.entrypoints.openai.errors import APIError, unrecognized_message

REFUSED_AUDIO_FIELDS = {
    "keywords": "keywords (transcription guidance words) are not supported",
    "languages": "languages (several candidate languages) is not supported; send one language",
    "known_speaker_names": "known_speaker_names (diarization) is not supported",
    "known_speaker_references": "known_speaker_references (diarization) is not supported",
}
"""OpenAI transcription fields this server knows and refuses (400 naming them)."""


def _base(key: str) -> str:
    """The field name of a form key: `include[]` -> include, `chunking_strategy[type]` ->
    chunking_strategy (how clients send lists and objects in a form)."""
    return key.split("[", 1)[0]


def declared_form_fields(request: Request) -> dict[str, str]:
    """{field name: the form key it is read from} of the endpoint serving `request`."""
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    return {_base(p.alias): p.alias for p in body_params(dependant)}


def body_params(dependant: Any) -> list[Any]:
    """The form parameters of an endpoint and of the dependencies it declares them through."""
    if dependant is None:
        return []
    params = list(getattr(dependant, "body_params", None) or [])
    for sub in getattr(dependant, "dependencies", None) or []:
        params += body_params(sub)
    return params


async def check_form_fields(request: Request) -> None:
    """A FastAPI dependency of the form routes: 400 for a form key the endpoint does not read
    ("Unrecognized request argument supplied: X"), for an OpenAI field it refuses, and for a
    declared field sent in a shape the endpoint would not read (an object: `x[type]`)."""
    declared = declared_form_fields(request)
    form = await request.form()
    keys = list(dict.fromkeys(form.keys()))
    unknown = [
        _base(k) for k in keys if _base(k) not in declared and _base(k) not in REFUSED_AUDIO_FIELDS
    ]
    if unknown:
        unknown = list(dict.fromkeys(unknown))
        raise APIError(400, unrecognized_message(unknown), param=unknown[0])
    for key in keys:
        name = _base(key)
        if name in REFUSED_AUDIO_FIELDS:
            raise APIError(400, REFUSED_AUDIO_FIELDS[name], param=name)
        if key != declared[name]:
            raise APIError(
                400,
                f"{name} was sent as the form field {key!r}; this server reads it as "
                f"{declared[name]!r} (objects are not supported for {name})",
                param=name,
            )
