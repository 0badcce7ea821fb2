"""Server load on real speech: `v1 serve` (started here, 127.0.0.1) against N concurrent
multipart `/v1/audio/transcriptions` requests of real audio files, and the offline
`LLM.transcribe` on the same clips for the server/offline ratio.

Each request uploads a WAV file (16-bit PCM, written here) of a fresh variant of one of the
reference clips (`_real_speech`: LibriSpeech x 2 + JFK, shifted by a leading silence and scaled,
so no two requests share audio), with `language=en`, `temperature=0`. Reports requests/s, RTFx
(audio seconds / wall), p50/p99 latency, and the WER of the transcripts against the references.
`--offline-baseline` also times `LLM.transcribe` (same model, same engine arguments, its own
defaults otherwise) on the same clips, warm, and prints server RTFx / offline RTFx.

    python benchmarks/serve_load.py --model ../shared/assets/whisper-base --device cpu \
        --num-requests 6 --concurrency 3 --offline-baseline          # CPU smoke run
    python benchmarks/serve_load.py --model ../shared/assets/whisper-base \
        --num-requests 2048 --concurrency 512 --data-parallel-size 1 --offline-baseline
    python benchmarks/serve_load.py --model MODEL --data-parallel-size 2 -- --max-num-seqs 512
Arguments after `--` go to `v1 serve` as they are.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx
import numpy as np
from _real_speech import SAMPLE_RATE, InputSet, load_clips, make_inputs, wer
from _serve import wait_until_healthy


def wav_bytes(audio: np.ndarray) -> bytes:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, audio, SAMPLE_RATE, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def pcm16(audio: np.ndarray) -> np.ndarray:
    """The samples the server decodes from the WAV (what the offline side gets too)."""
    return (np.clip(audio, -1.0, 32767 / 32768) * 32768).astype(np.int16).astype(np.float32) / 32768


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "v1.entrypoints.cli", "serve", args.model]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--device", args.device]
    cmd += ["--data-parallel-size", str(args.data_parallel_size), *args.serve_args]
    print("server:", " ".join(cmd), flush=True)
    log = open(os.path.join(args.log_dir, "serve_load_server.log"), "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(proc, url, args.start_timeout, log.name)
    return proc, url


async def send_all(
    url: str, model: str, files: list[bytes], concurrency: int
) -> tuple[float, list[float], list[str], list[str]]:
    """Wall seconds, per-request latencies, transcripts (in input order), errors."""
    sem = asyncio.Semaphore(concurrency)
    texts = [""] * len(files)
    latencies: list[float] = []
    errors: list[str] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:

        async def one(i: int) -> None:
            async with sem:
                start = time.perf_counter()
                r = await client.post(
                    "/v1/audio/transcriptions",
                    files={"file": (f"clip{i}.wav", files[i], "audio/wav")},
                    data={"model": model, "language": "en", "temperature": "0"},
                )
                latencies.append(time.perf_counter() - start)
                if r.status_code != 200:
                    errors.append(f"{r.status_code}: {r.text[:200]}")
                    return
                texts[i] = r.json()["text"]

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(len(files))))
        wall = time.perf_counter() - start
    return wall, latencies, texts, errors


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def offline_rtfx(args: argparse.Namespace, sets: list[InputSet]) -> tuple[list[float], list[str]]:
    """LLM.transcribe on the same decoded samples: warm run on sets[0], timed on the rest."""
    from v1 import LLM

    kwargs = serve_engine_kwargs(args.serve_args)
    llm = LLM(
        args.model,
        device=args.device,
        data_parallel_size=args.data_parallel_size,
        **kwargs,
    )
    try:
        rtfx, texts = [], []
        for k, batch in enumerate(sets):
            audio = [(pcm16(a), SAMPLE_RATE) for a in batch.audio]
            start = time.perf_counter()
            outs = llm.transcribe(audio, language="en", temperature=0.0, use_tqdm=False)
            wall = time.perf_counter() - start
            if k:
                rtfx.append(batch.seconds / wall)
                texts = [o.text for o in outs]
        return rtfx, texts
    finally:
        llm.shutdown()


def serve_engine_kwargs(serve_args: list[str]) -> dict:
    """The engine arguments among the passed-through serve flags (for the offline side)."""
    from v1.entrypoints.cli import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    known, _ = parser.parse_known_args(serve_args)
    return engine_kwargs(known)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Whisper model folder (e.g. whisper-base)")
    p.add_argument("--device", default="cuda", help="cuda or cpu (passed to v1 serve)")
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight at once")
    p.add_argument("--num-requests", type=int, default=512, help="requests per timed round")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (median), after a warm one")
    p.add_argument("--offline-baseline", action="store_true", help="also time LLM.transcribe")
    p.add_argument("--audio-dir", default=None, help="the assets' audio folder")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", default=os.environ.get("OUT", "."), help="server log folder")
    p.add_argument("serve_args", nargs="*", help="after `--`: extra `v1 serve` arguments")
    args = p.parse_args()
    clips = load_clips(args.audio_dir)
    sets = [make_inputs(clips, args.num_requests, s) for s in range(args.rounds + 1)]
    files = [[wav_bytes(a) for a in s.audio] for s in sets]

    proc, url = start_server(args)
    rounds = []
    try:
        for k, (batch, payload) in enumerate(zip(sets, files, strict=True)):
            wall, lat, texts, errors = asyncio.run(
                send_all(url, args.model, payload, args.concurrency)
            )
            if errors:
                print(f"round {k}: {len(errors)} errors, first: {errors[0]}", flush=True)
                return 1
            label = "warm-up" if k == 0 else f"round {k}"
            print(
                f"{label}: {len(payload) / wall:,.2f} req/s, RTFx {batch.seconds / wall:,.1f}, "
                f"p50 {pct(lat, 0.5):.3f} s, p99 {pct(lat, 0.99):.3f} s, "
                f"WER {100 * wer(batch.references, texts):.2f}%",
                flush=True,
            )
            if k:
                rounds.append((wall, lat, texts, batch))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    walls = [r[0] for r in rounds]
    seconds = rounds[0][3].seconds
    all_lat = [x for r in rounds for x in r[1]]
    server_rtfx = statistics.median(seconds / w for w in walls)
    print(
        f"\nserver (dp {args.data_parallel_size}, concurrency {args.concurrency}, "
        f"{args.num_requests} requests of {seconds / args.num_requests:.1f} s average, "
        f"medians of {len(rounds)} rounds): {args.num_requests / statistics.median(walls):,.2f} "
        f"req/s, RTFx {server_rtfx:,.1f} [{seconds / max(walls):,.1f}-{seconds / min(walls):,.1f}]"
        f", latency p50 {pct(all_lat, 0.5):.3f} s, p99 {pct(all_lat, 0.99):.3f} s"
    )
    if args.offline_baseline:
        rtfx, texts = offline_rtfx(args, sets)
        offline = statistics.median(rtfx)
        last = rounds[-1]
        differ = sum(a.strip() != b.strip() for a, b in zip(texts, last[2], strict=True))
        print(
            f"offline LLM.transcribe on the same clips: RTFx {offline:,.1f} "
            f"[{min(rtfx):,.1f}-{max(rtfx):,.1f}], WER "
            f"{100 * wer(last[3].references, texts):.2f}%; server / offline = "
            f"{server_rtfx / offline:.2f}; transcripts that differ (last round): {differ} of "
            f"{len(texts)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
