"""The OpenAI-compatible HTTP server (FastAPI on uvicorn + uvloop) over AsyncLLM: `api_server`
builds the app, `serving_*` hold one endpoint family each, `protocol` the request/response bodies.
"""
