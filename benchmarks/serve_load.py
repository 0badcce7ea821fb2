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
    python benchmarks/serve_load.py --random turbo --data-parallel-size 1,2 \
        --num-requests 1024 --concurrency 512 --rounds 2 -- --max-num-seqs 512 --max-model-len 104
    python benchmarks/serve_load.py --random tiny --device cpu --data-parallel-size 1,2 \
        --num-requests 8 --concurrency 4 --rounds 1 -- --max-model-len 12   # CPU smoke run
`--no-fallback` (the default with `--random`) sends thresholds no window fails
(compression_ratio_threshold 1e6, log_prob_threshold -1e6) on both sides: one greedy pass per
window, as transformers' generate runs (random weights fail every quality check, so the
fallback would decode each window at all six temperatures). Arguments after `--` go to
`v1 serve` as they are. `--null-server` sends the same load to a server that only takes the
upload (`_null_server.py`): what the load client and one Python HTTP server carry without an
engine; `--client-procs N` splits the client over N processes.

    python benchmarks/serve_load.py --null-server --num-requests 256 --concurrency 256 \
        --rounds 3 --client-procs 1     # then 2, 4, 8 `--random turbo|tiny` serves random weights of
whisper-large-v3-turbo's shapes (or a tiny Whisper) with whisper-base's tokenizer (their WER means
nothing; `--max-model-len` bounds their decoding). A comma list of data-parallel sizes runs one
server per size, one after the other, and ends with a table.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import _trace
import httpx
import numpy as np
from _real_speech import SAMPLE_RATE, InputSet, load_clips, make_inputs, wer
from _serve import wait_until_healthy
from _spy import start_spy, summarize


def wav_bytes(audio: np.ndarray) -> bytes:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, audio, SAMPLE_RATE, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def pcm16(audio: np.ndarray) -> np.ndarray:
    """The samples the server decodes from the WAV (what the offline side gets too)."""
    return (np.clip(audio, -1.0, 32767 / 32768) * 32768).astype(np.int16).astype(np.float32) / 32768


def build_random_model(kind: str, device: str, root: str) -> str:
    """Random weights of turbo's shapes (or tiny) with whisper-base's tokenizer, in `root`."""
    from _context import asset
    from dp_scaling import build_turbo

    ns = argparse.Namespace(tiny=kind == "tiny", device=device, tokenizer=asset("whisper-base"))
    return build_turbo(ns, root)


def start_server(args: argparse.Namespace, dp: int) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "v1.entrypoints.cli", "serve", args.model]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--device", args.device]
    cmd += ["--data-parallel-size", str(dp), *args.serve_args]
    if args.null_server:
        cmd = [sys.executable, "-m", "uvicorn", "_null_server:app", "--port", str(port)]
        cmd += ["--host", "127.0.0.1", "--loop", "uvloop", "--http", "httptools"]
        cmd += ["--app-dir", os.path.dirname(os.path.abspath(__file__)), "--log-level", "warning"]
    elif "--max-connections-per-client" not in args.serve_args:
        # The load comes from one address: the server's per-client cap (64 by default, against
        # slow clients) would close the connections past it with a 429.
        cmd += ["--max-connections-per-client", str(max(64, args.concurrency))]
    if not args.null_server and "--max-connections" not in args.serve_args:
        cmd += ["--max-connections", str(max(1000, args.concurrency))]
    print("server:", " ".join(cmd), flush=True)
    log = open(os.path.join(args.log_dir, f"serve_load_server_dp{dp}.log"), "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(proc, url, args.start_timeout, log.name)
    return proc, url


client_cpu: list[float] = []
"""The load client's CPU time over the wall time of each round (1.0 = one core busy)."""
round_start: list[float] = []
"""`time.perf_counter()` when each round's requests started (after the client processes are
up): where a step trace's round begins."""


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far, all its threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


NO_FALLBACK = {"compression_ratio_threshold": 1e6, "log_prob_threshold": -1e6}
"""Thresholds no window fails: one greedy pass per window (`--no-fallback`)."""


async def send_all(
    url: str, model: str, files: list[bytes], concurrency: int, extra: dict[str, float]
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
                    data={
                        "model": model,
                        "language": "en",
                        "temperature": "0",
                        **{k: str(v) for k, v in extra.items()},
                    },
                )
                latencies.append(time.perf_counter() - start)
                if r.status_code != 200:
                    errors.append(f"{r.status_code}: {r.text[:200]}")
                    return
                texts[i] = r.json()["text"]

        start, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(one(i) for i in range(len(files))))
        wall = time.perf_counter() - start
        # The load client is one Python process: a busy one limits the load it can make.
        client_cpu.append((time.process_time() - cpu) / wall)
    return wall, latencies, texts, errors


def send_from_processes(
    args: argparse.Namespace, url: str, payload: list[bytes], root: str
) -> tuple[float, list[float], list[str], list[str]]:
    """`send_all` split over --client-procs processes (request i goes to process i mod N, each
    with concurrency / N in flight): one Python client can spend most of a round encoding
    multipart bodies. The processes load their files, then start together on a line on stdin;
    the wall runs from the earliest start to the latest end. Results come back as JSON."""
    n = args.client_procs
    folder = tempfile.mkdtemp(prefix="load-", dir=root)
    for i, data in enumerate(payload):
        with open(os.path.join(folder, f"{i}.wav"), "wb") as f:
            f.write(data)
    extra = NO_FALLBACK if args.no_fallback else {}
    procs = []
    for w in range(n):
        job = dict(url=url, model=args.model, folder=folder, worker=w, workers=n, extra=extra)
        job.update(num=len(payload), concurrency=max(1, args.concurrency // n))
        cmd = [sys.executable, os.path.abspath(__file__), "--client-worker", json.dumps(job)]
        procs.append(
            subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        )
    for proc in procs:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("a load client process did not start")
    round_start.append(time.perf_counter())
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    results = [json.loads(proc.communicate(timeout=3600)[0]) for proc in procs]
    shutil.rmtree(folder, ignore_errors=True)
    texts = [""] * len(payload)
    latencies: list[float] = []
    errors: list[str] = []
    for r in results:
        latencies += r["latencies"]
        errors += r["errors"]
        for i, text in r["texts"].items():
            texts[int(i)] = text
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    client_cpu.append(sum(r["cpu"] for r in results) / wall)
    return wall, latencies, texts, errors


def client_worker(spec: str) -> int:
    """One load client process (`send_from_processes`)."""
    job = json.loads(spec)
    mine = list(range(job["worker"], job["num"], job["workers"]))
    files = []
    for i in mine:
        with open(os.path.join(job["folder"], f"{i}.wav"), "rb") as f:
            files.append(f.read())
    print("ready", flush=True)
    sys.stdin.readline()
    start, cpu = time.time(), time.process_time()
    wall, latencies, texts, errors = asyncio.run(
        send_all(job["url"], job["model"], files, job["concurrency"], job["extra"])
    )
    result = dict(
        start=start,
        end=start + wall,
        cpu=time.process_time() - cpu,
        latencies=latencies,
        errors=errors,
        texts={str(i): t for i, t in zip(mine, texts, strict=True)},
    )
    print(json.dumps(result), flush=True)
    return 0


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def offline_rtfx(
    args: argparse.Namespace, sets: list[InputSet], dp: int
) -> tuple[list[float], list[str]]:
    """LLM.transcribe on the same decoded samples: warm run on sets[0], timed on the rest."""
    from v1 import LLM

    kwargs = serve_engine_kwargs(args.serve_args)
    traced = _trace.files(args.trace) if args.trace else set()
    llm = LLM(
        args.model,
        device=args.device,
        data_parallel_size=dp,
        **kwargs,
    )
    traced = _trace.files(args.trace) - traced if args.trace else set()
    try:
        rtfx, texts, spans = [], [], []
        for k, batch in enumerate(sets):
            audio = [(pcm16(a), SAMPLE_RATE) for a in batch.audio]
            start = time.perf_counter()
            # The server's `temperature=0` is OpenAI's: start at 0 and fall back hotter on a
            # failed window (TranscriptionOptions' default); the same work here.
            outs = llm.transcribe(audio, language="en", use_tqdm=False, **fallback_options(args))
            wall = time.perf_counter() - start
            if k:
                rtfx.append(batch.seconds / wall)
                texts = [o.text for o in outs]
                spans.append((start, start + wall))
        return rtfx, texts
    finally:
        llm.shutdown()
        for name in sorted(traced):
            print(f"\n# step trace of the offline core ({name}), the timed runs", flush=True)
            print(_trace.summarize(os.path.join(args.trace, name), spans), flush=True)


def fallback_options(args: argparse.Namespace) -> dict[str, float]:
    """The transcribe options of --no-fallback (the form field log_prob_threshold is the
    option logprob_threshold), or none."""
    if not args.no_fallback:
        return {}
    return {
        "compression_ratio_threshold": NO_FALLBACK["compression_ratio_threshold"],
        "logprob_threshold": NO_FALLBACK["log_prob_threshold"],
    }


def serve_engine_kwargs(serve_args: list[str]) -> dict:
    """The engine arguments among the passed-through serve flags (for the offline side)."""
    from v1.entrypoints.cli import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    known, _ = parser.parse_known_args(serve_args)
    return engine_kwargs(known)


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--client-worker":
        return client_worker(sys.argv[2])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a Whisper model folder (e.g. whisper-base)")
    p.add_argument("--random", choices=("turbo", "tiny"), default=None, help="random weights")
    p.add_argument("--device", default="cuda", help="cuda or cpu (passed to v1 serve)")
    p.add_argument("--data-parallel-size", default="1", help="N, or a comma list (1,2,4)")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight at once")
    p.add_argument("--num-requests", type=int, default=512, help="requests per timed round")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (median), after a warm one")
    p.add_argument("--offline-baseline", action="store_true", help="also time LLM.transcribe")
    p.add_argument(
        "--no-fallback",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one greedy pass per window on both sides (default: on with --random)",
    )
    p.add_argument("--audio-dir", default=None, help="the assets' audio folder")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument(
        "--py-spy", default=None, help="folder: py-spy samples the server during the timed rounds"
    )
    p.add_argument(
        "--trace",
        default=None,
        help="folder: the server's and the offline baseline's cores write step traces, "
        "summarized per timed round",
    )
    p.add_argument("--log-dir", default=os.environ.get("OUT", "."), help="server log folder")
    p.add_argument(
        "--null-server",
        action="store_true",
        help="send the load to a server that only takes the upload (no engine: the client's "
        "and the HTTP path's own limit)",
    )
    p.add_argument(
        "--client-procs",
        type=int,
        default=None,
        help="load client processes (the concurrency split among them; default: half the "
        "host's CPUs up to 8 at a concurrency of 32 or more, else 1: one Python client "
        "carries only ~600 RTFx of uploads)",
    )
    p.add_argument("serve_args", nargs="*", help="after `--`: extra `v1 serve` arguments")
    args = p.parse_args()
    if args.client_procs is None:
        cpus = os.cpu_count() or 2
        args.client_procs = min(8, max(1, cpus // 2)) if args.concurrency >= 32 else 1
    if args.null_server:
        args.model = args.model or "null"
        args.offline_baseline = False
    elif (args.model is None) == (args.random is None):
        p.error("give --model or --random")
    if args.no_fallback is None:
        args.no_fallback = args.random is not None
    dps = [int(n) for n in args.data_parallel_size.split(",")]
    if args.trace:
        _trace.enable(args.trace)
    clips = load_clips(args.audio_dir)
    sets = [make_inputs(clips, args.num_requests, s) for s in range(args.rounds + 1)]
    files = [[wav_bytes(a) for a in s.audio] for s in sets]
    summaries = []
    with tempfile.TemporaryDirectory(prefix="v1serve-") as root:
        args.root = root
        if args.random is not None:
            args.model = build_random_model(args.random, args.device, root)
        for dp in dps:
            summary = run_one(args, dp, sets, files)
            if summary is None:
                return 1
            summaries.append(summary)
    print(f"\nCommand: python3 benchmarks/serve_load.py {shlex.join(sys.argv[1:])}")
    print(f"Load client processes: {args.client_procs}")
    print("| N | req/s median | RTFx median [min-max] | vs N=1 | p50 s | p99 s |")
    print("| ---: | ---: | --- | ---: | ---: | ---: |")
    base = next((s for s in summaries if s["dp"] == 1), None)
    for s in summaries:
        ratio = f"{s['req_s'] / base['req_s']:.2f}x" if base else "-"
        print(
            f"| {s['dp']} | {s['req_s']:,.2f} | {s['rtfx']:,.1f} [{s['rtfx_min']:,.1f}-"
            f"{s['rtfx_max']:,.1f}] | {ratio} | {s['p50']:.3f} | {s['p99']:.3f} |"
        )
    return 0


def run_one(
    args: argparse.Namespace, dp: int, sets: list[InputSet], files: list[list[bytes]]
) -> dict | None:
    """One server of `dp` cores under the load: its summary (None after request errors)."""
    traced = _trace.files(args.trace) if args.trace else set()
    proc, url = start_server(args, dp)
    traced = _trace.files(args.trace) - traced if args.trace else set()
    rounds = []
    spans: list[tuple[float, float]] = []
    spy = None
    try:
        for k, (batch, payload) in enumerate(zip(sets, files, strict=True)):
            if k == 1 and args.py_spy:
                spy = start_spy(proc.pid, os.path.join(args.py_spy, f"server_dp{dp}.txt"))
            round_start.append(time.perf_counter())  # one process: the round starts now
            server_cpu = process_cpu_seconds(proc.pid)
            if args.client_procs > 1:
                wall, lat, texts, errors = send_from_processes(args, url, payload, args.root)
            else:
                wall, lat, texts, errors = asyncio.run(
                    send_all(
                        url,
                        args.model,
                        payload,
                        args.concurrency,
                        NO_FALLBACK if args.no_fallback else {},
                    )
                )
            if errors:
                print(f"round {k}: {len(errors)} errors, first: {errors[0]}", flush=True)
                return None
            server_cpu = process_cpu_seconds(proc.pid) - server_cpu
            label = "warm-up" if k == 0 else f"round {k}"
            print(
                f"dp {dp} {label}: {len(payload) / wall:,.2f} req/s, RTFx "
                f"{batch.seconds / wall:,.1f}, p50 {pct(lat, 0.5):.3f} s, p99 "
                f"{pct(lat, 0.99):.3f} s, WER {100 * wer(batch.references, texts):.2f}%, load "
                f"client CPU {100 * client_cpu[-1]:.0f}% of the wall, server API process CPU "
                f"{1e3 * server_cpu / len(payload):.2f} ms a request",
                flush=True,
            )
            if k:
                rounds.append((wall, lat, texts, batch))
                spans.append((round_start[-1], time.perf_counter()))
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes what it sampled
            spy.communicate(timeout=60)  # its stderr is a pipe: drain it
            print(summarize(os.path.join(args.py_spy, f"server_dp{dp}.txt"), 30), flush=True)
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    walls = [r[0] for r in rounds]
    seconds = rounds[0][3].seconds
    all_lat = [x for r in rounds for x in r[1]]
    server_rtfx = statistics.median(seconds / w for w in walls)
    summary = dict(
        dp=dp,
        req_s=args.num_requests / statistics.median(walls),
        rtfx=server_rtfx,
        rtfx_min=seconds / max(walls),
        rtfx_max=seconds / min(walls),
        p50=pct(all_lat, 0.5),
        p99=pct(all_lat, 0.99),
    )
    print(
        f"\nserver (dp {dp}, concurrency {args.concurrency}, "
        f"{args.num_requests} requests of {seconds / args.num_requests:.1f} s average, "
        f"medians of {len(rounds)} rounds): {summary['req_s']:,.2f} "
        f"req/s, RTFx {server_rtfx:,.1f} [{seconds / max(walls):,.1f}-{seconds / min(walls):,.1f}]"
        f", latency p50 {summary['p50']:.3f} s, p99 {summary['p99']:.3f} s",
        flush=True,
    )
    for name in sorted(traced):
        print(f"\n# step trace of the server's core ({name}), the timed rounds", flush=True)
        print(_trace.summarize(os.path.join(args.trace, name), spans), flush=True)
    if args.offline_baseline:
        rtfx, texts = offline_rtfx(args, sets, dp)
        offline = statistics.median(rtfx)
        last = rounds[-1]
        differ = sum(a.strip() != b.strip() for a, b in zip(texts, last[2], strict=True))
        print(
            f"offline LLM.transcribe on the same clips: RTFx {offline:,.1f} "
            f"[{min(rtfx):,.1f}-{max(rtfx):,.1f}], WER "
            f"{100 * wer(last[3].references, texts):.2f}%; server / offline = "
            f"{server_rtfx / offline:.2f}; transcripts that differ (last round): {differ} of "
            f"{len(texts)}",
            flush=True,
        )
    return summary


if __name__ == "__main__":
    sys.exit(main())
