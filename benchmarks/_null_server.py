"""A server that only takes the upload: what `serve_load.py --null-server` sends its load to,
to measure what the load client (and one Python HTTP server's multipart parsing) can carry
without an engine behind it. Answers /health, and /v1/audio/transcriptions with the upload's
size as its text.

    python3 -m uvicorn _null_server:app --port PORT --loop uvloop --http httptools
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route


async def transcribe(request: Request) -> JSONResponse:
    form = await request.form()
    upload = form["file"]
    data = await upload.read()  # type: ignore[union-attr]
    return JSONResponse({"text": str(len(data))})


async def health(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


app = Starlette(
    routes=[
        Route("/v1/audio/transcriptions", transcribe, methods=["POST"]),
        Route("/health", health),
    ]
)
