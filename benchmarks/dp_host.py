"""The host side of data parallelism (issue 34), without a model or a GPU: `LLM.transcribe` over
N EngineCore processes whose executor is a simulated GPU (`SimulatedGpu`). Everything on the
host is the engine's own: the frontend (audio checks, hashing, plans, requests, DP routing,
msgspec + ZMQ, output processing) and each core process (decode, scheduler, burst bookkeeping);
only the forward passes are replaced by a device queue that is busy `--encoder-ms` per encoder
input and `--decode-ms` per decode step (one step of a burst), and samples forced text tokens.

With an infinitely fast host the RTFx of N cores would be N x that of one; what is missing is
what the host costs. Per row: RTFx, the ratio to N = 1, the ideal (the simulated device time
alone), and the frontend's CPU per clip (whole process, and its calling thread).

    python benchmarks/dp_host.py                          # N = 1, 2, 4; 512 clips per core
    python benchmarks/dp_host.py --dp 1,2 --clips-per-core 128 --profile /tmp/dp2.prof

Runs on any host (no GPU needed): run it on the GPU machine's CPUs to see the host share there.
The default costs are assumed (not measured), near turbo fp8 on an H200: 1.9 ms of encoder per
clip and 11 ms per decode step whatever the batch (512 clips x 100 tokens in ~2.1 s of device
time: ~7,400 RTFx per device). `--hash engine,frontend` times each engine twice: as built (N > 1:
the cores hash the audio) and with the frontend hashing every clip (the code before issue 34).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _context import asset, copy_tokenizer  # noqa: E402

from v1.core.executor import Executor  # noqa: E402
from v1.core.sched_output import ModelRunnerOutput, SchedulerOutput  # noqa: E402
from v1.kv_cache.spec import CrossAttentionSpec, FullAttentionSpec, KVCacheSpec  # noqa: E402

SAMPLE_RATE = 16000
CLIP_SECONDS = 30.0
"""A clip's length unless --clip-seconds says otherwise (set from it in main)."""
SIM_ENV = "DP_HOST_SIMULATION"
"""The simulated device's costs, JSON, for the core processes (set by this script only)."""
TEXT_TOKENS = np.arange(400, 2400)
"""Tokens the simulated device samples: plain text ids of Whisper's vocabulary."""


# ---------------------------------------------------------------- the simulated device
class _DeviceQueue:
    """A device stream: work is queued back to back; `launch` returns when it would finish."""

    def __init__(self) -> None:
        self.free_at = 0.0
        self.busy_s = 0.0

    def launch(self, seconds: float) -> float:
        start = max(time.perf_counter(), self.free_at)
        self.free_at = start + seconds
        self.busy_s += seconds
        return self.free_at


class _Deferred:
    def __init__(self, output: ModelRunnerOutput, done_at: float) -> None:
        self.output, self.done_at = output, done_at

    def get_output(self) -> ModelRunnerOutput:
        wait = self.done_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return self.output


class SimulatedGpu(Executor):
    """An executor that samples forced text tokens (greedy-like: the same per request and
    position) on a simulated device queue. Its costs come from the `DP_HOST_SIMULATION`
    environment variable (JSON: encoder_ms, decode_ms, and the runner's host work on the
    core's thread: host_ms_per_input per encoder input, host_ms_per_step per launched step)."""

    def __init__(self, config: Any) -> None:
        self.config = config
        sim = json.loads(os.environ.get(SIM_ENV, "{}"))
        self.encoder_s = sim.get("encoder_ms", 1.9) / 1e3
        self.decode_s = sim.get("decode_ms", 11.0) / 1e3
        self.host_per_input_s = sim.get("host_ms_per_input", 0.0) / 1e3
        self.host_per_step_s = sim.get("host_ms_per_step", 0.0) / 1e3
        self.device = _DeviceQueue()
        self.num_tokens: dict[str, int] = {}
        self.computed: dict[str, int] = {}
        self.logprobs: set[str] = set()
        self.salt: dict[str, int] = {}

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        bs = self.config.cache_config.block_size
        return {
            "layers.0.self_attn": FullAttentionSpec(bs, 1, 8, "float32"),
            "layers.0.cross_attn": CrossAttentionSpec(bs, 1, 8, "float32"),
        }

    def determine_available_kv_bytes(self) -> int:
        return 4 << 30

    def initialize_kv_cache(self, kv_cache_config: Any) -> None:
        self.kv_cache_config = kv_cache_config

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(so).get_output()

    def execute_model_async(self, so: SchedulerOutput) -> _Deferred:
        for req_id in so.finished_req_ids:
            for table in (self.num_tokens, self.computed, self.salt):
                table.pop(req_id, None)
            self.logprobs.discard(req_id)
        for new in so.scheduled_new_reqs:
            self.num_tokens[new.req_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
            self.salt[new.req_id] = zlib.crc32(new.req_id.encode())
            if new.sampling_params is not None and new.sampling_params.logprobs is not None:
                self.logprobs.add(new.req_id)
        steps = so.num_decode_steps
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        lp_ids: list[Any] = []
        lps: list[Any] = []
        ranks: list[Any] = []
        for req_id in req_ids:
            self.computed[req_id] += so.num_scheduled_tokens[req_id]
            tokens: list[int] = []
            if self.computed[req_id] >= self.num_tokens[req_id]:
                n = self.num_tokens[req_id]
                salt = self.salt[req_id]
                tokens = [int(TEXT_TOKENS[(salt + n + k) % len(TEXT_TOKENS)]) for k in range(steps)]
                self.num_tokens[req_id] += steps
                self.computed[req_id] += steps - 1
            sampled.append(tokens)
            if req_id in self.logprobs and tokens:
                lp_ids.append([[t] for t in tokens])
                lps.append([[-0.25] for _ in tokens])
                ranks.append([1 for _ in tokens])
            else:
                lp_ids.append(None)
                lps.append(None)
                ranks.append(None)
        host = self.host_per_step_s + self.host_per_input_s * len(so.encoder_hashes_to_run)
        busy_until = time.perf_counter() + host
        while time.perf_counter() < busy_until:  # the runner's launches hold the core's thread
            pass
        cost = self.encoder_s * len(so.encoder_hashes_to_run) + self.decode_s * steps
        output = ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=sampled,
            logprob_token_ids=lp_ids,
            logprobs=lps,
            logprob_ranks=ranks,
            num_encoder_runs=len(so.encoder_hashes_to_run),
        )
        return _Deferred(output, self.device.launch(cost))


# ---------------------------------------------------------------- the frontend
@dataclass
class Row:
    dp: int
    clips: int
    hash: str
    seconds: list[float] = field(default_factory=list)
    process_cpu: list[float] = field(default_factory=list)
    thread_cpu: list[float] = field(default_factory=list)
    ideal_s: float = 0.0

    def rtfx(self) -> float:
        return CLIP_SECONDS * self.clips / statistics.median(self.seconds)


def build_model_dir(root: str, tokenizer: str) -> str:
    """A tiny random Whisper saved with whisper-base's tokenizer (the core processes never load
    it: the simulated executor has no weights)."""
    import torch
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
    )

    cfg = WhisperConfig(
        d_model=64,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        num_mel_bins=128,
        vocab_size=51866,
        max_source_positions=1500,
        max_target_positions=448,
        decoder_start_token_id=50258,
        pad_token_id=50257,
        bos_token_id=50257,
        eos_token_id=50257,
    )
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(cfg).eval()
    model.generation_config = GenerationConfig.from_pretrained(tokenizer)
    path = os.path.join(root, "whisper")
    model.save_pretrained(path)
    copy_tokenizer(tokenizer, path)
    WhisperFeatureExtractor(feature_size=128).save_pretrained(path)
    return path


def make_llm(path: str, dp: int, args: argparse.Namespace) -> Any:
    import v1.engine.core_client as core_client_module
    from v1 import LLM

    real = core_client_module.make_engine_core_client
    # The core processes import this file as `dp_host` (its folder is on their path).
    patched = functools.partial(real, executor_factory="dp_host:SimulatedGpu")
    core_client_module.make_engine_core_client = patched
    try:
        kwargs: dict[str, Any] = dict(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=8192,
            max_num_encoder_input_tokens=1500 * 32,
            num_scheduler_steps=args.num_scheduler_steps,
            async_scheduling=args.pipelined,
            device="cpu",
            multiprocess=True,
        )
        if dp > 1:
            kwargs["data_parallel_size"] = dp
        return LLM(path, **kwargs)
    finally:
        core_client_module.make_engine_core_client = real


def transcribe(llm: Any, clips: np.ndarray, tokens: int) -> list[Any]:
    from v1 import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    return llm.transcribe(
        [(c, SAMPLE_RATE) for c in clips],
        language="en",
        sampling_params=params,
        temperature=0.0,
        use_tqdm=False,
    )


def ideal_seconds(clips: int, dp: int, tokens: int, args: argparse.Namespace) -> float:
    """Device time of one core's share (encoder runs + decode steps at full batches)."""
    per_core = -(-clips // dp)
    waves = -(-per_core // args.max_num_seqs)
    return (per_core * args.encoder_ms + waves * tokens * args.decode_ms) / 1e3


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds of this process's threads so far, summed by thread name (Linux /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    python_names = {t.native_id: t.name for t in threading.enumerate()}
    totals: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return totals
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        name = python_names.get(int(tid), name if name.startswith("ZMQ") else "native")
        name = "".join(c for c in name if not c.isdigit()).rstrip("/-_:() ") or "?"
        totals[name] = totals.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return totals


def run_dp(path: str, dp: int, args: argparse.Namespace, base: np.ndarray) -> list[Row]:
    """One engine of `dp` cores, timed under each --hash setting: "engine" (as built: with
    N > 1 the cores hash the audio), "frontend" (the frontend hashes every clip, as before)
    and "core" (the cores hash, whatever N)."""
    clips = args.clips_per_core * dp
    rows = []
    llm = make_llm(path, dp, args)
    builder = llm.llm_engine.input_processor.builder
    if args.core_lead is not None:
        llm.transcriber.core_lead = args.core_lead
    built = builder.audio_hash_in_core
    try:
        outs = transcribe(llm, base[:clips] * np.float32(0.5), args.tokens)  # warm-up
        assert len(outs) == clips and all(o.text for o in outs)
        for k, mode in enumerate(args.hash.split(",")):
            builder.audio_hash_in_core = mode == "core" or (built and mode == "engine")
            row = Row(dp, clips, mode, ideal_s=ideal_seconds(clips, dp, args.tokens, args))
            rows.append(row)
            for r in range(args.repeats):
                scale = 1.0 + 0.001 * (k * args.repeats + r + 1)  # fresh hashes every run
                time_run(llm, base[:clips] * np.float32(scale), row, args, f"{mode} run {r + 1}")
        builder.audio_hash_in_core = built
        if args.profile and dp == max(int(n) for n in args.dp.split(",")):
            import cProfile
            import pstats

            prof = cProfile.Profile()
            batch = base[:clips] * np.float32(0.9)
            prof.runcall(transcribe, llm, batch, args.tokens)
            prof.dump_stats(args.profile)
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    finally:
        llm.shutdown()
    return rows


def time_run(llm: Any, batch: np.ndarray, row: Row, args: argparse.Namespace, label: str) -> None:
    clips = row.clips
    threads0 = thread_cpu_seconds()
    t0, p0, c0 = time.perf_counter(), time.process_time(), time.thread_time()
    outs = transcribe(llm, batch, args.tokens)
    wall = time.perf_counter() - t0
    threads1 = thread_cpu_seconds()
    row.seconds.append(wall)
    row.process_cpu.append(time.process_time() - p0)
    row.thread_cpu.append(time.thread_time() - c0)
    assert len(outs) == clips
    by_thread = {k: v - threads0.get(k, 0.0) for k, v in threads1.items()}
    print(
        f"  N={row.dp} {label}: {wall:.3f} s, {CLIP_SECONDS * clips / wall:,.0f} RTFx, "
        f"frontend CPU {row.process_cpu[-1] / clips * 1e6:,.0f} µs/clip (calling thread "
        f"{row.thread_cpu[-1] / clips * 1e6:,.0f}; by thread: "
        + ", ".join(
            f"{k} {v / clips * 1e6:,.0f}"
            for k, v in sorted(by_thread.items(), key=lambda kv: -kv[1])
            if v > 0
        )
        + ")",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dp", default="1,2,4")
    p.add_argument("--clips-per-core", type=int, default=512)
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--num-scheduler-steps", type=int, default=8)
    p.add_argument("--encoder-ms", type=float, default=1.9, help="device ms per encoder input")
    p.add_argument("--decode-ms", type=float, default=11.0, help="device ms per decode step")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--runner-host-ms-per-input",
        type=float,
        default=0.0,
        help="host ms the runner spends on the core's thread per encoder input (launches)",
    )
    p.add_argument(
        "--runner-host-ms-per-step", type=float, default=0.0, help="... and per launched step"
    )
    p.add_argument("--core-lead", type=int, default=None, help="Transcriber.core_lead")
    p.add_argument(
        "--pipelined",
        action="store_true",
        help="pipelined steps, as a core on a GPU runs (default: a CPU core's one step at a time)",
    )
    p.add_argument(
        "--clip-seconds", type=float, default=30.0, help="audio a clip (real speech: ~7)"
    )
    p.add_argument("--tokenizer", default=asset("whisper-base"))
    p.add_argument("--hash", default="engine", help="engine,frontend,core (list): who hashes audio")
    p.add_argument("--profile", default=None, help="cProfile the largest N's extra run to here")
    args = p.parse_args(argv)
    global CLIP_SECONDS
    CLIP_SECONDS = args.clip_seconds
    os.environ[SIM_ENV] = json.dumps(
        {
            "encoder_ms": args.encoder_ms,
            "decode_ms": args.decode_ms,
            "host_ms_per_input": args.runner_host_ms_per_input,
            "host_ms_per_step": args.runner_host_ms_per_step,
        }
    )
    dps = [int(n) for n in args.dp.split(",")]
    rng = np.random.default_rng(0)
    base = rng.standard_normal(
        (args.clips_per_core * max(dps), int(SAMPLE_RATE * CLIP_SECONDS)), dtype=np.float32
    )
    base *= np.float32(0.1)
    print(
        f"{os.cpu_count()} CPUs; {args.clips_per_core} clips of {CLIP_SECONDS:g} s per core x {args.tokens} "
        f"tokens; simulated device: {args.encoder_ms} ms per encoder input, {args.decode_ms} ms "
        f"per decode step; max_num_seqs {args.max_num_seqs}, bursts of "
        f"{args.num_scheduler_steps}; threads in this process: {threading.active_count()}",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="v1dphost-") as root:
        path = build_model_dir(root, args.tokenizer)
        for dp in dps:
            rows += run_dp(path, dp, args, base)
    print(
        "\n| N | hash | clips | RTFx median [min-max] | vs N=1 | device-only RTFx | of "
        "device-only | frontend CPU µs/clip (process / calling thread) |"
    )
    print("| ---: | --- | ---: | --- | ---: | ---: | ---: | ---: |")
    ones = {r.hash: r.rtfx() for r in rows if r.dp == 1}
    for r in rows:
        base_rtfx = ones.get(r.hash)
        work = CLIP_SECONDS * r.clips
        ideal = work / r.ideal_s
        ratio = f"{r.rtfx() / base_rtfx:.2f}x" if base_rtfx else "-"
        cpu = statistics.median(r.process_cpu) / r.clips * 1e6
        thread = statistics.median(r.thread_cpu) / r.clips * 1e6
        print(
            f"| {r.dp} | {r.hash} | {r.clips} | {r.rtfx():,.0f} [{work / max(r.seconds):,.0f}-"
            f"{work / min(r.seconds):,.0f}] | {ratio} | {ideal:,.0f} | "
            f"{r.rtfx() / ideal:.0%} | {cpu:,.0f} / {thread:,.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
