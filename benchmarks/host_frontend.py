"""Host time of the frontend's per-step output work for a large decode batch: no model, no GPU.

A real `OutputProcessor` with a real tokenizer (only the tokenizer is loaded) holds N requests,
each decoding one token per step with logprobs=0 (what the transcription path asks for), and is
fed the EngineCoreOutputs the scheduler would make (ending on length).
Variants: `window` (FINAL_ONLY, detokenize=False, lazy_logprobs: how `LLM.transcribe` runs
its windows), `final` (FINAL_ONLY with text and Logprob entries: `LLM.generate` with
logprobs=0), `delta` and `cumulative` (streamed). Also times the msgspec encode (core process)
and decode (client) of one such step's EngineCoreOutputs with the engine's own encoder and decoder.

    python benchmarks/host_frontend.py
    python benchmarks/host_frontend.py --num-requests 256 --steps 100 --variants window,delta

Per variant two workloads: synced (every request ends on the last step: the median step is
the common decode step) and staggered (a transcription's steady state: requests end and start
every step); `µs/output` is the total time over the number of EngineCoreOutputs processed.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import random
import statistics
import time
from dataclasses import dataclass, field
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
    "window": (RequestOutputKind.FINAL_ONLY, False, True),
    "final": (RequestOutputKind.FINAL_ONLY, True, False),
    "delta": (RequestOutputKind.DELTA, True, False),
    "cumulative": (RequestOutputKind.CUMULATIVE, True, False),
}
"""name -> (output kind, detokenize, lazy_logprobs)."""
HAS_LAZY_LOGPROBS = "lazy_logprobs" in inspect.signature(OutputProcessor.add_request).parameters
"""False on code from before lazy_logprobs (to measure a baseline): windows get entries."""


@dataclass
class Workload:
    """Per step: the requests to add before it (id, max_tokens) and the outputs the core
    sends."""

    adds: list[list[tuple[str, int]]]
    batches: list[list[EngineCoreOutput]]
    messages: list[list[bytes]] = field(default_factory=list)
    """Each step's outputs as the core process sends them (EngineCoreOutputs frames): decoded
    afresh before the step, so the frontend sees new objects as in a running engine."""

    @property
    def num_outputs(self) -> int:
        return sum(len(b) for b in self.batches)


def make_workload(num_requests: int, num_steps: int, staggered: bool, seed: int = 0) -> Workload:
    """`num_requests` slots decoding one token per step with logprobs=0 (the fields as the
    scheduler fills them). Not staggered: every request runs `num_steps` tokens, all ending
    on the last step. Staggered (a transcription's steady state): lengths are uniform in
    [num_steps / 2, 3 num_steps / 2] and a finished slot starts a new request on the next
    step, for 3 num_steps steps, then the slots drain."""
    rng = random.Random(seed)
    vocab = rng.sample(range(NUM_TEXT_TOKENS), NUM_DISTINCT_TOKENS)
    lo, hi = (num_steps, num_steps) if not staggered else (num_steps // 2, 3 * num_steps // 2)
    last_start = 0 if not staggered else 3 * num_steps
    next_id = 0
    slots: list[tuple[str, int, int] | None] = [None] * num_requests
    """Per slot: (request id, tokens done, length) or None when free."""
    workload = Workload([], [])
    encoder = MsgpackEncoder()
    step = 0
    while step <= last_start or any(slots):
        adds, batch = [], []
        for j, slot in enumerate(slots):
            if slot is None and step <= last_start:
                slot = (f"req-{next_id}", 0, rng.randint(lo, hi))
                next_id += 1
                adds.append((slot[0], slot[2]))
            if slot is None:
                continue
            req_id, done, length = slot
            token = rng.choice(vocab)
            finished = done + 1 == length
            batch.append(
                EngineCoreOutput(
                    req_id,
                    [token],
                    new_logprob_token_ids=[[token]],
                    new_logprobs=[[-rng.random() * 3.0]],
                    new_logprob_ranks=[rng.randrange(1, 4)],
                    finish_reason=FinishReason.LENGTH if finished else None,
                    queue_time=0.001 if done == 0 else None,
                )
            )
            slots[j] = None if finished else (req_id, done + 1, length)
        workload.adds.append(adds)
        workload.batches.append(batch)
        workload.messages.append(encoder.encode(EngineCoreOutputs(outputs=batch)))
        step += 1
    return workload


def add_request(processor: OutputProcessor, req_id: str, max_tokens: int, variant: str) -> None:
    output_kind, detokenize, lazy_logprobs = VARIANTS[variant]
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True, detokenize=detokenize
    )
    request = EngineCoreRequest(
        request_id=req_id, prompt_token_ids=list(WHISPER_PROMPT), sampling_params=params
    )
    if HAS_LAZY_LOGPROBS:
        processor.add_request(request, None, output_kind=output_kind, lazy_logprobs=lazy_logprobs)
    else:
        processor.add_request(request, None, output_kind=output_kind)


def time_steps(
    processor: OutputProcessor, workload: Workload, variant: str
) -> tuple[list[float], int]:
    """Seconds of `process_outputs` per step of one run of the workload (requests are added and
    the step's outputs decoded between steps, untimed), and the number of RequestOutputs
    produced."""
    gc.collect()
    decoder = MsgpackDecoder(EngineCoreOutputs)
    times, num_results = [], 0
    for adds, message in zip(workload.adds, workload.messages, strict=True):
        for req_id, max_tokens in adds:
            add_request(processor, req_id, max_tokens, variant)
        batch = decoder.decode(message).outputs
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
    parser.add_argument("--variants", default="window,final,delta,cumulative")
    parser.add_argument("--serial-iters", type=int, default=200)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    n = args.num_requests
    workloads = {
        False: make_workload(n, args.steps, staggered=False),
        True: make_workload(n, args.steps, staggered=True),
    }
    gc.collect()
    gc.freeze()  # as LLMEngine does after start-up
    print(
        f"{n} requests, 1 token per step, logprobs=0. synced: all run {args.steps} tokens and "
        f"end together; staggered: lengths {args.steps // 2}-{3 * args.steps // 2}, a new "
        "request takes each finished one's place. Medians of runs."
    )
    print(
        f"{'variant':<22} {'median µs/step':>14} {'µs/req':>7} {'mean µs/step':>12} "
        f"{'max µs/step':>11} {'µs/output':>9}"
    )
    for variant in args.variants.split(","):
        for staggered, workload in workloads.items():
            processor = OutputProcessor(tokenizer)
            time_steps(processor, workload, variant)  # warm-up: token strings cached
            medians, means, maxes, totals = [], [], [], []
            for _ in range(args.repeats):
                times, num_results = time_steps(processor, workload, variant)
                medians.append(statistics.median(times))
                means.append(statistics.mean(times))
                maxes.append(max(times))
                totals.append(sum(times))
            name = f"{variant} {'staggered' if staggered else 'synced'}"
            step = statistics.median(medians)
            per_output = statistics.median(totals) / workload.num_outputs
            print(
                f"{name:<22} {step * 1e6:14.1f} {step * 1e6 / n:7.2f} "
                f"{statistics.median(means) * 1e6:12.1f} {statistics.median(maxes) * 1e6:11.1f} "
                f"{per_output * 1e6:9.2f}"
            )
    enc, dec, size = time_serialization(workloads[False].batches[1], args.serial_iters)
    print(
        f"msgspec, one step of {n} outputs ({size} bytes): encode {enc * 1e6:.1f} µs, "
        f"decode {dec * 1e6:.1f} µs"
    )


if __name__ == "__main__":
    main()
