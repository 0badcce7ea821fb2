"""The `v1` command's parser and its entry-point subcommands (`serve`, `transcribe`, `generate`,
`embed`); packages above add theirs as `Subcommand`s (`v1 batch`, through `v1.__main__`).
Engine flags and their help come from `v1.config.engine_arg_fields()`. Inputs and the model are
checked before the model loads; errors are one line on stderr.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import os
import signal
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from v1 import envs

DEFAULT_WHISPER_MODEL = "openai/whisper-base"
_SCALARS: dict[str, type] = {
    "int": int,
    "float": float,
    "str": str,
    "bool": bool,
    "list[str]": list,  # a flag taking zero or more strings
}


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
    annotation is not a plain scalar. `list[str]` counts as one (`list`: a multi-value flag)."""
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


_NO_KV_CACHE = frozenset(
    {
        "block_size",
        "num_kv_blocks",
        "kv_cache_memory_bytes",
        "enable_prefix_caching",
        "enable_chunked_prefill",
        "max_model_len",
        "max_num_encoder_input_tokens",
        "encoder_cache_size",
    }
)
IGNORED_ENGINE_ARGS: dict[str, frozenset[str]] = {
    "serve": frozenset(),
    # Requests from the command line carry no priority.
    "generate": frozenset({"policy"}),
    # Whisper: its own tokenizer and decoder length, short prompts, built-in architecture.
    "transcribe": frozenset(
        {
            "policy",
            "tokenizer",
            "max_model_len",
            "trust_remote_code",
            "enable_chunked_prefill",
        }
    ),
    # Encoder-only models keep no KV cache and run each input whole.
    "embed": _NO_KV_CACHE | {"policy"},
}
"""Engine arguments a subcommand does not offer (they mean nothing to what it runs)."""


def add_engine_args(parser: argparse.ArgumentParser, ignored: frozenset[str] = frozenset()) -> None:
    """One flag per engine argument not in `ignored` (only flags given on the command line
    reach the engine)."""
    from v1.config import EngineConfig, engine_arg_fields

    group = parser.add_argument_group("engine arguments")
    docs: dict[type, dict[str, str]] = {}
    for owner, f in engine_arg_fields():
        kind, _ = _scalar_type(f.type)
        if kind is None or f.name in ignored:
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
        elif kind is list:
            group.add_argument(
                flag,
                dest=f.name,
                nargs="*",
                default=argparse.SUPPRESS,
                metavar=f.name.upper(),
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


@dataclasses.dataclass(frozen=True)
class Subcommand:
    """A subcommand that a package above the entry points adds to `v1` (`v1 batch`)."""

    add_parser: Callable[[Any, Callable[..., None]], None]
    """`add_parser(subparsers, add_engine_args)` declares the subcommand's parser."""
    run: Callable[[argparse.Namespace, dict[str, Any]], int]
    """`run(args, engine_kwargs(args))` runs it and returns the exit code."""


# ---- parser ----
def make_parser(extra: Mapping[str, Subcommand] | None = None) -> argparse.ArgumentParser:
    """The `v1` parser: the entry points' subcommands, then the `extra` ones."""
    from v1.version import __version__

    parser = argparse.ArgumentParser(
        prog="v1", description="v1-engine: serve and run transformer models."
    )
    parser.add_argument("--version", action="version", version=f"v1-engine {__version__}")
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
    add_engine_args(serve, IGNORED_ENGINE_ARGS["serve"])

    _add_transcribe(sub)
    _add_generate(sub)
    _add_embed(sub)
    for command in (extra or {}).values():
        command.add_parser(sub, add_engine_args)
    return parser


def _add_transcribe(sub: Any) -> None:
    p = sub.add_parser(
        "transcribe",
        help="transcribe or translate audio files",
        description="Transcribe (or translate to English) audio files with a Whisper model. "
        "Long files are decoded in 30 s windows that follow the speech (each starts where the "
        "last complete segment ended), conditioned on the text before them.",
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="audio files (wav, flac, mp3, ...)")
    p.add_argument(
        "--model", default=DEFAULT_WHISPER_MODEL, help="Whisper model (default: %(default)s)"
    )
    p.add_argument("--language", default=None, help="spoken language (default: detect)")
    p.add_argument(
        "--task",
        default="transcribe",
        choices=["transcribe", "translate"],
        help="transcribe, or translate to English (default: %(default)s)",
    )
    p.add_argument(
        "--timestamps",
        action="store_true",
        help="segment times: '[start --> end] text' lines with --format text, segments in json",
    )
    p.add_argument(
        "--word-timestamps",
        action="store_true",
        help="time every word (cross-attention alignment); json formats get 'words'",
    )
    p.add_argument(
        "--format",
        default="text",
        choices=list(FORMATS),
        help="output format; verbose_json is json with segments (default: %(default)s)",
    )
    p.add_argument("--prompt", default=None, help="text that precedes the audio (names, style)")
    p.add_argument(
        "--condition-on-previous-text",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="prompt each 30 s window with the text before it (default: on)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        nargs="+",
        default=None,
        metavar="T",
        help="decoding temperatures to fall back through (default: 0 0.2 0.4 0.6 0.8 1)",
    )
    for flag, default, text in _FALLBACK_FLAGS:
        p.add_argument(flag, type=float, default=default, metavar="X", help=text)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_engine_args(p, IGNORED_ENGINE_ARGS["transcribe"])


FORMATS = ("text", "srt", "vtt", "json", "verbose_json")
_FALLBACK_FLAGS = (
    (
        "--compression-ratio-threshold",
        2.4,
        "decode a window again, hotter, when its compression ratio is above X (default: 2.4)",
    ),
    (
        "--logprob-threshold",
        -1.0,
        "decode a window again, hotter, when its mean logprob is below X (default: -1.0)",
    ),
    (
        "--no-speech-threshold",
        0.6,
        "skip a window as silence when P(no speech) is above X and its mean logprob is below "
        "the logprob threshold (default: 0.6)",
    ),
)


def _add_generate(sub: Any) -> None:
    p = sub.add_parser("generate", help="complete prompts (one output line per prompt)")
    p.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompts to complete")
    p.add_argument("--model", required=True, help="model folder or Hugging Face hub id")
    p.add_argument(
        "--max-tokens", type=int, default=64, help="tokens to generate (default: %(default)s)"
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature, 0 for greedy (default: %(default)s)",
    )
    add_engine_args(p, IGNORED_ENGINE_ARGS["generate"])


def _add_embed(sub: Any) -> None:
    p = sub.add_parser("embed", help="embed texts (JSON lines of vectors)")
    p.add_argument("texts", nargs="+", metavar="TEXT", help="texts to embed")
    p.add_argument("--model", required=True, help="embedding model folder or Hugging Face hub id")
    add_engine_args(p, IGNORED_ENGINE_ARGS["embed"])


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
        "--max-realtime-sessions",
        type=int,
        default=64,
        help="/v1/realtime transcription sessions open at once; more are refused with 503 "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--realtime-idle-timeout",
        type=float,
        default=300.0,
        help="seconds a /v1/realtime session may send no event before it is closed "
        "(default: %(default)s)",
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
    """Checks every file and the model first; transcribes the files that can be read, prints
    their results, and exits 1 naming the files that could not."""
    from v1.audio import SAMPLE_RATE, AudioError, load_audio
    from v1.entrypoints.llm import LLM
    from v1.model_source import check_model_source

    failed: list[str] = []
    for path in args.files:
        if not os.path.isfile(path):
            problem = "no such file" if not os.path.exists(path) else "not a regular file"
            _error("transcribe", f"{path}: {problem}")
            failed.append(path)
    check_model_source(args.model, revision=getattr(args, "revision", None))
    waveforms: dict[str, Any] = {}
    for path in args.files:
        if path in failed:
            continue
        try:
            waveforms[path] = load_audio(path)
        except AudioError as e:
            _error("transcribe", str(e) if path in str(e) else f"{path}: {e}")
            failed.append(path)
    if waveforms:
        options = {
            "language": args.language,
            "task": args.task,
            "timestamps": args.timestamps or args.format in ("srt", "vtt", "verbose_json"),
            "prompt": args.prompt,
            "condition_on_previous_text": args.condition_on_previous_text,
            "compression_ratio_threshold": args.compression_ratio_threshold,
            "logprob_threshold": args.logprob_threshold,
            "no_speech_threshold": args.no_speech_threshold,
            "word_timestamps": args.word_timestamps,
        }
        if args.temperature is not None:
            options["temperature"] = tuple(args.temperature)
        with LLM(args.model, **engine_kwargs(args)) as llm:
            audio = [(w, SAMPLE_RATE) for w in waveforms.values()]
            results = llm.transcribe(audio, use_tqdm=not args.quiet, **options)
        for path, result in zip(waveforms, results, strict=True):
            _print_transcript(args, path, result, many=len(args.files) > 1)
    if failed:
        _error(
            "transcribe", f"{len(failed)} of {len(args.files)} file(s) failed: {', '.join(failed)}"
        )
        return 1
    return 0


def _print_transcript(args: argparse.Namespace, path: str, result: Any, many: bool) -> None:
    from v1.entrypoints.openai import transcript_formats as formats

    if args.format in ("json", "verbose_json"):
        segments = args.format == "verbose_json" or args.timestamps
        body = formats.to_verbose_json(
            result, args.task, with_segments=segments, with_words=args.word_timestamps
        )
        print(json.dumps({"file": path, **body.model_dump(exclude_none=True)}), flush=True)
        return
    if many:
        print(f"==> {path} <==")
    if args.format == "srt":
        print(formats.to_srt(result.segments))
    elif args.format == "vtt":
        print(formats.to_vtt(result.segments))
    elif args.timestamps:
        for s in result.segments:
            start, end = (formats.format_timestamp(t, ".") for t in (s.start, s.end))
            print(f"[{start} --> {end}] {s.text.strip()}")
    else:
        print(result.text.strip())
    sys.stdout.flush()


def _error(command: str, message: str) -> None:
    print(f"v1 {command}: error: {message}", file=sys.stderr, flush=True)


def _generate(args: argparse.Namespace) -> int:
    from v1.entrypoints.llm import LLM
    from v1.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    with LLM(args.model, **engine_kwargs(args)) as llm:
        outputs = llm.generate(list(args.prompts), params, use_tqdm=False)
    for out in outputs:
        print(out.outputs[0].text)
    return 0


def _embed(args: argparse.Namespace) -> int:
    from v1.entrypoints.llm import LLM

    with LLM(args.model, **engine_kwargs(args)) as llm:
        outputs = llm.embed(list(args.texts), use_tqdm=False)
    for text, out in zip(args.texts, outputs, strict=True):
        print(json.dumps({"text": text, "embedding": out.outputs.embedding}))
    return 0


_COMMANDS = {
    "serve": _serve,
    "transcribe": _transcribe,
    "generate": _generate,
    "embed": _embed,
}


def main(argv: Sequence[str] | None = None, extra: Mapping[str, Subcommand] | None = None) -> int:
    """Parses `argv` and runs the subcommand; `extra`: subcommands added from above."""
    extra = extra or {}
    parser = make_parser(extra)
    args = parser.parse_args(argv)
    if args.command != "serve":  # the server handles its own signals
        # SIGTERM unwinds like Ctrl-C, so the engine shuts down and its socket dir goes.
        signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        if args.command in extra:
            return extra[args.command].run(args, engine_kwargs(args))
        return _COMMANDS[args.command](args)
    except ValueError as e:  # bad model, engine argument or input: the user's to fix
        _error(args.command, str(e))
        return 2
    except KeyboardInterrupt:
        return 130


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
