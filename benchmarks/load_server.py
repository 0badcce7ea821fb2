"""Load and abuse of a running `v1 serve` on loopback: honest, cancelled and hostile requests at once.

Sends `--requests` (200) concurrent mixed requests to a generation server (completions and chat,
streamed and not), of which `--cancel` (100) are cancelled by the client part-way and
`--hostile` (10) are hostile (numbers past their tensors, lone surrogates, a 10 MB prompt,
JSON mode, oversized headers, a token-budget buster). Prints p50/p99 latency of the honest
requests that finished, errors by type, and the KV blocks still in use once the server settles
(0 is the only good answer). Loopback only, bounded in count and in time (`--time-limit`).

    v1 serve MODEL --port 8000 &                      # any generator; then
    python benchmarks/load_server.py --url http://127.0.0.1:8000
    python benchmarks/load_server.py --model DIR      # starts (and stops) a CPU server itself
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ipaddress
import random
import socket
import statistics
import subprocess
import sys
import time
from typing import Any
from urllib.parse import urlparse

import httpx
from _serve import wait_until_healthy

PROMPTS = ["The weather today is", "Once upon a time", "In a distant galaxy", "My favorite food"]


def hostile_requests() -> list[tuple[str, dict[str, Any]]]:
    """(kind, httpx request kwargs) of each hostile request; every one must get a 4xx."""
    body = {"prompt": "hi", "max_tokens": 4}
    return [
        ("top_k_2_63", {"json": {**body, "top_k": 2**63}}),
        ("top_k_2_64", {"json": {**body, "top_k": 2**64}}),
        ("repetition_penalty_1e300", {"json": {**body, "repetition_penalty": 1e300}}),
        ("lone_surrogate", {"content": b'{"prompt": "a\\ud800b"}'}),
        ("prompt_10mb", {"json": {"prompt": "x" * 10_000_000}}),
        ("min_tokens_2_40", {"json": {**body, "min_tokens": 2**40}}),
        ("stop_id_2_63", {"json": {**body, "stop_token_ids": [2**63]}}),
        ("token_budget", {"json": {"prompt": [[5] * 200] * 2048, "max_tokens": 1}}),
        ("big_header", {"json": body, "headers": {"X-Big": "a" * 200_000}}),
        (
            "json_mode",
            {
                "json": {
                    "messages": [{"role": "user", "content": "hi"}],
                    "response_format": {"type": "json_object"},
                },
                "chat": True,
            },
        ),
    ]


class Stats:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.errors: collections.Counter[str] = collections.Counter()
        self.outcomes: collections.Counter[str] = collections.Counter()


async def honest(client: httpx.AsyncClient, rng: random.Random, stats: Stats) -> None:
    chat = rng.random() < 0.5
    stream = rng.random() < 0.5
    max_tokens = rng.randint(4, 32)
    prompt = rng.choice(PROMPTS)
    if chat:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}
    else:
        path, body = "/v1/completions", {"prompt": prompt}
    body.update(max_tokens=max_tokens, stream=stream, temperature=0.7)
    start = time.perf_counter()
    try:
        if stream:
            async with client.stream("POST", path, json=body) as response:
                text = ""
                async for line in response.aiter_lines():
                    text += line
                ok = response.status_code == 200 and '"error"' not in text
                kind = "ok" if ok else f"stream_{response.status_code}"
        else:
            response = await client.post(path, json=body)
            kind = "ok" if response.status_code == 200 else f"http_{response.status_code}"
    except httpx.HTTPError as e:
        kind = type(e).__name__
    if kind == "ok":
        stats.latencies.append(time.perf_counter() - start)
    else:
        stats.errors[f"honest:{kind}"] += 1
    stats.outcomes[f"honest:{kind}"] += 1


async def cancelled(client: httpx.AsyncClient, rng: random.Random, stats: Stats) -> None:
    body = {"prompt": rng.choice(PROMPTS), "max_tokens": 200, "ignore_eos": True}
    body["stream"] = rng.random() < 0.5
    task = asyncio.ensure_future(client.post("/v1/completions", json=body))
    await asyncio.sleep(rng.uniform(0.01, 0.5))
    task.cancel()  # closes the connection: the server must abort the engine request
    try:
        await task
        stats.outcomes["cancel:finished_first"] += 1
    except asyncio.CancelledError:
        stats.outcomes["cancel:cancelled"] += 1
    except httpx.HTTPError as e:
        stats.errors[f"cancel:{type(e).__name__}"] += 1


async def hostile(
    client: httpx.AsyncClient, kind: str, kwargs: dict[str, Any], stats: Stats
) -> None:
    kwargs = dict(kwargs)
    path = "/v1/chat/completions" if kwargs.pop("chat", False) else "/v1/completions"
    try:
        response = await client.post(path, **kwargs)
        status = response.status_code
    except httpx.HTTPError as e:
        stats.errors[f"hostile:{kind}:{type(e).__name__}"] += 1
        return
    outcome = "rejected_4xx" if 400 <= status < 500 else f"UNEXPECTED_{status}"
    stats.outcomes[f"hostile:{outcome}"] += 1
    if not 400 <= status < 500:
        stats.errors[f"hostile:{kind}:{status}"] += 1


async def kv_blocks_in_use(client: httpx.AsyncClient, settle_s: float) -> tuple[float, float]:
    """(KV blocks used, requests running) once both reach 0, or at `settle_s`."""
    deadline = time.monotonic() + settle_s
    used = running = -1.0
    while time.monotonic() < deadline:
        text = (await client.get("/metrics")).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                samples[key.split("{")[0]] = samples.get(key.split("{")[0], 0.0) + float(value)
        used = samples.get("v1_kv_cache_used_blocks", -1.0)
        running = samples.get("v1_num_requests_running", -1.0)
        if used == 0 and running == 0:
            break
        await asyncio.sleep(0.2)
    return used, running


async def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    stats = Stats()
    limits = httpx.Limits(max_connections=args.requests + 50, max_keepalive_connections=50)
    timeout = httpx.Timeout(args.time_limit)
    async with httpx.AsyncClient(base_url=args.url, limits=limits, timeout=timeout) as client:
        assert (await client.get("/health")).status_code == 200, "the server is not healthy"
        hostiles = hostile_requests()[: args.hostile]
        num_honest = args.requests - args.cancel - len(hostiles)
        jobs = [honest(client, rng, stats) for _ in range(max(num_honest, 0))]
        jobs += [cancelled(client, rng, stats) for _ in range(args.cancel)]
        jobs += [hostile(client, kind, kw, stats) for kind, kw in hostiles]
        rng.shuffle(jobs)
        start = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.gather(*jobs), timeout=args.time_limit)
        except TimeoutError:
            stats.errors["run:time_limit"] += 1
        wall = time.perf_counter() - start
        used, running = await kv_blocks_in_use(client, settle_s=15)
        health = (await client.get("/health")).status_code
    report(stats, wall, used, running, health)
    ok = used == 0 and running == 0 and health == 200 and not stats.errors
    return 0 if ok else 1


def report(stats: Stats, wall: float, used: float, running: float, health: int) -> None:
    lat = sorted(stats.latencies)
    print(f"wall time: {wall:.1f} s")
    if lat:
        p99 = lat[min(len(lat) - 1, int(round(0.99 * (len(lat) - 1))))]
        print(
            f"honest requests finished: {len(lat)}; latency p50 {statistics.median(lat):.3f} s, "
            f"p99 {p99:.3f} s"
        )
    print("outcomes:")
    for key, count in sorted(stats.outcomes.items()):
        print(f"  {key}: {count}")
    print("errors by type:" + ("" if stats.errors else " none"))
    for key, count in sorted(stats.errors.items()):
        print(f"  {key}: {count}")
    print(f"KV blocks in use at the end: {used:g} (requests running: {running:g})")
    print(f"/health at the end: {health}")


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        loopback = False
    if not loopback:
        raise SystemExit(f"refusing to load {url}: only loopback servers (127.0.0.0/8, ::1)")


def start_server(model: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "v1.entrypoints.cli",
        "serve",
        model,
        "--port",
        str(port),
        "--device",
        "cpu",
        "--max-num-seqs",
        "32",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(proc, url, 300)
    return proc, url


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server on loopback, e.g. http://127.0.0.1:8000")
    where.add_argument("--model", help="start `v1 serve MODEL` on CPU for the run")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--cancel", type=int, default=100)
    parser.add_argument("--hostile", type=int, default=10)
    parser.add_argument("--time-limit", type=float, default=300.0, help="seconds for the run")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not 0 <= args.cancel + min(args.hostile, 10) <= args.requests <= 1000:
        parser.error("need 0 <= cancel + hostile <= requests <= 1000")
    proc = None
    if args.model:
        proc, args.url = start_server(args.model)
    check_loopback(args.url)
    try:
        return asyncio.run(run(args))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
