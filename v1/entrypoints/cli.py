"""The `v1` command's parser and its entry-point subcommands (`serve`, `transcribe`, `generate`,
`embed`); packages above add theirs as `Subcommand`s (`v1 batch`, through `v1.__main__`).
Engine flags and their help come from `v1.config.engine_arg_fields()`. Inputs and the model are
checked before the model loads; errors are one line on stderr.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
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
@functools.cache  # parsing a class's source is slow; make_parser asks once per engine flag
def attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it in the class body (one line; read-only)."""
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


_FLAG_ALIASES: dict[str, tuple[str, ...]] = {"policy": ("--scheduling-policy",)}
"""vLLM's names of engine flags, accepted beside ours."""
_FLAG_CHOICES: dict[str, tuple[str, ...]] = {"policy": ("fcfs", "priority")}
"""Engine flags whose values argparse checks (an error before anything loads)."""


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
        aliases = _FLAG_ALIASES.get(f.name, ())
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
                *aliases,
                dest=f.name,
                type=kind,
                choices=_FLAG_CHOICES.get(f.name),
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
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) served under NAME (needs --enable-lora)",
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
        help="segment times: '[start --> end] text' lines with --format text (each printed as "
        "soon as its 30 s window is decoded), segments in json",
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
    _add_faster_whisper_flags(p)
    add_engine_args(p, IGNORED_ENGINE_ARGS["transcribe"])


OUTPUT_FORMATS = ("txt", "srt", "vtt", "tsv", "json")


def _add_faster_whisper_flags(p: argparse.ArgumentParser) -> None:
    """faster-whisper's decoding options and openai-whisper's output files."""
    p.add_argument(
        "--output-dir",
        default=None,
        help="write each file's transcript there as <name>.<format> (see --output-format)",
    )
    p.add_argument(
        "--output-format",
        default="all",
        choices=["all", *OUTPUT_FORMATS],
        help="files written into --output-dir (default: %(default)s); srt and vtt have one "
        "cue per word with --word-timestamps",
    )
    p.add_argument("--beam-size", type=int, default=None, help="beam search width at T=0")
    p.add_argument("--best-of", type=int, default=None, help="samples per window at T>0")
    p.add_argument("--vad-filter", action="store_true", help="skip non-speech (Silero VAD)")
    p.add_argument(
        "--vad-parameters", default=None, metavar="JSON", help="e.g. '{\"threshold\": 0.4}'"
    )
    p.add_argument(
        "--batch-size", type=int, default=None, help="decode VAD chunks this many at a time"
    )
    p.add_argument("--clip-timestamps", default=None, help='"start,end,..." seconds to decode')
    p.add_argument("--hotwords", default=None, help="hint phrase for every window")
    p.add_argument("--prefix", default=None, help="text forced at the start of the first window")
    p.add_argument("--initial-prompt", default=None, help="faster-whisper's name for --prompt")
    p.add_argument(
        "--hallucination-silence-threshold",
        type=float,
        default=None,
        metavar="S",
        help="with --word-timestamps: skip silences longer than S seconds around hallucinations",
    )
    p.add_argument("--multilingual", action="store_true", help="detect the language per window")
    p.add_argument("--without-timestamps", action="store_true", help="no timestamp tokens")
    p.add_argument(
        "--max-initial-timestamp",
        type=float,
        default=1.0,
        metavar="S",
        help="latest first timestamp of a window, in seconds (default 1.0)",
    )
    p.add_argument(
        "--suppress-tokens", default="-1", help="comma-separated ids (-1: the default set)"
    )
    p.add_argument(
        "--suppress-blank",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="no blank first token (default: on)",
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="penalty on tokens already generated (> 1 discourages them; default 1.0: off)",
    )
    p.add_argument(
        "--no-repeat-ngram-size",
        type=int,
        default=0,
        help="forbid repeating any n-gram of this size (default 0: off)",
    )


def _faster_whisper_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options of the flags above; ValueError (shown before the model loads) when bad."""
    options: dict[str, Any] = {}
    if args.beam_size is not None:
        options["beam_size"] = args.beam_size
    if args.best_of is not None:
        options["best_of"] = args.best_of
    if args.vad_filter:
        options["vad_filter"] = True
    if args.vad_parameters:
        try:
            options["vad_parameters"] = json.loads(args.vad_parameters)
        except json.JSONDecodeError as e:
            raise ValueError(f"--vad-parameters must be a JSON object: {e}") from e
    try:
        suppress = [int(t) for t in args.suppress_tokens.split(",") if t.strip()]
    except ValueError as e:
        raise ValueError("--suppress-tokens must be comma-separated token ids") from e
    names = (
        "batch_size",
        "clip_timestamps",
        "hotwords",
        "prefix",
        "initial_prompt",
        "hallucination_silence_threshold",
    )
    options.update({n: getattr(args, n) for n in names if getattr(args, n) is not None})
    options.update(
        multilingual=args.multilingual,
        without_timestamps=args.without_timestamps,
        max_initial_timestamp=args.max_initial_timestamp,
        suppress_tokens=suppress,
        suppress_blank=args.suppress_blank,
        repetition_penalty=args.repetition_penalty,
        no_repeat_ngram_size=args.no_repeat_ngram_size,
    )
    return options


def _check_transcribe_args(args: argparse.Namespace, options: dict[str, Any]) -> None:
    """The checks that need no model (language, temperature, every option's type and range):
    ValueError before anything loads."""
    from v1.engine.inputs.whisper import normalize_language
    from v1.engine.transcription import TranscriptionOptions

    if args.language is not None and normalize_language(args.language) is None:
        raise ValueError(f"--language: unknown language {args.language!r}")
    for t in args.temperature or ():
        if not 0.0 <= t <= 2.0:
            raise ValueError(f"--temperature must be in [0, 2], got {t}")
    TranscriptionOptions(**options)


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
        "--max-connections-per-client",
        type=int,
        default=http.max_connections_per_client,
        help="open connections from one client address; more get 429 (default: %(default)s)",
    )
    group.add_argument(
        "--body-timeout",
        type=float,
        default=60.0,
        help="seconds for a request's body to arrive after its headers; then 408 "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--max-request-seconds",
        type=float,
        default=1800.0,
        help="wall-clock budget of one inference request; past it its work is stopped and it "
        "ends with a 408 error (0: no budget; default: %(default)s)",
    )
    group.add_argument(
        "--health-timeout",
        type=float,
        default=10.0,
        help="/health answers 503 when the engine core does not answer within this many "
        "seconds (default: %(default)s)",
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
    try:
        fw_options = _faster_whisper_options(args)
        checked = dict(fw_options)
        if args.temperature is not None:
            checked["temperature"] = tuple(args.temperature)
        _check_transcribe_args(args, checked)
    except ValueError as e:
        _error("transcribe", str(e))
        return 2
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
            **fw_options,
        }
        if args.output_dir is not None:
            options["timestamps"] = True  # srt, vtt, tsv and json files are timed
        if args.without_timestamps:
            options["timestamps"] = False
        if args.initial_prompt is not None:
            options.pop("prompt")
        if args.temperature is not None:
            options["temperature"] = tuple(args.temperature)
        many = len(args.files) > 1
        # '[start --> end] text' lines come out as each segment is decoded (whisper --verbose).
        streaming = args.format == "text" and args.timestamps
        with LLM(args.model, **engine_kwargs(args)) as llm:
            audio = [(w, SAMPLE_RATE) for w in waveforms.values()]
            if streaming:
                stream = llm.transcribe(audio, use_tqdm=not args.quiet, stream=True, **options)
                with stream:
                    _print_segment_lines(stream, list(waveforms), many)
                    results = stream.results
            else:
                results = llm.transcribe(audio, use_tqdm=not args.quiet, **options)
        for path, result in zip(waveforms, results, strict=True):
            if not streaming:
                _print_transcript(args, path, result, many=many)
            if args.output_dir is not None:
                _write_outputs(args, path, result)
    if failed:
        _error(
            "transcribe", f"{len(failed)} of {len(args.files)} file(s) failed: {', '.join(failed)}"
        )
        return 1
    return 0


def _print_segment_lines(stream: Any, paths: list[str], many: bool) -> None:
    """Each segment of a TranscriptionStream as its '[start --> end] text' line, flushed as
    soon as it is decoded; with many files, each file's lines under its '==> path <==' line."""
    shown = -1  # the last file whose header is out

    def headers_until(index: int) -> None:
        nonlocal shown
        while many and shown < index:
            shown += 1
            print(f"==> {paths[shown]} <==", flush=True)

    for segment in stream:
        headers_until(stream.input_index)
        print(_segment_line(segment), flush=True)
    headers_until(len(paths) - 1)


def _segment_line(segment: Any) -> str:
    """openai-whisper's verbose line: '[MM:SS.mmm --> MM:SS.mmm] text' (hours when there are)."""

    def stamp(seconds: float) -> str:
        millis = max(0, round(seconds * 1000))
        hours, millis = divmod(millis, 3_600_000)
        minutes, millis = divmod(millis, 60_000)
        secs, millis = divmod(millis, 1000)
        return (f"{hours:02d}:" if hours else "") + f"{minutes:02d}:{secs:02d}.{millis:03d}"

    return f"[{stamp(segment.start)} --> {stamp(segment.end)}] {segment.text.strip()}"


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
            print(_segment_line(s))
    else:
        print(result.text.strip())
    sys.stdout.flush()


def _write_outputs(args: argparse.Namespace, path: str, result: Any) -> None:
    """<output-dir>/<file name without extension>.<format> for each format asked."""
    from v1.entrypoints.openai import transcript_formats as formats

    os.makedirs(args.output_dir, exist_ok=True)
    stem = os.path.splitext(os.path.basename(path))[0]
    cues = result.segments
    if args.word_timestamps and result.words is not None:
        cues = formats.word_cues(result.segments)
    wanted = OUTPUT_FORMATS if args.output_format == "all" else (args.output_format,)
    for fmt in wanted:
        if fmt == "txt":
            body = "".join(s.text.strip() + "\n" for s in result.segments)
        elif fmt == "srt":
            body = formats.to_srt(cues)
        elif fmt == "vtt":
            body = formats.to_vtt(cues)
        elif fmt == "tsv":
            body = formats.to_tsv(result.segments)
        else:
            verbose = formats.to_verbose_json(
                result, args.task, with_segments=True, with_words=args.word_timestamps
            )
            data = verbose.model_dump(exclude_none=True)
            data["language_probability"] = result.language_probability
            body = json.dumps(data, ensure_ascii=False)
        with open(os.path.join(args.output_dir, f"{stem}.{fmt}"), "w", encoding="utf-8") as f:
            f.write(body)


def _error(command: str, message: str) -> None:
    print(f"v1 {command}: error: {message}", file=sys.stderr, flush=True)


_SUBCOMMAND_USAGE = {
    "transcribe": "v1 transcribe --model {model} FILE...",
    "generate": "v1 generate --model {model} PROMPT...",
    "embed": "v1 embed --model {model} TEXT...",
}


def check_model_kind(command: str, model: str, kwargs: Mapping[str, Any]) -> None:
    """ValueError naming the subcommand that fits when `model` cannot run `command` (a Whisper
    model given to `generate`, an embedding model to `generate`, a generative one to `embed`);
    reads only the model's config, before anything loads."""
    from v1.config import make_engine_config

    info = make_engine_config(model, **kwargs).model_config.info
    tasks = info.supported_tasks
    if "transcription" in tasks:
        fits, what = "transcribe", "a Whisper speech model"
    elif "generate" in tasks:
        fits, what = "generate", "a text generation model"
    else:
        fits, what = "embed", "an embedding (encoder-only) model"
    if fits == command:
        return
    usage = _SUBCOMMAND_USAGE[fits].format(model=model)
    raise ValueError(
        f"{model} is {what} ({info.architecture}), which `v1 {command}` cannot run: use `{usage}`"
    )


def _generate(args: argparse.Namespace) -> int:
    from v1.entrypoints.llm import LLM
    from v1.sampling_params import SamplingParams

    check_model_kind("generate", args.model, engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    with LLM(args.model, **engine_kwargs(args)) as llm:
        outputs = llm.generate(list(args.prompts), params, use_tqdm=False)
    for out in outputs:
        print(out.outputs[0].text)
    return 0


def _embed(args: argparse.Namespace) -> int:
    from v1.entrypoints.llm import LLM

    check_model_kind("embed", args.model, engine_kwargs(args))
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
