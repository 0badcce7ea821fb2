"""Host time of the scheduler on a decode-heavy batch: CPU only, no model.

Builds a real `Scheduler` (real KVCacheManager) for a tiny Llama (or, with --encoder-decoder, a
Whisper-turbo-shaped encoder-decoder: 1500 encoder positions in cross-attention blocks), adds N
requests (4-token prompts, greedy, logprobs=0, ignore_eos) and drives schedule() ->
fake runner output -> update_from_output() pipelined like EngineCore._step_pipelined (two steps
in flight). Prints median / p90 microseconds per call of schedule and update_from_output over the
steady decode steps (every request scheduled with one token), and per request; and the
schedule() time of the steps that admit new requests, per admitted request.

    python benchmarks/host_step.py --num-requests 256 [--encoder-decoder] [--profile]

Imports the `v1` package of the checkout this file is in (not an installed one).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's v1

from transformers import LlamaConfig, WhisperConfig

from v1.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from v1.core.protocol import EncoderInput
from v1.core.request import Request
from v1.core.sched_output import ModelRunnerOutput, SchedulerOutput
from v1.core.scheduler import Scheduler
from v1.kv_cache.sizing import get_kv_cache_config
from v1.kv_cache.spec import CrossAttentionSpec, FullAttentionSpec, KVCacheSpec
from v1.sampling_params import SamplingParams

PROMPT_LEN = 4
EOS = 2
WHISPER_ENCODER_LEN = 1500


def make_scheduler(args: argparse.Namespace) -> Scheduler:
    if args.encoder_decoder:
        hf_config = WhisperConfig(
            vocab_size=51866,
            d_model=64,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            max_source_positions=WHISPER_ENCODER_LEN,
            max_target_positions=448,
            architectures=["WhisperForConditionalGeneration"],
        )
    else:
        hf_config = LlamaConfig(
            vocab_size=32000,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=32,
            max_position_embeddings=2048,
            architectures=["LlamaForCausalLM"],
        )
    bs = args.block_size
    blocks_per_req = -(-(PROMPT_LEN + args.max_tokens + 1) // bs)
    if args.encoder_decoder:
        blocks_per_req += -(-WHISPER_ENCODER_LEN // bs)
    num_blocks = args.num_requests * blocks_per_req + 16
    config = EngineConfig(
        model_config=ModelConfig(model="fake", hf_config=hf_config),
        cache_config=CacheConfig(
            block_size=bs, num_kv_blocks=num_blocks, enable_prefix_caching=True
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=args.num_requests, max_num_batched_tokens=max(8192, args.num_requests)
        ),
    )
    specs: dict[str, KVCacheSpec] = {"layers.0.self_attn": FullAttentionSpec(bs, 1, 8, "float32")}
    if args.encoder_decoder:
        specs["layers.0.cross_attn"] = CrossAttentionSpec(bs, 1, 8, "float32")
    return Scheduler(config, get_kv_cache_config(specs, num_blocks=num_blocks))


def make_request(i: int, args: argparse.Namespace) -> Request:
    encoder_input = None
    if args.encoder_decoder:
        encoder_input = EncoderInput(
            num_encoder_tokens=WHISPER_ENCODER_LEN, content_hash=f"audio-{i}", token_ids=None
        )
    return Request(
        f"req-{i}",
        [50258, 50259 + i % 90, 50360, 50364][:PROMPT_LEN],
        SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, logprobs=0, temperature=0.0),
        encoder_input=encoder_input,
        eos_token_id=EOS,
        arrival_time=float(i),
    )


class FakeRunner:
    """The runner's bookkeeping at launch: a request samples a token when its scheduled chunk
    reaches the end of its tokens; logprobs lists shaped as the runner's (logprobs=0)."""

    def __init__(self) -> None:
        self.num_tokens: dict[str, int] = {}
        self.computed: dict[str, int] = {}
        self.step = 0

    def __call__(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.step += 1
        for req_id in so.finished_req_ids:
            self.num_tokens.pop(req_id, None)
            self.computed.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.num_tokens[new.req_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        req_ids = list(so.num_scheduled_tokens)
        sampled, lp_ids, lps, ranks = [], [], [], []
        for req_id in req_ids:
            self.computed[req_id] += so.num_scheduled_tokens[req_id]
            if self.computed[req_id] >= self.num_tokens[req_id]:
                token = 1000 + (self.step * 7 + self.num_tokens[req_id]) % 30000
                self.num_tokens[req_id] += 1
                sampled.append([token])
                lp_ids.append([[token]])
                lps.append([[-0.5]])
                ranks.append([1])
            else:
                sampled.append([])
                lp_ids.append(None)
                lps.append(None)
                ranks.append(None)
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=sampled,
            logprob_token_ids=lp_ids,
            logprobs=lps,
            logprob_ranks=ranks,
        )


def run(
    args: argparse.Namespace, profiler: cProfile.Profile | None
) -> tuple[list, list, list, int]:
    scheduler = make_scheduler(args)
    for i in range(args.num_requests):
        scheduler.add_request(make_request(i, args))
    runner = FakeRunner()
    queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    sched_us: list[float] = []
    update_us: list[float] = []
    admit_us: list[float] = []
    """Per admitted request: the schedule() calls that admitted new requests."""
    num_outputs = 0
    n = args.num_requests
    clock = time.perf_counter
    gc.collect()
    while scheduler.has_requests() or queue:
        if len(queue) < 2 and (
            scheduler.has_unscheduled_requests() or scheduler.has_finished_requests
        ):
            if profiler is not None:
                profiler.enable()
            t0 = clock()
            so = scheduler.schedule()
            t1 = clock()
            if profiler is not None:
                profiler.disable()
            steady = len(so.num_scheduled_tokens) == n and so.total_num_scheduled_tokens == n
            if steady and not so.scheduled_new_reqs:
                sched_us.append((t1 - t0) * 1e6)
            if so.scheduled_new_reqs:
                admit_us.append((t1 - t0) * 1e6 / len(so.scheduled_new_reqs))
            if so.total_num_scheduled_tokens:
                queue.append((so, runner(so)))
            if len(queue) < 2 and scheduler.has_unscheduled_requests():
                continue
        if not queue:
            continue
        so, out = queue.popleft()
        if profiler is not None:
            profiler.enable()
        t0 = clock()
        outputs = scheduler.update_from_output(so, out)
        t1 = clock()
        if profiler is not None:
            profiler.disable()
        num_outputs += len(outputs.outputs)
        steady = len(so.num_scheduled_tokens) == n and len(outputs.outputs) == n
        if steady and not any(o.finished for o in outputs.outputs):
            update_us.append((t1 - t0) * 1e6)
    return sched_us, update_us, admit_us, num_outputs


def summary(name: str, us: list[float], n: int) -> str:
    if not us:
        return f"{name}: no steady steps"
    us = sorted(us)
    med = statistics.median(us)
    p90 = us[int(0.9 * (len(us) - 1))]
    return (
        f"{name:>20}: median {med:8.1f} us  p90 {p90:8.1f} us  "
        f"({med / n:.2f} us/request, {len(us)} steps)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=100)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--encoder-decoder", action="store_true")
    parser.add_argument("--repeats", type=int, default=3, help="runs; the best median is shown")
    parser.add_argument("--profile", action="store_true", help="cProfile one more run")
    args = parser.parse_args()
    best: tuple[list, list] | None = None
    admissions: list[float] = []
    for _ in range(args.repeats):
        sched_us, update_us, admit_us, num_outputs = run(args, None)
        admissions.append(statistics.median(admit_us))
        expected = args.num_requests * args.max_tokens
        assert num_outputs == expected, f"{num_outputs} outputs, expected {expected}"
        if best is None or statistics.median(sched_us) + statistics.median(
            update_us
        ) < statistics.median(best[0]) + statistics.median(best[1]):
            best = (sched_us, update_us)
    assert best is not None
    kind = "encoder-decoder" if args.encoder_decoder else "decoder-only"
    print(f"{kind}, {args.num_requests} requests, max_tokens {args.max_tokens}, pipelined")
    print(summary("schedule", best[0], args.num_requests))
    print(summary("update_from_output", best[1], args.num_requests))
    print(
        f"{'admission':>20}: {min(admissions):8.1f} us per admitted request (schedule calls "
        f"that admit, median of a run; best of {args.repeats})"
    )
    if args.profile:
        profiler = cProfile.Profile()
        run(args, profiler)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
