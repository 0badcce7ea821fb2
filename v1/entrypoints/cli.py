"""The `v1` command: `v1 serve MODEL`, `v1 transcribe FILE...`, `v1 generate`, `v1 embed`.

Engine flags and their --help text are generated from `v1.config.engine_arg_fields()` (type,
default, the field's docstring), so every engine argument is settable from every subcommand.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from v1 import envs

DEFAULT_WHISPER_MODEL = "openai/whisper-base"
_SCALARS: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool}


# ---- engine flags ----
def attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it in the class body (one line)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for node, following in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _scalar_type(annotation: Any) -> tuple[type | None, bool]:
    """(the scalar type of a field annotation, whether None is allowed); (None, _) when the
    annotation is not a plain scalar."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    parts = [p.strip() for p in str(text).split("|")]
    optional = "None" in parts
    scalars = [p for p in parts if p != "None"]
    if len(scalars) != 1:
        return None, optional
    return _SCALARS.get(scalars[0]), optional


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return "unset" if f.default is None else repr(f.default)
    return "computed"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per engine argument (only flags given on the command line reach the engine)."""
    from v1.config import EngineConfig, engine_arg_fields

    group = parser.add_argument_group("engine arguments")
    docs: dict[type, dict[str, str]] = {}
    for owner, f in engine_arg_fields():
        kind, _ = _scalar_type(f.type)
        if kind is None:
            continue
        doc = docs.setdefault(owner, attribute_docs(owner)).get(f.name, "")
        help_text = f"{doc} [{owner.__name__}; default: {_default_text(f)}]".strip().replace(
            "%", "%%"
        )
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            group.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            group.add_argument(
                flag,
                dest=f.name,
                type=kind,
                default=argparse.SUPPRESS,
                metavar=f.name.upper(),
                help=help_text,
            )
    eager_doc = attribute_docs(EngineConfig).get("enforce_eager", "Disable CUDA graphs.")
    group.add_argument(
        "--enforce-eager",
        dest="enforce_eager",
        action="store_true",
        default=argparse.SUPPRESS,
        help=f"{eager_doc} [EngineConfig; default: False]",
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments given on the command line."""
    from v1.config import engine_arg_fields

    names = {f.name for _, f in engine_arg_fields()} | {"enforce_eager"}
    return {name: value for name, value in vars(args).items() if name in names}


# ---- parser ----
def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="v1", description="v1-engine: serve and run transformer models."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    serve.add_argument("model", help="local model folder or Hugging Face hub id")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    serve.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health)"
    )
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use as `model` (default: the model argument)",
    )
    serve.add_argument(
        "--max-pending",
        type=int,
        default=envs.V1_MAX_PENDING_REQUESTS,
        help="inference requests held at once; more get 503 (default: %(default)s)",
    )
    serve.add_argument(
        "--max-audio-bytes",
        type=int,
        default=envs.V1_MAX_AUDIO_BYTES,
        help="largest audio upload in bytes; larger ones get 413 (default: %(default)s)",
    )
    serve.add_argument(
        "--max-audio-seconds",
        type=float,
        default=float(envs.V1_MAX_AUDIO_SECONDS),
        help="longest decoded audio in seconds (default: %(default)s)",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=int,
        default=envs.V1_MAX_REQUEST_BYTES,
        help="largest JSON request body in bytes (default: %(default)s)",
    )
    serve.add_argument(
        "--chat-template", default=None, help="a Jinja chat template file (or text) to use"
    )
    _add_server_limits(serve)
    serve.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level (default: %(default)s)",
    )
    add_engine_args(serve)

    transcribe = sub.add_parser("transcribe", help="transcribe or translate audio files")
    transcribe.add_argument("files", nargs="+", metavar="FILE", help="audio files")
    transcribe.add_argument(
        "--model", default=DEFAULT_WHISPER_MODEL, help="Whisper model (default: %(default)s)"
    )
    transcribe.add_argument("--language", default=None, help="spoken language (default: detect)")
    transcribe.add_argument("--task", default="transcribe", choices=["transcribe", "translate"])
    transcribe.add_argument("--timestamps", action="store_true", help="segment timestamps")
    transcribe.add_argument(
        "--format", default="text", choices=["text", "srt", "vtt", "json"], help="output format"
    )
    add_engine_args(transcribe)

    generate = sub.add_parser("generate", help="complete prompts")
    generate.add_argument("prompts", nargs="+", metavar="PROMPT")
    generate.add_argument("--model", required=True, help="model folder or hub id")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    add_engine_args(generate)

    embed = sub.add_parser("embed", help="embed texts (JSON lines of vectors)")
    embed.add_argument("texts", nargs="+", metavar="TEXT")
    embed.add_argument("--model", required=True, help="embedding model folder or hub id")
    add_engine_args(embed)
    return parser


def _add_server_limits(serve: argparse.ArgumentParser) -> None:
    """`v1 serve` flags for per-request budgets, connection limits and shutdown."""
    from v1.entrypoints.openai.http_limits import HttpLimits
    from v1.entrypoints.openai.serving_engine import DEFAULT_MAX_TOKENS_PER_REQUEST

    http = HttpLimits()
    group = serve.add_argument_group("limits and shutdown")
    group.add_argument(
        "--max-prompt-chars",
        type=int,
        default=None,
        help="longest prompt / input text in characters, checked before tokenizing (default: "
        "32 x the model's context length, at least 200000)",
    )
    group.add_argument(
        "--max-tokens-per-request",
        type=int,
        default=DEFAULT_MAX_TOKENS_PER_REQUEST,
        help="input tokens one request may hold over all its prompts, inputs and n samples "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--max-header-bytes",
        type=int,
        default=http.max_header_bytes,
        help="request line plus headers, in bytes; more gets 431 (default: %(default)s)",
    )
    group.add_argument(
        "--max-headers",
        type=int,
        default=http.max_headers,
        help="header fields per request; more gets 431 (default: %(default)s)",
    )
    group.add_argument(
        "--header-timeout",
        type=float,
        default=http.header_timeout,
        help="seconds for a request's headers to arrive; then 408 (default: %(default)s)",
    )
    group.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=5.0,
        help="seconds an idle connection stays open (default: %(default)s)",
    )
    group.add_argument(
        "--max-connections",
        type=int,
        default=http.max_connections,
        help="open connections; more get 503 (default: %(default)s)",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds to drain in-flight requests (new ones get 503) before "
        "failing them; then exit 0 (default: %(default)s)",
    )
    group.add_argument(
        "--audio-chunk-seconds",
        type=int,
        default=300,
        help="audio a transcription decodes and hands the engine at a time, a multiple of 30 "
        "(bounds its memory and its share of the engine; default: %(default)s)",
    )
    group.add_argument(
        "--keep-alive-on-engine-death",
        action="store_true",
        help="keep answering 503 when the engine dies instead of exiting with code 1",
    )


# ---- commands ----
def _serve(args: argparse.Namespace) -> int:
    from v1.entrypoints.openai.api_server import run_server

    return run_server(args, engine_kwargs(args))


def _transcribe(args: argparse.Namespace) -> int:
    from v1 import LLM
    from v1.entrypoints.openai import transcript_formats as formats

    timestamps = args.timestamps or args.format in ("srt", "vtt")
    with LLM(args.model, **engine_kwargs(args)) as llm:
        results = llm.transcribe(
            list(args.files), language=args.language, task=args.task, timestamps=timestamps
        )
    many = len(args.files) > 1
    for path, result in zip(args.files, results, strict=True):
        if args.format == "json":
            body = formats.to_verbose_json(result, args.task, 0.0, with_segments=timestamps)
            print(json.dumps({"file": path, **body.model_dump(exclude_none=True)}))
            continue
        if many:
            print(f"==> {path} <==")
        if args.format == "srt":
            print(formats.to_srt(result.segments))
        elif args.format == "vtt":
            print(formats.to_vtt(result.segments))
        else:
            print(result.text.strip())
    return 0


def _generate(args: argparse.Namespace) -> int:
    from v1 import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    with LLM(args.model, **engine_kwargs(args)) as llm:
        outputs = llm.generate(list(args.prompts), params, use_tqdm=False)
    for out in outputs:
        print(out.outputs[0].text)
    return 0


def _embed(args: argparse.Namespace) -> int:
    from v1 import LLM

    with LLM(args.model, **engine_kwargs(args)) as llm:
        outputs = llm.embed(list(args.texts), use_tqdm=False)
    for text, out in zip(args.texts, outputs, strict=True):
        print(json.dumps({"text": text, "embedding": out.outputs.embedding}))
    return 0


_COMMANDS = {"serve": _serve, "transcribe": _transcribe, "generate": _generate, "embed": _embed}


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except ValueError as e:  # bad model, engine argument or input: the user's to fix
        print(f"v1 {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
