"""Host cost of Whisper's input path: N clips of 16 kHz mono float32 through the input processor.

Times `InputProcessor.process` (decode/check, content hash, EngineCoreRequest) over N prompts
`{"multi_modal_data": {"audio": (clip, 16000)}}` and over one prompt with n > 1, and reports the
peak bytes Python/numpy allocated meanwhile (tracemalloc, a separate untimed run) and how many
requests' audio shares memory with the caller's array (i.e. was not copied). With
`--device cuda` it also times one step's audio transfer to the GPU: the runner's single pinned
non-blocking copy against one pageable copy per clip (the previous way).

    python benchmarks/whisper_inputs.py --model ../shared/assets/whisper-base
    python benchmarks/whisper_inputs.py --clips 256 --seconds 30 --repeats 5 --device cuda
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16_000
DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "shared" / "assets" / "whisper-base"


def make_processor(model: str):
    from v1.config import make_engine_config
    from v1.engine.input_processor import InputProcessor
    from v1.tokenizer import get_tokenizer

    model_config = make_engine_config(model, device="cpu").model_config
    return InputProcessor(model_config, get_tokenizer(model_config))


def make_clips(n: int, seconds: float, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    num = round(seconds * SAMPLE_RATE)
    return [(0.1 * rng.standard_normal(num)).astype(np.float32) for _ in range(n)]


def timings(fn: Callable[[], object], repeats: int) -> list[float]:
    fn()  # warm-up (builder, tokenizer, allocator)
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def peak_bytes(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak


def report(name: str, times: list[float], peak: int, shared: int, total: int) -> None:
    med = statistics.median(times)
    print(
        f"{name:<28} median {1e3 * med:8.1f} ms  (min {1e3 * min(times):.1f}, max "
        f"{1e3 * max(times):.1f})  peak alloc {peak / 2**20:8.1f} MiB  "
        f"audio not copied: {shared}/{total}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="a Whisper model folder")
    parser.add_argument("--clips", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--n", type=int, default=8, help="completions of the n > 1 prompt")
    parser.add_argument("--device", default="cpu", help="cuda: also time the step transfer")
    args = parser.parse_args()

    from v1.sampling_params import SamplingParams

    processor = make_processor(args.model)
    clips = make_clips(args.clips, args.seconds)
    params = SamplingParams(temperature=0.0, max_tokens=100)
    prompts = [{"prompt": "", "multi_modal_data": {"audio": (c, SAMPLE_RATE)}} for c in clips]
    mb = sum(c.nbytes for c in clips) / 2**20
    print(f"{args.clips} clips x {args.seconds:g} s at 16 kHz float32 ({mb:.0f} MiB of samples)")

    def batch() -> list:
        return [processor.process(f"r{i}", p, params) for i, p in enumerate(prompts)]

    def hash_only() -> list:
        return [hashlib.sha256(memoryview(c)).hexdigest() for c in clips]

    times = timings(hash_only, args.repeats)
    report("sha256 alone (the floor)", times, peak_bytes(hash_only), len(clips), len(clips))
    requests = batch()
    shared = sum(
        np.shares_memory(r.encoder_input.audio, c) for r, c in zip(requests, clips, strict=True)
    )
    report("process() x clips", timings(batch, args.repeats), peak_bytes(batch), shared, len(clips))

    fan_params = SamplingParams(temperature=1.0, max_tokens=100, n=args.n, seed=0)

    def fan_out() -> list:
        return processor.process_all("fan", prompts[0], fan_params)

    children = fan_out()
    shared = sum(np.shares_memory(r.encoder_input.audio, clips[0]) for r in children)
    report(
        f"process_all(n={args.n}) x 1", timings(fan_out, args.repeats), peak_bytes(fan_out),
        shared, len(children),
    )  # fmt: skip
    if args.device != "cpu":
        transfer(clips, args.device, args.repeats)


def transfer(clips: list[np.ndarray], device_name: str, repeats: int) -> None:
    """One step's audio to the device: per-clip pageable copies vs the runner's one pinned copy
    (each timed to the end of the copy, with the device synchronized)."""
    import torch

    from v1.worker.model_states.encoder_decoder import _audio_to_device

    device = torch.device(device_name)

    def synced(fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            out = fn()
            torch.cuda.synchronize(device)
            return out

        return run

    def per_clip() -> list:
        return [torch.as_tensor(c).to(device) for c in clips]

    def one_pinned() -> list:
        return _audio_to_device(clips, device)

    for name, fn in (("per-clip pageable .to()", per_clip), ("one pinned copy", one_pinned)):
        times = timings(synced(fn), repeats)
        med = statistics.median(times)
        gbps = sum(c.nbytes for c in clips) / med / 1e9
        print(f"{name:<28} median {1e3 * med:8.1f} ms  ({gbps:.1f} GB/s, host -> {device})")


if __name__ == "__main__":
    main()
