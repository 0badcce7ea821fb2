"""Long-form Whisper: sequential seek vs batched VAD chunks (`batch_size`) on one engine.

Builds a long file from the real speech in ../shared/assets/audio (the three clips with 1-3 s
silences between them, repeated to `--minutes`), transcribes it with openai-whisper's sequential
seek (timestamps, previous-text conditioning) and with `batch_size=N` (Silero VAD chunks of at
most 30 s decoded in parallel in the engine's steps) on the same `LLM`, and reports wall time,
RTFx (audio seconds / wall seconds) and WER against the clips' references (Whisper's English
normalizer).

    python benchmarks/longform_batched.py --minutes 60 --batch-size 32 --device cuda
    python benchmarks/longform_batched.py --minutes 1 --batch-size 4 --device cpu   # smoke

Each run also prints where its wall time went (`phases`): audio loading (`load_audio_inputs`),
VAD (`speech_chunks`: Silero over the whole file), planning the chunks (`TranscriptionPlanner
.plan`), the plans' per-window Python (`advance_plan`: prompts, segments, text), submitting
windows (`LLMEngine.add_processed_request`), engine steps (`LLMEngine.step`: encoder/decoder
forward, log-mel on the device, output processing), the rest of the loop (`engine`: `_SyncRun`
bookkeeping) and merging the chunk results; `other` is the remainder.
The timers wrap the module functions of v1.engine.transcription.offline / .plan for the run
(nested calls are not double counted: plan() inside the engine loop counts as plan).
`--profile` additionally prints a cProfile of the batched run (top functions by total time).
`--vad-workers N` sets the VAD threads (1: the single pass; default: the CPUs).
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

SR = 16_000
ASSETS = Path(__file__).resolve().parents[2] / "shared" / "assets"
CLIPS = ["jfk.flac", "librispeech/test_audio_0.flac", "librispeech/test_audio_1.flac"]


def build_long_audio(minutes: float, seed: int = 0) -> tuple[np.ndarray, str]:
    """(16 kHz samples, reference text) of the clips back to back with 1-3 s gaps, `minutes` long."""
    from v1.audio import load_audio

    audio_dir = ASSETS / "audio"
    clips = [load_audio(audio_dir / name) for name in CLIPS]
    refs = [(audio_dir / name).with_suffix(".txt").read_text().strip() for name in CLIPS]
    rng = np.random.default_rng(seed)
    pieces, texts, total = [], [], 0
    target = int(minutes * 60 * SR)
    k = 0
    while total < target:
        clip = clips[k % len(clips)]
        gap = np.zeros(int(rng.uniform(1.0, 3.0) * SR), dtype=np.float32)
        pieces += [clip, gap]
        texts.append(refs[k % len(clips)])
        total += clip.size + gap.size
        k += 1
    return np.concatenate(pieces).astype(np.float32), " ".join(texts)


@functools.cache
def _normalizer(model: str) -> Any:
    from transformers.models.whisper.english_normalizer import EnglishTextNormalizer

    return EnglishTextNormalizer(json.loads((Path(model) / "normalizer.json").read_text()))


def wer(reference: str, hypothesis: str, model: str) -> float:
    """Word error rate after Whisper's English normalizer (edit distance over words)."""
    norm = _normalizer(model)
    ref, hyp = norm(reference).split(), norm(hypothesis).split()
    previous = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, start=1):
        current = [i]
        for j, h in enumerate(hyp, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (r != h)))
        previous = current
    return previous[-1] / max(1, len(ref))


class PhaseTimer:
    """Seconds spent inside wrapped functions, by phase name (innermost phase wins)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._stack: list[list[Any]] = []  # [phase, start, child seconds]
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, attr: str, phase: str) -> None:
        """Time `owner.attr` as `phase` (skipped where the code base has no such function)."""
        original = getattr(owner, attr, None)
        if original is None:
            return
        timer = self

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            timer._stack.append([phase, time.perf_counter(), 0.0])
            try:
                return original(*args, **kwargs)
            finally:
                name, start, child = timer._stack.pop()
                spent = time.perf_counter() - start
                timer.seconds[name] = timer.seconds.get(name, 0.0) + spent - child
                if timer._stack:
                    timer._stack[-1][2] += spent

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, original))

    def reset(self) -> None:
        self.seconds = {}

    def restore(self) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)
        self._undo = []


def install_phase_timers(vad_workers: int | None) -> PhaseTimer:
    from v1.audio import vad
    from v1.engine.llm_engine import LLMEngine
    from v1.engine.transcription import offline, plan

    timer = PhaseTimer()
    timer.wrap(offline, "load_audio_inputs", "audio")
    timer.wrap(offline, "speech_chunks", "vad")
    timer.wrap(plan.TranscriptionPlanner, "plan", "plan")
    timer.wrap(offline._SyncRun, "run", "engine")
    timer.wrap(offline, "advance_plan", "windows")
    timer.wrap(LLMEngine, "add_processed_request", "submit")
    timer.wrap(LLMEngine, "step", "step")
    timer.wrap(offline, "merge_chunk_results", "merge")
    if vad_workers is not None:  # get_speech_timestamps(workers=None) asks this function
        original = vad.default_vad_workers
        vad.default_vad_workers = lambda: vad_workers
        timer._undo.append((vad, "default_vad_workers", original))
    return timer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=str(ASSETS / "whisper-base"))
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--skip-sequential", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    ap.add_argument("--vad-workers", type=int, default=None, help="VAD threads (default: CPUs)")
    ap.add_argument("--profile", action="store_true", help="cProfile the batched run")
    args = ap.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from v1 import LLM

    audio, reference = build_long_audio(args.minutes)
    seconds = audio.size / SR
    kwargs: dict[str, Any] = {"device": args.device}
    if args.dtype:
        kwargs["dtype"] = args.dtype
    rows = []
    timer = install_phase_timers(args.vad_workers)
    profile_text = ""
    with LLM(args.model, **kwargs) as llm:
        llm.transcribe((build_long_audio(0.2)[0], SR), language="en", use_tqdm=False)  # warm up
        runs = [] if args.skip_sequential else [("sequential seek", {"timestamps": True})]
        runs.append(
            (
                f"batched (batch_size={args.batch_size}, VAD)",
                {"batch_size": args.batch_size, "vad_filter": True},
            )
        )
        for name, options in runs:
            profiler = None
            if args.profile and "batch_size" in options:
                import cProfile

                profiler = cProfile.Profile()
            timer.reset()
            start = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            (result,) = llm.transcribe((audio, SR), language="en", use_tqdm=False, **options)
            if profiler is not None:
                profiler.disable()
            wall = time.perf_counter() - start
            phases = dict(timer.seconds)
            phases["other"] = wall - sum(phases.values())
            if profiler is not None:
                import io
                import pstats

                buf = io.StringIO()
                pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(25)
                profile_text = buf.getvalue()
            starts = [s.start for s in result.segments]
            assert starts == sorted(starts), "segments out of order"
            rows.append(
                (
                    name,
                    wall,
                    seconds / wall,
                    wer(reference, result.text, args.model),
                    len(result.segments),
                    phases,
                )
            )
    print(f"audio: {seconds / 60:.1f} min, model {Path(args.model).name}, device {args.device}")
    timer.restore()
    print("| mode | wall s | RTFx | WER | segments |")
    print("|---|---:|---:|---:|---:|")
    for name, wall, rtfx, w, n, _ in rows:
        print(f"| {name} | {wall:.2f} | {rtfx:.1f} | {100 * w:.2f}% | {n} |")
    names = ["audio", "vad", "plan", "windows", "submit", "step", "engine", "merge", "other"]
    print()
    print("phases (s) | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for name, _, _, _, _, phases in rows:
        print(f"| {name} | " + " | ".join(f"{phases.get(k, 0.0):.3f}" for k in names) + " |")
    if len(rows) == 2 and rows[1][1] > 0:
        print(f"\nspeed-up batched vs sequential: {rows[0][1] / rows[1][1]:.1f}x")
    if profile_text:
        print("\ncProfile of the batched run (top 25 by total time):")
        print(profile_text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
