"""Long-form Whisper: sequential seek vs batched VAD chunks (`batch_size`) on one engine.

Builds a long file from the real speech in ../shared/assets/audio (the three clips with 1-3 s
silences between them, repeated to `--minutes`), transcribes it with openai-whisper's sequential
seek (timestamps, previous-text conditioning) and with `batch_size=N` (Silero VAD chunks of at
most 30 s decoded in parallel in the engine's steps) on the same `LLM`, and reports wall time,
RTFx (audio seconds / wall seconds) and WER against the clips' references (Whisper's English
normalizer). The batched file runs twice: "VAD first" (every VAD piece finished before the
first chunk is decoded; `Transcriber.pipeline_vad = False`) and "pipelined" (the default:
chunks are decoded as soon as the VAD pieces before them settle them, while later pieces still
run on the VAD threads). The two give the same segments.

    python benchmarks/longform_batched.py --minutes 60 --batch-size 128 --device cuda
    python benchmarks/longform_batched.py --minutes 1 --batch-size 4 --device cpu   # smoke

The warm-up starts the VAD threads and their onnxruntime sessions (`v1.audio.vad.warm_up`, once
per process; its time is printed apart). Each run also prints where its wall time went
(`phases`, main thread): audio loading (`load_audio_inputs`), `vad` (the main thread reading
VAD results: waiting for VAD pieces while the engine has nothing to run, and turning
probabilities into spans and chunks: `ChunkStream.take` and `.wait`), planning (`TranscriptionPlanner
.plan`), the plans' per-window Python (`advance_plan`), submitting windows
(`LLMEngine.add_processed_request`), engine steps (`LLMEngine.step`), the rest of the loop
(`engine`: `_SyncRun` bookkeeping) and joining the chunk results (`merge`); `other` is the
remainder. Besides, for batched runs: `VAD wall` (first piece queued -> last piece finished, on
the VAD threads) and `steps in VAD` (engine step time spent while VAD pieces were still running:
the overlap the pipelining buys). The timers wrap the module functions for the run (nested calls
are not double counted). `--profile` also prints a cProfile of the pipelined run (main thread
only). `--vad-workers N` sets the VAD threads (1: the single pass; default: the CPUs).
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


class VadClock:
    """When VAD pieces were queued and finished, and when engine steps ran (perf_counter)."""

    def __init__(self) -> None:
        self.first_queued: float | None = None
        self.last_done: float | None = None
        self.steps: list[tuple[float, float]] = []

    def reset(self) -> None:
        self.first_queued = self.last_done = None
        self.steps = []

    def vad_wall(self) -> float:
        if self.first_queued is None or self.last_done is None:
            return 0.0
        return self.last_done - self.first_queued

    def steps_in_vad(self) -> float:
        """Engine step seconds inside [first piece queued, last piece done]."""
        if self.first_queued is None or self.last_done is None:
            return 0.0
        lo, hi = self.first_queued, self.last_done
        return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in self.steps)


def install_phase_timers(vad_workers: int | None) -> tuple[PhaseTimer, VadClock]:
    from v1.audio import vad
    from v1.engine.llm_engine import LLMEngine
    from v1.engine.transcription import batching, offline, plan

    timer = PhaseTimer()
    clock = VadClock()
    timer.wrap(offline, "load_audio_inputs", "audio")
    timer.wrap(batching.ChunkStream, "take", "vad")
    timer.wrap(batching.ChunkStream, "wait", "vad")
    timer.wrap(plan.TranscriptionPlanner, "plan", "plan")
    timer.wrap(offline._SyncRun, "run", "engine")
    timer.wrap(offline, "advance_plan", "windows")
    timer.wrap(LLMEngine, "add_processed_request", "submit")
    timer.wrap(LLMEngine, "step", "step")
    timer.wrap(batching.ChunkJoiner, "result", "merge")

    def patch(owner: Any, attr: str, make: Any) -> None:
        original = getattr(owner, attr)
        setattr(owner, attr, make(original))
        timer._undo.append((owner, attr, original))

    def piece(original: Any) -> Any:  # runs on the VAD threads
        def timed(*args: Any) -> Any:
            out = original(*args)
            clock.last_done = max(clock.last_done or 0.0, time.perf_counter())
            return out

        return timed

    def submit(original: Any) -> Any:
        def timed(*args: Any) -> Any:
            if clock.first_queued is None:
                clock.first_queued = time.perf_counter()
            return original(*args)

        return timed

    def step(original: Any) -> Any:
        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args)
            finally:
                clock.steps.append((start, time.perf_counter()))

        return timed

    patch(vad, "_piece_probabilities", piece)
    patch(vad, "_submit_pieces", submit)
    patch(LLMEngine, "step", step)
    if vad_workers is not None:  # the VAD pool asks this function when it starts
        patch(vad, "default_vad_workers", lambda _original: lambda: vad_workers)
    return timer, clock


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
    ap.add_argument("--skip-vad-first", action="store_true", help="only the pipelined batch")
    ap.add_argument("--profile", action="store_true", help="cProfile the pipelined run")
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
    timer, clock = install_phase_timers(args.vad_workers)
    profile_text = ""
    batched = {"batch_size": args.batch_size, "vad_filter": True}
    with LLM(args.model, **kwargs) as llm:
        llm.transcribe((build_long_audio(0.2)[0], SR), language="en", use_tqdm=False)  # warm up
        from v1.audio import vad

        start = time.perf_counter()
        vad.warm_up()
        vad_start_up = time.perf_counter() - start
        warm = (build_long_audio(0.5)[0], SR)
        llm.transcribe(warm, language="en", use_tqdm=False, **batched)  # the batched path too
        runs: list[tuple[str, dict[str, Any], bool]] = []
        if not args.skip_sequential:
            runs.append(("sequential seek", {"timestamps": True}, True))
        if not args.skip_vad_first:
            runs.append((f"batched {args.batch_size}, VAD first", batched, False))
        runs.append((f"batched {args.batch_size}, pipelined", batched, True))
        for name, options, pipelined in runs:
            llm.transcriber.pipeline_vad = pipelined
            profiler = None
            if args.profile and "batch_size" in options and pipelined:
                import cProfile

                profiler = cProfile.Profile()
            timer.reset()
            clock.reset()
            start = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            (result,) = llm.transcribe((audio, SR), language="en", use_tqdm=False, **options)
            if profiler is not None:
                profiler.disable()
            wall = time.perf_counter() - start
            phases = dict(timer.seconds)
            phases["other"] = wall - sum(phases.values())
            phases["VAD wall"] = clock.vad_wall()
            phases["steps in VAD"] = clock.steps_in_vad()
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
                    [(s.start, s.end, s.text) for s in result.segments],
                )
            )
    print(f"audio: {seconds / 60:.1f} min, model {Path(args.model).name}, device {args.device}")
    timer.restore()
    print(f"VAD start-up (threads + onnxruntime sessions, once per process): {vad_start_up:.3f} s")
    print("| mode | wall s | RTFx | WER | segments |")
    print("|---|---:|---:|---:|---:|")
    for name, wall, rtfx, w, n, *_ in rows:
        print(f"| {name} | {wall:.2f} | {rtfx:.1f} | {100 * w:.2f}% | {n} |")
    names = ["audio", "vad", "plan", "windows", "submit", "step", "engine", "merge", "other"]
    names += ["VAD wall", "steps in VAD"]
    print()
    print("| phases (s) | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for name, _, _, _, _, phases, _ in rows:
        print(f"| {name} | " + " | ".join(f"{phases.get(k, 0.0):.3f}" for k in names) + " |")
    batched_rows = [r for r in rows if "batched" in r[0]]
    if len(batched_rows) == 2:
        same = batched_rows[0][6] == batched_rows[1][6]
        print(f"\npipelined segments identical to VAD-first: {same}")
    if not args.skip_sequential and len(rows) > 1:
        for row in rows[1:]:
            print(f"speed-up {row[0]} vs sequential: {rows[0][1] / row[1]:.1f}x")
    if profile_text:
        print("\ncProfile of the pipelined run (top 25 by total time):")
        print(profile_text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
