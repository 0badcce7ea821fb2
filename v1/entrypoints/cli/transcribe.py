"""`v1 transcribe`: openai-whisper's and faster-whisper's flags, checked before the model
loads; transcripts printed (segment lines stream as they are decoded) and written into
`--output-dir` as txt, srt, vtt, tsv and json."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from v1.entrypoints.cli.engine_args import IGNORED_ENGINE_ARGS, add_engine_args, engine_kwargs
from v1.entrypoints.cli.report import error

DEFAULT_WHISPER_MODEL = "openai/whisper-base"


def add_transcribe_parser(sub: Any) -> None:
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


def run_transcribe(args: argparse.Namespace) -> int:
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
        error("transcribe", str(e))
        return 2
    for path in args.files:
        if not os.path.isfile(path):
            problem = "no such file" if not os.path.exists(path) else "not a regular file"
            error("transcribe", f"{path}: {problem}")
            failed.append(path)
    check_model_source(args.model, revision=getattr(args, "revision", None))
    waveforms: dict[str, Any] = {}
    for path in args.files:
        if path in failed:
            continue
        try:
            waveforms[path] = load_audio(path)
        except AudioError as e:
            error("transcribe", str(e) if path in str(e) else f"{path}: {e}")
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
        error(
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
