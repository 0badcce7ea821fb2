"""`whisper-base-real`: the real whisper-base weights on real speech at real lengths
(`_real_speech`: LibriSpeech x 2 and JFK, 4.7-11 s, each input a fresh shifted/scaled variant),
greedy, EOS ends every request. Both sides warm; RTFx of each, the WER of each against the
human references, and how many transcripts differ between the two.

transformers: `GenerationMixin.generate` on precomputed features (the extraction timed apart and
left out of its figure, as in `_whisper.py`), prompt <|startoftranscript|><|en|><|transcribe|>
<|notimestamps|>, whisper-base's suppress lists, max_new_tokens 440, batch size swept.
v1-engine: `LLM.transcribe(audio, language="en", temperature=0.0)` on 16 kHz float32 arrays with
the engine's defaults (auto max_num_seqs / num_scheduler_steps) unless --max-num-seqs /
--num-scheduler-steps are given; log-mel and hashing inside its timed region.
"""

from __future__ import annotations

import functools
import statistics
from typing import Any

import torch
from _context import Baseline, Context, RowSpec, asset, ours_rows, run_ours, variants_for
from _harness import Samples, SweepPlan, sweep_batches, timed
from _real_speech import InputSet, load_clips, make_inputs, num_different, wer
from _report import Row

MAX_NEW_TOKENS = 440
TINY_ENGINE_KWARGS = dict(
    max_num_seqs=8, max_num_batched_tokens=512, kv_cache_memory_bytes=128 << 20
)  # the CPU default pool (64 MiB) holds one request of whisper-base (36 MiB of cross K/V)


def model_path(ctx: Context) -> str:
    return getattr(ctx.args, "whisper_base", None) or asset("whisper-base")


def bench_whisper_base_real(ctx: Context) -> list[Row]:
    path = model_path(ctx)
    clips = load_clips(getattr(ctx.args, "audio_dir", None))
    if ctx.tiny:
        # The smoke run: the two short LibriSpeech clips, once each (real whisper-base on CPU
        # is the slow part of a --tiny run; the path is the same for any number of inputs).
        clips = [c for c in clips if c.name.startswith("librispeech/")]
    num_inputs = ctx.num_inputs(ctx.sizes(1024, len(clips)))
    sets: dict[int, InputSet] = {}

    def inputs(input_set: int) -> InputSet:
        if input_set not in sets:
            sets[input_set] = make_inputs(clips, num_inputs, input_set)
        return sets[input_set]

    work = inputs(0).seconds  # every set: the same clips, shifts of the same spread
    clip_names = " + ".join(c.name for c in clips)
    hf_texts: list[str] | None = None
    baseline = None
    if not ctx.args.no_transformers:
        baseline, hf_texts = hf_whisper_real(ctx, path, inputs)
    ctx.device.free()

    engine_kwargs = ctx.engine_kwargs({}, TINY_ENGINE_KWARGS)
    rows = []
    for v in variants_for(ctx, True):
        texts: dict[int, list[str]] = {}
        run = _ours_run()

        def measure(llm: Any, run: Any = run, texts: dict[int, list[str]] = texts) -> Samples:
            seconds = []
            for input_set in range(1, ctx.repeats + 1):
                batch = inputs(input_set)
                elapsed, outs = timed(ctx.device, functools.partial(run, llm, batch))
                seconds.append(elapsed)
                texts[input_set] = [o.text for o in outs]
            return Samples(tuple(seconds))

        result = run_ours(ctx, path, engine_kwargs, v, lambda s: inputs(s), run, measure)
        last = ctx.repeats
        spec = RowSpec(
            "whisper-base real speech",
            "RTFx",
            work,
            None,
            expected=None,
            intro=f"{num_inputs} inputs, {work:,.1f} s of audio a run ({clip_names}, "
            f"each a fresh shifted/scaled variant), EOS-ended greedy; v1-engine "
            f"`LLM.transcribe`, engine {engine_kwargs or 'defaults (auto)'}",
        )
        row_baseline = Baseline(
            baseline.samples if baseline else None,
            baseline.batch if baseline else None,
            None,  # token counts may differ legitimately (EOS-ended): texts are compared below
            list(baseline.notes) if baseline else [],
        )
        row = ours_rows(ctx, spec, row_baseline, [result])[0]
        if last in texts:
            refs = inputs(last).references
            note = f"WER vs the references: v1-engine {100 * wer(refs, texts[last]):.2f}%"
            if hf_texts is not None:
                note += (
                    f", transformers {100 * wer(refs, hf_texts):.2f}%; transcripts that differ "
                    f"between the two: {num_different(texts[last], hf_texts)} of {num_inputs}"
                )
                differ = [
                    i
                    for i, (ours, theirs) in enumerate(zip(texts[last], hf_texts, strict=True))
                    if ours.strip() != theirs.strip()
                ]
                first = differ[0] if differ else None
                if first is not None:
                    row.notes.append(
                        f"first difference, input {first}: v1-engine {texts[last][first]!r} / "
                        f"transformers {hf_texts[first]!r}"
                    )
            row.notes.append(note)
        rows.append(row)
    sets.clear()
    return rows


def _ours_run() -> Any:
    from v1 import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS)

    def run(llm: Any, batch: InputSet) -> Any:
        audio = [(a, 16000) for a in batch.audio]
        return llm.transcribe(
            audio, language="en", sampling_params=params, temperature=0.0, use_tqdm=False
        )

    return run


def hf_whisper_real(ctx: Context, path: str, inputs: Any) -> tuple[Baseline, list[str] | None]:
    """transformers' fastest greedy path on the real weights, batch size swept; the
    transcripts of its best batch's last timed run (input set `repeats`)."""
    from transformers import (
        GenerationConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperTokenizer,
    )
    from transformers.generation.utils import GenerationMixin

    device = ctx.device
    loaded = WhisperForConditionalGeneration.from_pretrained(path, dtype=ctx.dtype)
    holder = {"model": loaded.to(device.name).eval()}
    loaded = None
    g = holder["model"].generation_config
    tokenizer = WhisperTokenizer.from_pretrained(path)
    extractor = WhisperFeatureExtractor.from_pretrained(path)
    feats: dict[int, torch.Tensor] = {}
    feature_seconds = []
    for input_set in range(ctx.repeats + 1):
        audio = inputs(input_set).audio
        seconds, feats[input_set] = timed(
            device,
            lambda a=audio: extractor(
                a, sampling_rate=16000, return_tensors="pt", device=device.name
            ).input_features.to(device.name, ctx.dtype),
        )
        if input_set:
            feature_seconds.append(seconds)
    prompt = torch.tensor(
        [
            [
                g.decoder_start_token_id,
                g.lang_to_id["<|en|>"],
                g.task_to_id["transcribe"],
                g.no_timestamps_token_id,
            ]
        ],
        device=device.name,
    )
    config = GenerationConfig(
        decoder_start_token_id=g.decoder_start_token_id,
        bos_token_id=g.bos_token_id,
        eos_token_id=g.eos_token_id,
        pad_token_id=g.pad_token_id,
        suppress_tokens=g.suppress_tokens,
        begin_suppress_tokens=g.begin_suppress_tokens,
        max_new_tokens=MAX_NEW_TOKENS,
        do_sample=False,
        num_beams=1,
        use_cache=True,
    )

    def run(batch: int, input_set: int, limit: int | None = None) -> list[str]:
        x = feats[input_set][:limit]
        texts: list[str] = []
        with torch.inference_mode():
            for i in range(0, len(x), batch):
                chunk = x[i : i + batch]
                out = GenerationMixin.generate(
                    holder["model"],
                    input_features=chunk,
                    decoder_input_ids=prompt.expand(len(chunk), -1),
                    generation_config=config,
                )
                texts += tokenizer.batch_decode(out[:, prompt.shape[1] :], skip_special_tokens=True)
        return texts

    plan = SweepPlan(
        batches=ctx.hf_batches(len(feats[0]), (1024, 512, 256, 128, 64), (4, 2)),
        repeats=ctx.repeats,
        budget_s=ctx.args.hf_sweep_budget,
        exhaustive=bool(ctx.args.hf_batches),
    )
    # sweep_batches keeps each point's last run result in `counts`: here, its transcripts.
    sweep = sweep_batches(device, plan, lambda b: run(b, 0, limit=b), run)
    work = inputs(0).seconds
    notes = [f"transformers `GenerationMixin.generate` sweep: {sweep.describe(work, 'RTFx')}"]
    feature_s = statistics.median(feature_seconds)
    best = sweep.best
    holder.clear()
    feats.clear()
    if best is None:
        return Baseline(None, None, None, notes), None
    notes.append(
        f"transformers features: {feature_s:.2f} s per run, NOT in its figure; with them its "
        f"best is {work / (best.samples.median + feature_s):,.1f} RTFx"
    )
    if best.peak_memory_bytes:
        notes.append(
            f"transformers peak memory at batch {best.batch}: "
            f"{best.peak_memory_bytes / 2**30:,.1f} GiB"
        )
    texts = list(best.counts) if best.counts is not None else None  # type: ignore[arg-type]
    return Baseline(best.samples, best.batch, None, notes), texts
