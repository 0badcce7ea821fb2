"""Latency of /v1/realtime transcription sessions: end of a spoken phrase -> its completed event,
and -> its first delta, p50/p99, with N concurrent sessions streaming speech at real time (or
faster with --speed).

Each session streams `--phrases` utterances (LibriSpeech clips from ../shared/assets), each
followed by `--gap` seconds of silence, as 24 kHz PCM16 in 100 ms appends under server VAD
(silence_duration_ms = `--silence-ms`). "End of the phrase" is the moment the append holding
the phrase's last sample was sent; a first delta that arrives while the phrase is still being
spoken counts negative. A session ends when the server has answered every turn of its audio
(see `run_session`), however early or late that is relative to the end of the stream.

    v1 serve MODEL --port 8000 --max-realtime-sessions 64 &
    python benchmarks/realtime_latency.py --url http://127.0.0.1:8000 --sessions 1,16,64
    python benchmarks/realtime_latency.py --model ../shared/assets/whisper-base --sessions 1,16
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
import soxr
import websockets
from _serve import wait_until_healthy

ASSETS = Path(__file__).resolve().parents[2] / "shared" / "assets"
CLIPS = [ASSETS / "audio" / "librispeech" / f"test_audio_{i}.flac" for i in (0, 1)]
RATE = 24_000
BLOCK = RATE // 10  # 100 ms


@dataclass
class Phrase:
    end_sent: float = 0.0
    """Wall time the append with the phrase's last sample went out."""
    start_sent: float = 0.0
    first_delta: float | None = None
    completed: float | None = None
    transcript: str = ""


@dataclass
class SessionResult:
    phrases: list[Phrase] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _speech(path: Path) -> np.ndarray:
    samples, rate = sf.read(str(path), dtype="float32")
    if samples.ndim > 1:
        samples = samples.mean(axis=1)
    return soxr.resample(samples, rate, RATE, quality="HQ").astype(np.float32)


def _stream(num_phrases: int, gap_s: float) -> tuple[bytes, list[tuple[int, int]]]:
    """PCM16 of the session and each phrase's (first, last) sample."""
    clips = [_speech(p) for p in CLIPS]
    parts, spans, pos = [np.zeros(RATE // 2, np.float32)], [], RATE // 2
    for i in range(num_phrases):
        clip = clips[i % len(clips)]
        spans.append((pos, pos + clip.size))
        parts += [clip, np.zeros(int(gap_s * RATE), np.float32)]
        pos += clip.size + int(gap_s * RATE)
    audio = np.concatenate(parts)
    return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes(), spans


async def run_session(
    url: str, args: argparse.Namespace, pcm: bytes, spans: list[tuple[int, int]]
) -> SessionResult:
    """One session: stream `pcm` at `args.speed`, then wait until every turn the server cut in
    it has its completed (or failed) event.

    The end is decided from the server's events, never from the clock: after the last append
    the session.update is sent again unchanged, and its second `transcription_session.updated`
    is a barrier (a session handles its client events in order), so every turn the audio
    started has been announced by then. The session is done when the barrier has come back and
    every announced turn is completed or failed; a turn still open at the barrier (the VAD has
    not seen `--silence-ms` of silence after it) is committed by hand. A completion that comes
    back while the trailing silence is still being streamed (a fast server, a long `--gap`)
    ends the session as well as a late one.
    """
    result = SessionResult(phrases=[Phrase() for _ in spans])
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    update = json.dumps(
        {
            "type": "transcription_session.update",
            "session": {
                "input_audio_format": "pcm16",
                "input_audio_transcription": {"language": args.language},
                "turn_detection": {
                    "type": "server_vad",
                    "silence_duration_ms": args.silence_ms,
                    "prefix_padding_ms": 300,
                },
            },
        }
    )
    async with websockets.connect(url, additional_headers=headers, max_size=None) as ws:
        await ws.send(update)
        # A phrase may be cut into several turns at its pauses: a turn belongs to the phrase
        # its audio ends in; a phrase is complete with its last turn, its first delta is the
        # first of any of its turns.
        starts_ms = [first * 1000 // RATE for first, _ in spans]
        phrase_of: dict[str, int] = {}
        deltas: dict[str, list[float]] = {}
        open_turns: set[str] = set()
        """Speech started, not yet committed."""
        unfinished: set[str] = set()
        """Committed, no completed / failed event yet."""
        updates_seen = 0
        barrier_seen = False

        def phrase_index(end_ms: int) -> int:
            return max(0, sum(s <= end_ms for s in starts_ms) - 1)

        async def read() -> None:
            nonlocal updates_seen, barrier_seen
            async for message in ws:
                event = json.loads(message)
                now = time.perf_counter()
                kind = event["type"]
                item = event.get("item_id", "")
                if kind == "error":
                    result.errors.append(event["error"]["message"])
                elif kind == "transcription_session.updated":
                    updates_seen += 1
                    if updates_seen == 2:
                        barrier_seen = True
                        if open_turns:  # no more audio will end these turns
                            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
                elif kind == "input_audio_buffer.speech_started":
                    open_turns.add(item)
                elif kind == "input_audio_buffer.speech_stopped":
                    phrase_of[item] = phrase_index(event["audio_end_ms"])
                elif kind == "input_audio_buffer.committed":
                    open_turns.discard(item)
                    unfinished.add(item)
                    # A turn committed by hand at the end belongs to the last phrase.
                    phrase_of.setdefault(item, len(spans) - 1)
                elif kind.endswith("transcription.delta"):
                    deltas.setdefault(item, []).append(now)
                elif kind.endswith("transcription.completed"):
                    unfinished.discard(item)
                    phrase = result.phrases[phrase_of.get(item, 0)]
                    phrase.completed = now  # turns complete in order: the last one wins
                    phrase.transcript += event["transcript"]
                    first = min(deltas.get(item, [now]))
                    phrase.first_delta = min(phrase.first_delta or first, first)
                elif kind.endswith("transcription.failed"):
                    unfinished.discard(item)
                    result.errors.append(f"turn {item} failed: {event['error']['message']}")
                if barrier_seen and not open_turns and not unfinished:
                    return
            result.errors.append("the server closed the session before every turn completed")

        reader = asyncio.ensure_future(read())
        try:
            await _send_audio(ws, args, pcm, spans, result)
            await ws.send(update)  # the barrier: answered after every append above is handled
            await asyncio.wait_for(reader, args.timeout)
        except TimeoutError:
            result.errors.append(
                f"timed out waiting for completions ({len(open_turns)} turns open, "
                f"{len(unfinished)} committed without a completion)"
            )
        except websockets.ConnectionClosed as e:
            result.errors.append(f"the connection closed: {e}")
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
    return result


async def _send_audio(
    ws: Any,
    args: argparse.Namespace,
    pcm: bytes,
    spans: list[tuple[int, int]],
    result: SessionResult,
) -> None:
    """`pcm` in 100 ms appends at `args.speed` times real time; notes when each phrase's first
    and last sample went out."""
    t0 = time.perf_counter()
    for start in range(0, len(pcm) // 2, BLOCK):
        # Paced by the clock, not by sleeps: a late loop catches up instead of drifting.
        due = t0 + start / RATE / args.speed
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        block = pcm[2 * start : 2 * (start + BLOCK)]
        await ws.send(
            json.dumps(
                {"type": "input_audio_buffer.append", "audio": base64.b64encode(block).decode()}
            )
        )
        sent = time.perf_counter()
        for phrase, (first, last) in zip(result.phrases, spans, strict=True):
            if start <= first < start + BLOCK:
                phrase.start_sent = sent
            if start < last <= start + BLOCK:
                phrase.end_sent = sent


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


async def run_level(url: str, args: argparse.Namespace, num_sessions: int) -> dict[str, Any]:
    pcm, spans = _stream(args.phrases, args.gap)
    results = await asyncio.gather(
        *(run_session(url, args, pcm, spans) for _ in range(num_sessions))
    )
    completed = [p.completed - p.end_sent for r in results for p in r.phrases if p.completed]
    first = [p.first_delta - p.end_sent for r in results for p in r.phrases if p.first_delta]
    from_start = [p.first_delta - p.start_sent for r in results for p in r.phrases if p.first_delta]
    errors = [e for r in results for e in r.errors]
    return {
        "sessions": num_sessions,
        "phrases": sum(len(r.phrases) for r in results),
        "completed": len(completed),
        "completed_p50": statistics.median(completed) if completed else float("nan"),
        "completed_p99": _pct(completed, 0.99),
        "first_delta_p50": statistics.median(first) if first else float("nan"),
        "first_delta_p99": _pct(first, 0.99),
        "first_delta_from_start_p50": statistics.median(from_start) if from_start else float("nan"),
        "errors": errors[:3],
        "num_errors": len(errors),
        "sample": results[0].phrases[0].transcript if results and results[0].phrases else "",
    }


def _start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "v1.entrypoints.cli", "serve", args.model, "--port", str(port)]
    cmd += ["--max-realtime-sessions", str(max(args.sessions)), *args.server_args.split()]
    log = open(args.server_log, "wb") if args.server_log else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT if args.server_log else subprocess.DEVNULL,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(proc, url, 600)
    return proc, url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running `v1 serve` (http://127.0.0.1:PORT)")
    where.add_argument("--model", help="start `v1 serve MODEL` on loopback for the run")
    parser.add_argument(
        "--server-args", default="--device cpu", help="extra `v1 serve` flags with --model"
    )
    parser.add_argument("--server-log", default=None, help="with --model: the server's output")
    parser.add_argument("--sessions", default="1,16,64", help="concurrency levels, comma-separated")
    parser.add_argument("--phrases", type=int, default=2, help="utterances per session")
    parser.add_argument("--gap", type=float, default=1.5, help="seconds of silence after each")
    parser.add_argument(
        "--silence-ms", type=int, default=500, help="server_vad silence_duration_ms"
    )
    parser.add_argument("--speed", type=float, default=1.0, help="audio seconds sent per second")
    parser.add_argument("--language", default="en")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--timeout", type=float, default=600, help="per level, after the audio")
    args = parser.parse_args()
    args.sessions = [int(n) for n in args.sessions.split(",")]
    proc = None
    url = args.url
    if args.model:
        proc, url = _start_server(args)
    ws_url = url.replace("http://", "ws://").rstrip("/") + "/v1/realtime?intent=transcription"
    try:
        print(
            "| sessions | phrases done | end->completed p50 / p99 (s) | end->first delta p50 / p99 (s) | start->first delta p50 (s) | errors |"
        )
        print("|---:|---:|---:|---:|---:|---:|")
        for n in args.sessions:
            row = asyncio.run(run_level(ws_url, args, n))
            print(
                f"| {n} | {row['completed']}/{row['phrases']} | {row['completed_p50']:.2f} / "
                f"{row['completed_p99']:.2f} | {row['first_delta_p50']:.2f} / {row['first_delta_p99']:.2f} | "
                f"{row['first_delta_from_start_p50']:.2f} | {row['num_errors']} |",
                flush=True,
            )
            if row["errors"]:
                print(f"  errors: {row['errors']}", file=sys.stderr)
            print(f"  sample transcript: {row['sample']!r}", file=sys.stderr)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
