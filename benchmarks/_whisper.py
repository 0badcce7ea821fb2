"""Whisper workloads: large-v3 and large-v3-turbo transcription against transformers (RTFx), and
our decode-step time at batch 256 (turbo).

Clips are 30 s of random 16 kHz noise (fresh per run), decoded with 100 forced tokens after the
prompt <|startoftranscript|><|en|><|transcribe|><|notimestamps|>. transformers gets log-mel
features precomputed (timed apart); ours computes log-mel on the device inside its timed region.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from _context import (
    Baseline,
    Context,
    RowSpec,
    build_model,
    copy_tokenizer,
    ours_rows,
    run_ours,
    variants_for,
)
from _harness import (
    SweepPlan,
    generated_counts,
    sweep_batches,
    time_runs,
    timed,
)
from _report import Row
from _roofline import EncDecShape, enc_dec_cost, enc_dec_step_cost

SAMPLE_RATE = 16000
CLIP_SECONDS = 30.0
CLIP_SAMPLES = 480000

ENGINE_KWARGS = dict(
    max_num_seqs=256,
    max_num_batched_tokens=8192,
    max_num_encoder_input_tokens=1500 * 32,
    num_scheduler_steps=8,  # decode bursts: the host works once per 8 tokens of the batch
)
TINY_ENGINE_KWARGS = dict(
    max_num_seqs=8, max_num_batched_tokens=512, max_num_encoder_input_tokens=1500 * 4
)


def whisper_config(ctx: Context, decoder_layers: int) -> Any:
    if ctx.tiny:
        return shaped_whisper_config(64, 2, min(decoder_layers, 2), heads=2, ffn=128, mels=80)
    return shaped_whisper_config(1280, 32, decoder_layers, heads=20, ffn=5120, mels=128)


def shaped_whisper_config(
    d_model: int, encoder_layers: int, decoder_layers: int, *, heads: int, ffn: int, mels: int
) -> Any:
    """A random-weights Whisper config of these sizes with 30 s windows and the multilingual
    vocabulary of its mel count (80: whisper-base's 51,865 tokens; 128: large-v3's 51,866)."""
    from transformers import WhisperConfig

    return WhisperConfig(
        d_model=d_model,
        encoder_layers=encoder_layers,
        decoder_layers=decoder_layers,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=ffn,
        decoder_ffn_dim=ffn,
        num_mel_bins=mels,
        vocab_size=51865 if mels == 80 else 51866,
        max_source_positions=1500,
        max_target_positions=448,
        decoder_start_token_id=50258,
        pad_token_id=50257,
        bos_token_id=50257,
        eos_token_id=50257,
        attn_implementation="sdpa",
    )


def whisper_shape(cfg: Any) -> EncDecShape:
    return EncDecShape(
        d=cfg.d_model,
        enc_layers=cfg.encoder_layers,
        dec_layers=cfg.decoder_layers,
        ffn=cfg.decoder_ffn_dim,
        vocab=cfg.vocab_size,
        enc_len=cfg.max_source_positions,
        mel_bins=cfg.num_mel_bins,
    )


def whisper_model(ctx: Context, key: str, cfg: Any) -> tuple[Any, str]:
    """The random model (on the device) and its saved folder with whisper-base's tokenizer,
    generation config and a feature extractor for `cfg.num_mel_bins`."""
    from transformers import GenerationConfig, WhisperFeatureExtractor
    from transformers import WhisperForConditionalGeneration as Whisper

    model = build_model(ctx, Whisper, cfg)
    model.generation_config = GenerationConfig.from_pretrained(ctx.args.tokenizer)

    def extras(path: str) -> None:
        copy_tokenizer(ctx.args.tokenizer, path)
        WhisperFeatureExtractor(feature_size=cfg.num_mel_bins).save_pretrained(path)

    return model, ctx.store.save(key, model, extras)


def prompt_ids(generation_config: Any) -> list[int]:
    g = generation_config
    return [
        g.decoder_start_token_id,
        g.lang_to_id["<|en|>"],
        g.task_to_id["transcribe"],
        g.no_timestamps_token_id,
    ]


def make_clips(num_clips: int, seed: int) -> np.ndarray:
    """[num_clips, 480000] float32 noise; each row is one 30 s clip at 16 kHz."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((num_clips, CLIP_SAMPLES), dtype=np.float32) * np.float32(0.1)


def transcribe_run(num_tokens: int) -> Callable[[Any, np.ndarray], Any]:
    from v1 import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)

    def run(llm: Any, clips: np.ndarray) -> Any:
        audio = [(clip, SAMPLE_RATE) for clip in clips]
        # One greedy pass per clip, as transformers' generate: no temperature fallback (random
        # weights would fail every quality threshold and decode each clip six times).
        return llm.transcribe(
            audio, language="en", sampling_params=params, temperature=0.0, use_tqdm=False
        )

    return run


# ---------------------------------------------------------------- transcription (RTFx)
def bench_whisper(ctx: Context, name: str, decoder_layers: int) -> list[Row]:
    num_clips = ctx.num_inputs(ctx.sizes(256, 4))
    num_tokens = ctx.sizes(100, 5)
    cfg = whisper_config(ctx, decoder_layers)
    model, path = whisper_model(ctx, name, cfg)
    clip_sets: dict[int, np.ndarray] = {}

    def clips(input_set: int) -> np.ndarray:
        if input_set not in clip_sets:
            clip_sets[input_set] = make_clips(num_clips, seed=1000 + input_set)
        return clip_sets[input_set]

    baseline = None
    if not ctx.args.no_transformers:
        baseline = hf_whisper(ctx, model, clips, num_tokens)
    model = None  # free transformers' copy before our engine sizes its cache
    ctx.device.free()

    engine_kwargs = ctx.engine_kwargs(ENGINE_KWARGS, TINY_ENGINE_KWARGS)
    run = transcribe_run(num_tokens)
    runs = [run_ours(ctx, path, engine_kwargs, v, clips, run) for v in variants_for(ctx, True)]
    clip_sets.clear()
    cost = enc_dec_cost(whisper_shape(cfg), num_clips, prompt_len=4, new_tokens=num_tokens)
    spec = RowSpec(
        name,
        "RTFx",
        CLIP_SECONDS * num_clips,
        ctx.machine.floor_seconds(cost.flops, cost.bytes),
        expected=num_tokens,
        intro=f"{num_clips} clips of 30 s x {num_tokens} forced tokens; v1-engine: "
        f"`LLM.transcribe` on 16 kHz float32 arrays, log-mel on the device inside the timed "
        f"region; engine {engine_kwargs}",
    )
    return ours_rows(ctx, spec, baseline, runs)


def hf_whisper(
    ctx: Context, model: Any, clips: Callable[[int], np.ndarray], num_tokens: int
) -> Baseline:
    """transformers' fastest path (`GenerationMixin.generate` on precomputed features, the
    prompt given as decoder_input_ids) swept over batch sizes, then the user path
    (`WhisperForConditionalGeneration.generate(features, language=, task=)`) at the best
    batch. The baseline is the faster of the two."""
    from transformers import GenerationConfig, WhisperFeatureExtractor
    from transformers.generation.utils import GenerationMixin

    device, g = ctx.device, model.generation_config
    extractor = WhisperFeatureExtractor(feature_size=model.config.num_mel_bins)
    feats: dict[int, torch.Tensor] = {}
    feature_seconds = []
    for input_set in range(ctx.repeats + 1):
        batch_clips = list(clips(input_set))
        seconds, feats[input_set] = timed(
            device,
            lambda c=batch_clips: extractor(
                c, sampling_rate=SAMPLE_RATE, return_tensors="pt", device=device.name
            ).input_features.to(device.name, ctx.dtype),
        )
        if input_set:
            feature_seconds.append(seconds)
    prompt = torch.tensor([prompt_ids(g)], device=device.name)
    fast_config = GenerationConfig(
        decoder_start_token_id=g.decoder_start_token_id,
        bos_token_id=g.bos_token_id,
        eos_token_id=g.eos_token_id,
        pad_token_id=g.pad_token_id,
        suppress_tokens=g.suppress_tokens,
        begin_suppress_tokens=g.begin_suppress_tokens,
        min_new_tokens=num_tokens,
        max_new_tokens=num_tokens,
        do_sample=False,
        num_beams=1,
        use_cache=True,
    )

    def fast(batch: int, input_set: int, limit: int | None = None) -> list[int]:
        x = feats[input_set][:limit]
        counts: list[int] = []
        for i in range(0, len(x), batch):
            chunk = x[i : i + batch]
            out = GenerationMixin.generate(
                model,
                input_features=chunk,
                decoder_input_ids=prompt.expand(len(chunk), -1),
                generation_config=fast_config,
            )
            counts += generated_counts(out, prompt.shape[1], g.eos_token_id)
        return counts

    def user(batch: int, input_set: int, limit: int | None = None) -> list[int]:
        return _user_generate(model, feats[input_set][:limit], batch, num_tokens, prompt, g)

    plan = SweepPlan(
        batches=ctx.hf_batches(len(feats[0]), (256, 128, 64, 32), (4, 2)),
        repeats=ctx.repeats,
        budget_s=ctx.args.hf_sweep_budget,
        exhaustive=bool(ctx.args.hf_batches),
    )
    sweep = sweep_batches(device, plan, lambda b: fast(b, 0, limit=b), fast)
    work, unit = CLIP_SECONDS * len(feats[0]), "RTFx"
    notes = [f"transformers `GenerationMixin.generate` sweep: {sweep.describe(work, unit)}"]
    best = sweep.best
    if best is None:
        return Baseline(None, None, None, notes)
    samples, batch, counts = best.samples, best.batch, best.counts
    user_runs = None
    try:
        user_runs = time_runs(
            device,
            ctx.repeats,
            lambda: user(best.batch, 0, limit=best.batch),
            lambda s: user(best.batch, s),
        )
    except torch.OutOfMemoryError:
        notes.append(f"transformers `model.generate` at batch {best.batch}: OOM")
    ctx.device.free()
    if user_runs is not None:
        user_samples, user_counts = user_runs
        notes.append(
            f"transformers `model.generate(features, language=, task=)` at batch {best.batch}: "
            f"{work / user_samples.median:,.1f} RTFx [{work / user_samples.max:,.1f}-"
            f"{work / user_samples.min:,.1f}]"
        )
        if user_samples.median < samples.median:
            samples, counts = user_samples, user_counts
            notes.append("transformers baseline = `model.generate` (faster than GenerationMixin)")
    feature_s = statistics.median(feature_seconds)
    notes.append(
        f"transformers features (`WhisperFeatureExtractor(device={device.name!r})` + copy to "
        f"the device): {feature_s:.2f} s per {len(feats[0])} clips, NOT in its figure; with "
        f"them its best is {work / (samples.median + feature_s):,.1f} RTFx"
    )
    if best.peak_memory_bytes:
        notes.append(
            f"transformers peak memory at batch {best.batch}: "
            f"{best.peak_memory_bytes / 2**30:,.1f} GiB"
        )
    feats.clear()
    return Baseline(samples, batch, counts, notes)


def _user_generate(
    model: Any,
    features: torch.Tensor,
    batch: int,
    num_tokens: int,
    prompt: torch.Tensor,
    g: Any,
    **generate_kwargs: Any,
) -> list[int]:
    """transformers' user path, `model.generate(features, language=, task=)`, `batch` clips at
    a time with `num_tokens` forced; the generated tokens of each clip."""
    counts: list[int] = []
    for i in range(0, len(features), batch):
        out = model.generate(
            features[i : i + batch],
            language="en",
            task="transcribe",
            min_new_tokens=num_tokens,
            max_new_tokens=num_tokens,
            do_sample=False,
            use_cache=True,
            **generate_kwargs,
        )
        counts += generated_counts(out, _prompt_columns(out, prompt), g.eos_token_id)
    return counts


def _prompt_columns(sequences: torch.Tensor, prompt: torch.Tensor) -> int:
    """How many leading columns of a Whisper `generate` output are the decoder prompt (0 when
    it returns only the new tokens)."""
    n = prompt.shape[1]
    if sequences.shape[1] >= n and bool((sequences[:, :n] == prompt).all()):
        return n
    return 0


# ---------------------------------------------------------------- decode step at batch 256
def bench_turbo_step(ctx: Context) -> list[Row]:
    """Our decode-step time at batch 256 (turbo): (t(N tokens) - t(1 token)) / (N - 1) over
    the same number of fresh clips, per pair of runs; median of `repeats` pairs."""
    name = "whisper-large-v3-turbo"
    num_clips = ctx.num_inputs(ctx.sizes(256, 4))
    num_tokens = ctx.sizes(101, 6)
    cfg = whisper_config(ctx, 4)
    if name not in ctx.store.paths:
        model, _ = whisper_model(ctx, name, cfg)
        del model
        ctx.device.free()
    path = ctx.store.paths[name]
    engine_kwargs = ctx.engine_kwargs(ENGINE_KWARGS, TINY_ENGINE_KWARGS)
    long_run, short_run = transcribe_run(num_tokens), transcribe_run(1)

    def clips(input_set: int) -> np.ndarray:
        return make_clips(num_clips, seed=2000 + input_set)

    def measure(llm: Any) -> Any:
        from _harness import Samples

        short_run(llm, clips(1))  # warm the 1-token run too
        steps = []
        for i in range(1, ctx.repeats + 1):
            short_clips, long_clips = clips(2 * i), clips(2 * i + 1)
            t_short = timed(ctx.device, lambda c=short_clips: short_run(llm, c))[0]
            t_long = timed(ctx.device, lambda c=long_clips: long_run(llm, c))[0]
            steps.append((t_long - t_short) / (num_tokens - 1))
        return Samples(tuple(steps))

    runs = [
        run_ours(ctx, path, engine_kwargs, v, clips, long_run, measure)
        for v in variants_for(ctx, True)
    ]
    # Tokens 2..N are sampled at positions 4..N+2 (0-based; the prompt is 4 tokens).
    mean_position = 4 + (num_tokens - 2) // 2
    cost = enc_dec_step_cost(whisper_shape(cfg), num_clips, mean_position)
    spec = RowSpec(
        f"whisper-turbo decode step, batch {num_clips}",
        "ms/step",
        1.0,
        ctx.machine.floor_seconds(cost.flops, cost.bytes),
        expected=num_tokens,
        intro=f"(t({num_tokens} tokens) - t(1 token)) / {num_tokens - 1} over {num_clips} fresh "
        f"30 s clips each, median of {ctx.repeats} pairs; floor = one step reading the decoder "
        f"weights, LM head and {num_clips} requests' cross and self K/V at position "
        f"{mean_position}; the target (issue 20) is <= 4 ms",
    )
    return ours_rows(ctx, spec, None, runs)


# ---------------------------------------------------------------- beam search (RTFx)
BEAM_WIDTH = 5
BEAM_ENGINE_KWARGS = dict(
    max_num_seqs=384, max_num_batched_tokens=8192, max_num_encoder_input_tokens=1500 * 32
)
"""64 clips x 5 beams step as 320 requests at once."""


def beam_transcribe_run(num_tokens: int) -> Callable[[Any, np.ndarray], Any]:
    from v1 import SamplingParams

    # min_tokens = max_tokens: EOS is masked, every beam runs the forced length (as
    # transformers' min_new_tokens = max_new_tokens).
    params = SamplingParams(temperature=0, max_tokens=num_tokens, min_tokens=num_tokens)

    def run(llm: Any, clips: np.ndarray) -> Any:
        audio = [(clip, SAMPLE_RATE) for clip in clips]
        return llm.transcribe(
            audio,
            language="en",
            sampling_params=params,
            temperature=0.0,
            beam_size=BEAM_WIDTH,
            use_tqdm=False,
        )

    return run


def bench_whisper_beam(ctx: Context) -> list[Row]:
    """Whisper large-v3 shapes, beam search of width 5: our `LLM.transcribe(beam_size=5)`
    against transformers' `model.generate(features, num_beams=5)` (batch size swept)."""
    name = "whisper-large-v3"
    num_clips = ctx.num_inputs(ctx.sizes(64, 4))
    num_tokens = ctx.sizes(100, 5)
    cfg = whisper_config(ctx, 32)
    model, path = whisper_model(ctx, name, cfg)
    clip_sets: dict[int, np.ndarray] = {}

    def clips(input_set: int) -> np.ndarray:
        if input_set not in clip_sets:
            clip_sets[input_set] = make_clips(num_clips, seed=3000 + input_set)
        return clip_sets[input_set]

    baseline = None
    if not ctx.args.no_transformers:
        baseline = hf_whisper_beam(ctx, model, clips, num_tokens)
    model = None
    ctx.device.free()

    engine_kwargs = ctx.engine_kwargs(BEAM_ENGINE_KWARGS, TINY_ENGINE_KWARGS)
    run = beam_transcribe_run(num_tokens)
    runs = [run_ours(ctx, path, engine_kwargs, v, clips, run) for v in variants_for(ctx, True)]
    clip_sets.clear()
    spec = RowSpec(
        f"{name} beam {BEAM_WIDTH}",
        "RTFx",
        CLIP_SECONDS * num_clips,
        None,
        expected=num_tokens,
        intro=f"{num_clips} clips of 30 s, beam search of width {BEAM_WIDTH}, {num_tokens} "
        f"forced tokens (EOS masked); v1-engine: `LLM.transcribe(beam_size={BEAM_WIDTH})` "
        f"(beams as prefix-cached requests, one cross cache and one encoder run per clip), "
        f"log-mel on the device inside the timed region; engine {engine_kwargs}; no roofline "
        f"floor (beams make the work depend on the search)",
    )
    return ours_rows(ctx, spec, baseline, runs)


def hf_whisper_beam(
    ctx: Context, model: Any, clips: Callable[[int], np.ndarray], num_tokens: int
) -> Baseline:
    """transformers' `model.generate(features, language=, task=, num_beams=5)` swept over
    batch sizes, on precomputed features (their extraction is not timed)."""
    from transformers import WhisperFeatureExtractor

    device, g = ctx.device, model.generation_config
    extractor = WhisperFeatureExtractor(feature_size=model.config.num_mel_bins)
    feats = {
        input_set: extractor(
            list(clips(input_set)),
            sampling_rate=SAMPLE_RATE,
            return_tensors="pt",
            device=device.name,
        ).input_features.to(device.name, ctx.dtype)
        for input_set in range(ctx.repeats + 1)
    }
    prompt = torch.tensor([prompt_ids(g)], device=device.name)

    def run(batch: int, input_set: int, limit: int | None = None) -> list[int]:
        x = feats[input_set][:limit]
        return _user_generate(model, x, batch, num_tokens, prompt, g, num_beams=BEAM_WIDTH)

    plan = SweepPlan(
        batches=ctx.hf_batches(len(feats[0]), (64, 32, 16), (4, 2)),
        repeats=ctx.repeats,
        budget_s=ctx.args.hf_sweep_budget,
        exhaustive=bool(ctx.args.hf_batches),
    )
    sweep = sweep_batches(device, plan, lambda b: run(b, 0, limit=b), run)
    work = CLIP_SECONDS * len(feats[0])
    notes = [
        f"transformers `model.generate(num_beams={BEAM_WIDTH})` sweep: "
        f"{sweep.describe(work, 'RTFx')}"
    ]
    feats.clear()
    best = sweep.best
    if best is None:
        return Baseline(None, None, None, notes)
    if best.peak_memory_bytes:
        notes.append(
            f"transformers peak memory at batch {best.batch}: "
            f"{best.peak_memory_bytes / 2**30:,.1f} GiB"
        )
    return Baseline(best.samples, best.batch, best.counts, notes)
