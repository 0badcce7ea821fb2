"""This engine vs faster-whisper (CTranslate2) on the same long file, CPU: RTFx and WER,
sequential and batched.

Converts the transformers Whisper folder (default ../shared/assets/whisper-base) with
CTranslate2's converter into a temporary folder, builds a long file from the asset speech
(`longform_batched.build_long_audio`), and runs:

- faster-whisper `WhisperModel.transcribe` (sequential seek, beam_size 1 so both are greedy)
- faster-whisper `BatchedInferencePipeline.transcribe(batch_size=N)` (VAD chunks)
- this engine's `LLM.transcribe(timestamps=True)` (sequential seek)
- this engine's `LLM.transcribe(batch_size=N, vad_filter=True)`

all in English, greedy, temperature fallback on, with the same number of CPU threads.

    python benchmarks/vs_faster_whisper.py --minutes 3 --threads 2 --batch-size 8
    python benchmarks/vs_faster_whisper.py --compute-type int8 ...
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from longform_batched import ASSETS, SR, build_long_audio, wer  # noqa: E402


def convert(model: str, out_dir: str, quantization: str) -> str:
    from ctranslate2.converters import TransformersConverter

    target = str(Path(out_dir) / f"ct2-{quantization}")
    TransformersConverter(model, copy_files=["tokenizer.json", "preprocessor_config.json"]).convert(
        target, quantization=quantization, force=True
    )
    return target


def run_faster_whisper(
    ct2_dir: str, audio: Any, threads: int, batch_size: int, compute_type: str
) -> list[tuple[str, float, str, int]]:
    from faster_whisper import BatchedInferencePipeline, WhisperModel

    model = WhisperModel(ct2_dir, device="cpu", compute_type=compute_type, cpu_threads=threads)
    rows = []
    # Warm-up on a few seconds.
    list(model.transcribe(audio[: 5 * SR], language="en", beam_size=1)[0])
    start = time.perf_counter()
    segments, _ = model.transcribe(audio, language="en", beam_size=1)
    segments = list(segments)
    rows.append(
        (
            f"faster-whisper {compute_type}, sequential",
            time.perf_counter() - start,
            "".join(s.text for s in segments),
            len(segments),
        )
    )
    pipeline = BatchedInferencePipeline(model=model)
    start = time.perf_counter()
    segments, _ = pipeline.transcribe(audio, language="en", beam_size=1, batch_size=batch_size)
    segments = list(segments)
    rows.append(
        (
            f"faster-whisper {compute_type}, batched (batch_size={batch_size})",
            time.perf_counter() - start,
            "".join(s.text for s in segments),
            len(segments),
        )
    )
    return rows


def run_engine(
    model: str, audio: Any, threads: int, batch_size: int
) -> list[tuple[str, float, str, int]]:
    import torch

    torch.set_num_threads(threads)
    from v1 import LLM

    rows = []
    with LLM(model, device="cpu") as llm:
        llm.transcribe((audio[: 5 * SR], SR), language="en", use_tqdm=False)  # warm up
        for name, options in (
            ("v1 engine fp32, sequential", {"timestamps": True}),
            (
                f"v1 engine fp32, batched (batch_size={batch_size})",
                {"batch_size": batch_size, "vad_filter": True},
            ),
        ):
            start = time.perf_counter()
            (result,) = llm.transcribe((audio, SR), language="en", use_tqdm=False, **options)
            rows.append((name, time.perf_counter() - start, result.text, len(result.segments)))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=str(ASSETS / "whisper-base"))
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument(
        "--compute-type",
        default="float32",
        help="faster-whisper compute type on CPU: float32 or int8 (default: %(default)s)",
    )
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args(argv)

    audio, reference = build_long_audio(args.minutes)
    seconds = audio.size / SR
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        quant = "int8" if args.compute_type.startswith("int8") else "float32"
        ct2_dir = convert(args.model, tmp, quant)
        rows += run_faster_whisper(ct2_dir, audio, args.threads, args.batch_size, args.compute_type)
    if not args.skip_engine:
        rows += run_engine(args.model, audio, args.threads, args.batch_size)
    print(
        f"audio: {seconds:.0f} s ({seconds / 60:.1f} min), {Path(args.model).name}, CPU, {args.threads} threads"
    )
    print("| system | wall s | RTFx | WER | segments |")
    print("|---|---:|---:|---:|---:|")
    for name, wall, text, n in rows:
        print(
            f"| {name} | {wall:.1f} | {seconds / wall:.1f} | {100 * wer(reference, text, args.model):.2f}% | {n} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
