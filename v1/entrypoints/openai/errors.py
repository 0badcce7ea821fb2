"""Errors of the OpenAI-compatible server: one body shape, `{"error": {message, type, param,
code}}`, for every failure, and the exception handlers that produce it (validation 400 instead of
FastAPI's 422, engine death 503, unexpected exceptions 500). Messages are bounded in length.

A server error (5xx other than the server's own 503s) never shows exception text: its body says
"internal error (id: ...)" and the text goes to the log under that id.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from v1.core.errors import EngineDeadError
from v1.logger import init_logger

logger = init_logger(__name__)

MAX_MESSAGE_CHARS = 1000
"""Error messages are cut to this length (they may quote user input)."""

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    503: "service_unavailable_error",
}


class APIError(HTTPException):
    """A failure with its HTTP status and the fields of the OpenAI error body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if status_code >= 500 and status_code != 503:
            message = internal_error_message(message)
        super().__init__(status_code=status_code, detail=message, headers=dict(headers or {}))
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPES.get(status_code, "server_error")


_ERROR_ID = re.compile(r"\(id: ([0-9a-f]{32})\)")


def internal_error_message(detail: str) -> str:
    """ "internal error (id: ...)"; `detail` (exception text) goes to the log under that id. A
    detail that already names an id (an error logged where it happened) keeps it."""
    found = _ERROR_ID.search(detail)
    error_id = found.group(1) if found else uuid.uuid4().hex
    if found is None:
        logger.error("internal error (id: %s): %s", error_id, detail)
    return f"internal error (id: {error_id})"


class ClientDisconnected(Exception):
    """The client went away before the response; its engine requests were aborted."""


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def bounded(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    return message if len(message) <= limit else message[: limit - 15] + "... (truncated)"


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {"message": bounded(message), "type": error_type, "param": param, "code": code}
    }


def error_response(error: APIError) -> JSONResponse:
    body = error_body(error.message, error.error_type, error.param, error.code)
    return JSONResponse(body, status_code=error.status_code, headers=error.headers)


RETRY_AFTER_S = 1
"""Retry-After (seconds) of the 503s: overload, drain, engine death."""


def engine_dead_error(e: BaseException | str) -> APIError:
    """503 + Retry-After; the reason (exception text) goes to the log under the id the body
    names."""
    error_id = uuid.uuid4().hex
    logger.error("engine not running (id: %s): %s", error_id, e)
    return APIError(
        503,
        f"the engine is not running; retry on another instance (id: {error_id})",
        code="engine_dead",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def validation_message(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """(message, param) of pydantic / FastAPI validation errors."""
    if not errors:
        return "invalid request", None
    unknown = [_field_path(e) for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:
        return unrecognized_message(unknown), unknown[0]
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON: {detail}".rstrip(": "), None
    parts = []
    for err in errors[:5]:
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "form")]
        # Union members show up in the location (e.g. "str", "list[int]"); drop them.
        loc = [p for p in loc if not (p.startswith(("list[", "dict[")) or p in ("str", "int"))]
        msg = err.get("msg", "invalid value")
        if err.get("type") in ("model_attributes_type", "dict_type") and not loc:
            msg = "the request body must be a JSON object"
        parts.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
    more = f" (and {len(errors) - 5} more errors)" if len(errors) > 5 else ""
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "form")]
    return "; ".join(parts) + more, (loc[0] if loc else None)


def unrecognized_message(names: Sequence[str]) -> str:
    """OpenAI's words for request fields it does not know."""
    if len(names) == 1:
        return f"Unrecognized request argument supplied: {names[0]}"
    return f"Unrecognized request arguments supplied: {', '.join(names)}"


def _field_path(error: Mapping[str, Any]) -> str:
    """The location of a field error without the "body" / "form" prefix: `x`, `messages.0.x`."""
    parts = [str(p) for p in error.get("loc", ()) if p not in ("body", "form")]
    # Union members show up in the location (str, list[int], a model's class name); drop them.
    return ".".join(
        p
        for p in parts
        if not (p.startswith(("list[", "dict[")) or p in ("str", "int") or p[:1].isupper())
    )


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app produces gets the OpenAI error body."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(_json_safe(exc.errors()))
        code = None if message.startswith("Unrecognized request argument") else "invalid_value"
        return error_response(APIError(400, message, param=param, code=code))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> Response:
        if isinstance(exc, APIError):
            return error_response(exc)
        if isinstance(exc.__cause__, APIError):  # raised while FastAPI read the body
            return error_response(exc.__cause__)
        if isinstance(exc.__cause__, ClientDisconnect):  # left while sending the body
            return Response(status_code=499)
        if exc.status_code == 413:
            message = "the request body is larger than this server accepts"
            return error_response(APIError(413, message, code="payload_too_large"))
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 400 and detail.startswith(_FORM_PART_TOO_LARGE):
            return error_response(_oversized_form_field(detail))
        return error_response(APIError(exc.status_code, detail, headers=exc.headers))

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(engine_dead_error(exc))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        error_id = uuid.uuid4().hex
        logger.exception(
            "unhandled error on %s %s (id: %s)", request.method, request.url.path, error_id
        )
        return error_response(APIError(500, f"(id: {error_id})"))


_FORM_PART_TOO_LARGE = ("Part exceeded maximum size", "Field exceeded maximum size")
"""Starlette's words for a multipart part without a filename (kept in memory) past its cap."""


def _oversized_form_field(detail: str) -> APIError:
    """A large form part that is not a file: almost always a file sent without a filename,
    which multipart parsers take for a text field."""
    size = detail.rsplit(" ", 1)[-1].rstrip(".")
    return APIError(
        400,
        f"a form field is larger than {size}: only the file may be large, and it must be sent "
        'as a file part with a filename (Content-Disposition: form-data; name="file"; '
        'filename="audio.flac"); a part without a filename is taken for a text field',
        param="file",
        code="invalid_form",
    )


def _json_safe(errors: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in err.items() if k in ("type", "loc", "msg", "ctx")} for err in errors]
