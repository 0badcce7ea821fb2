"""Host time of the frontend's per-step output work for a large decode batch: no model, no GPU.

A real `OutputProcessor` with a real tokenizer (only the tokenizer is loaded) holds N requests,
each decoding one token per step with logprobs=0 (what the transcription path asks for), and is
fed the EngineCoreOutputs the scheduler would make; the last step ends every request (length).
Variants: `final` (FINAL_ONLY, detokenize=False: how transcription windows run), `delta` and
`cumulative` (detokenizing, streamed). Also times the msgspec encode (core process) and decode
(client) of one such step's EngineCoreOutputs with the engine's own encoder and decoder.

    python benchmarks/host_frontend.py
    python benchmarks/host_frontend.py --num-requests 256 --steps 100 --variants final,delta
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from pathlib import Path

from v1.core.protocol import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from v1.core.serial import MsgpackDecoder, MsgpackEncoder
from v1.engine.output_processor import OutputProcessor
from v1.outputs import RequestOutputKind
from v1.sampling_params import SamplingParams

DEFAULT_TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "assets" / "whisper-base"
WHISPER_PROMPT = [50258, 50259, 50359, 50363]  # sot, en, transcribe, notimestamps
NUM_TEXT_TOKENS = 50257  # whisper's text vocabulary (ids below <|endoftext|>)
NUM_DISTINCT_TOKENS = 2000
"""Outputs draw from this many text ids: a long-lived engine has the common tokens' strings
cached after a warm-up run, as speech uses a small part of the vocabulary."""

VARIANTS = {
    "final": (RequestOutputKind.FINAL_ONLY, False),
    "delta": (RequestOutputKind.DELTA, True),
    "cumulative": (RequestOutputKind.CUMULATIVE, True),
}
"""name -> (output kind, detokenize)."""


def make_batches(num_requests: int, num_steps: int, seed: int = 0) -> list[list[EngineCoreOutput]]:
    """One EngineCoreOutput per request per step, logprobs=0 as the scheduler fills them."""
    rng = random.Random(seed)
    vocab = rng.sample(range(NUM_TEXT_TOKENS), NUM_DISTINCT_TOKENS)
    batches = []
    for step in range(num_steps):
        last = step == num_steps - 1
        batch = []
        for i in range(num_requests):
            token = rng.choice(vocab)
            batch.append(
                EngineCoreOutput(
                    f"req-{i}",
                    [token],
                    new_logprob_token_ids=[[token]],
                    new_logprobs=[[-rng.random() * 3.0]],
                    new_logprob_ranks=[rng.randrange(1, 4)],
                    finish_reason=FinishReason.LENGTH if last else None,
                    queue_time=0.001 if step == 0 else None,
                )
            )
        batches.append(batch)
    return batches


def add_requests(
    processor: OutputProcessor, num_requests: int, num_steps: int, variant: str
) -> None:
    output_kind, detokenize = VARIANTS[variant]
    params = SamplingParams(
        max_tokens=num_steps, temperature=0.0, logprobs=0, ignore_eos=True, detokenize=detokenize
    )
    for i in range(num_requests):
        request = EngineCoreRequest(
            request_id=f"req-{i}", prompt_token_ids=list(WHISPER_PROMPT), sampling_params=params
        )
        processor.add_request(request, None, output_kind=output_kind)


def time_steps(
    processor: OutputProcessor, batches: list[list[EngineCoreOutput]], variant: str
) -> tuple[list[float], int]:
    """Seconds of `process_outputs` per step of one run of the batches (its requests added
    first), and the number of RequestOutputs produced."""
    add_requests(processor, len(batches[0]), len(batches), variant)
    gc.collect()
    times, num_results = [], 0
    for batch in batches:
        start = time.perf_counter()
        results, to_abort = processor.process_outputs(batch)
        times.append(time.perf_counter() - start)
        num_results += len(results)
        assert not to_abort
    assert not processor.has_unfinished_requests()
    return times, num_results


def time_serialization(batch: list[EngineCoreOutput], iters: int) -> tuple[float, float, int]:
    """Median seconds to encode (core side) and decode (client side) one step's outputs, and
    the message size in bytes."""
    message = EngineCoreOutputs(outputs=batch, timestamp=time.monotonic())
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    enc_times, dec_times = [], []
    for _ in range(iters):
        start = time.perf_counter()
        frames = encoder.encode(message)
        enc_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        decoded = decoder.decode(frames)
        dec_times.append(time.perf_counter() - start)
    assert decoded == message
    size = sum(memoryview(f).nbytes for f in frames)
    return statistics.median(enc_times), statistics.median(dec_times), size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER))
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variants", default="final,delta,cumulative")
    parser.add_argument("--serial-iters", type=int, default=200)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    batches = make_batches(args.num_requests, args.steps)
    gc.collect()
    gc.freeze()  # as LLMEngine does after start-up
    n = args.num_requests
    print(f"{n} requests x {args.steps} steps, 1 token per step, logprobs=0; medians of runs")
    print(f"{'variant':<11} {'µs/step':>9} {'µs/req':>8} {'last step µs':>13} {'total ms':>9}")
    for variant in args.variants.split(","):
        processor = OutputProcessor(tokenizer)
        time_steps(processor, batches, variant)  # warm-up: token strings cached, as in a server
        medians, lasts, totals = [], [], []
        for _ in range(args.repeats):
            times, num_results = time_steps(processor, batches, variant)
            medians.append(statistics.median(times))
            lasts.append(times[-1])
            totals.append(sum(times))
        step = statistics.median(medians)
        print(
            f"{variant:<11} {step * 1e6:9.1f} {step * 1e6 / n:8.2f} "
            f"{statistics.median(lasts) * 1e6:13.1f} {statistics.median(totals) * 1e3:9.2f}"
            f"   ({num_results} outputs per run)"
        )
    enc, dec, size = time_serialization(batches[1], args.serial_iters)
    print(
        f"msgspec, one step of {n} outputs ({size} bytes): encode {enc * 1e6:.1f} µs, "
        f"decode {dec * 1e6:.1f} µs"
    )


if __name__ == "__main__":
    main()
