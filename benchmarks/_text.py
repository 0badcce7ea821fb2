"""Text workloads: BART-large generation, BERT-base embeddings, a Llama-1B-shaped decoder, and
the host overhead of a decode step (tiny model, eager vs CUDA graphs).

Inputs are random token ids, fresh for every run; generation lengths are forced on both sides
(`min_new_tokens = max_new_tokens` for transformers, `ignore_eos` for us).
"""

from __future__ import annotations

import functools
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
from _harness import Samples, SweepPlan, generated_counts, sweep_batches, timed
from _report import Row
from _roofline import (
    DecoderShape,
    EncDecShape,
    EncoderShape,
    decoder_cost,
    enc_dec_cost,
    encoder_cost,
)


def _sweep_baseline(
    ctx: Context,
    batches: tuple[int, ...],
    warm: Callable[[int], Any],
    run: Callable[[int, int], list[int]],
    work: float,
    unit: str,
) -> Baseline:
    plan = SweepPlan(
        batches=batches,
        repeats=ctx.repeats,
        budget_s=ctx.args.hf_sweep_budget,
        exhaustive=bool(ctx.args.hf_batches),
    )
    sweep = sweep_batches(ctx.device, plan, warm, run)
    notes = [f"transformers sweep: {sweep.describe(work, unit)}"]
    best = sweep.best
    if best is None:
        return Baseline(None, None, None, notes)
    if best.peak_memory_bytes:
        notes.append(
            f"transformers peak memory at batch {best.batch}: "
            f"{best.peak_memory_bytes / 2**30:,.1f} GiB"
        )
    return Baseline(best.samples, best.batch, best.counts, notes)


def _generate_run(num_tokens: int) -> Callable[[Any, list[dict[str, Any]]], Any]:
    from v1 import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    return lambda llm, prompts: llm.generate(prompts, params, use_tqdm=False)


def _generation_config(num_tokens: int, **ids: int) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(
        min_new_tokens=num_tokens,
        max_new_tokens=num_tokens,
        do_sample=False,
        num_beams=1,
        use_cache=True,
        **ids,
    )


# ---------------------------------------------------------------- BART
def bench_bart(ctx: Context) -> list[Row]:
    from transformers import BartConfig, BartForConditionalGeneration, GenerationConfig

    num = ctx.num_inputs(ctx.sizes(256, 4))
    in_len, out_len = ctx.sizes((512, 128), (32, 5))
    d, layers, heads, ffn = ctx.sizes((1024, 12, 16, 4096), (64, 2, 2, 128))
    cfg = BartConfig(
        vocab_size=50265,
        d_model=d,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=ffn,
        decoder_ffn_dim=ffn,
        max_position_embeddings=1024,
        forced_eos_token_id=None,
        forced_bos_token_id=None,
        attn_implementation="sdpa",
    )
    ids = dict(bos_token_id=0, pad_token_id=1, eos_token_id=2, decoder_start_token_id=2)
    model = build_model(ctx, BartForConditionalGeneration, cfg)
    model.generation_config = GenerationConfig(**ids)
    path = ctx.store.save("bart-large", model, lambda p: copy_tokenizer(ctx.args.tokenizer, p))

    def make(input_set: int) -> np.ndarray:
        rng = np.random.default_rng(3000 + input_set)
        x = rng.integers(4, 50000, size=(num, in_len))
        x[:, 0], x[:, -1] = 0, 2
        return x

    sets = functools.cache(make)  # input set -> inputs, built once
    total = num * out_len
    baseline = None
    if not ctx.args.no_transformers:
        gen_config = _generation_config(out_len, **ids)
        on_device: dict[int, torch.Tensor] = {}

        def hf(batch: int, input_set: int, limit: int | None = None) -> list[int]:
            if input_set not in on_device:
                on_device[input_set] = torch.from_numpy(sets(input_set)).to(ctx.device.name)
            x = on_device[input_set][:limit]
            counts: list[int] = []
            for i in range(0, len(x), batch):
                chunk = x[i : i + batch]
                out = model.generate(
                    input_ids=chunk,
                    attention_mask=torch.ones_like(chunk),
                    generation_config=gen_config,
                )
                counts += generated_counts(out, 1, ids["eos_token_id"])
            return counts

        baseline = _sweep_baseline(
            ctx,
            ctx.hf_batches(num, (256, 128, 64, 32), (4, 2)),
            lambda b: hf(b, 0, limit=b),
            hf,
            total,
            "tok/s",
        )
        on_device.clear()
    model = None  # free transformers' copy before our engine sizes its cache
    ctx.device.free()

    engine_kwargs = ctx.engine_kwargs(
        dict(max_num_seqs=256, max_num_batched_tokens=16384, max_num_encoder_input_tokens=65536),
        dict(
            max_num_seqs=8,
            max_num_batched_tokens=512,
            max_num_encoder_input_tokens=512,
            max_encoder_input_len=512,
        ),
    )

    def prompts(input_set: int) -> list[dict[str, Any]]:
        return [{"prompt_token_ids": row.tolist()} for row in sets(input_set)]

    runs = [
        run_ours(ctx, path, engine_kwargs, v, prompts, _generate_run(out_len))
        for v in variants_for(ctx, True)
    ]
    shape = EncDecShape(d, layers, layers, ffn, cfg.vocab_size, enc_len=in_len)
    cost = enc_dec_cost(shape, num, prompt_len=1, new_tokens=out_len)
    spec = RowSpec(
        "bart-large",
        "tok/s",
        total,
        ctx.machine.floor_seconds(cost.flops, cost.bytes),
        expected=out_len,
        intro=f"{num} inputs, {in_len} tokens in / {out_len} forced out; engine {engine_kwargs}",
    )
    return ours_rows(ctx, spec, baseline, runs)


# ---------------------------------------------------------------- BERT
def bench_bert(ctx: Context) -> list[Row]:
    from transformers import BertConfig, BertModel

    num = ctx.num_inputs(ctx.sizes(4096, 16))
    max_len = ctx.sizes(512, 64)
    d, layers, heads, ffn = ctx.sizes((768, 12, 12, 3072), (64, 2, 2, 128))
    cfg = BertConfig(
        hidden_size=d,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=ffn,
        architectures=["BertModel"],
        attn_implementation="sdpa",
    )
    model = build_model(ctx, BertModel, cfg, add_pooling_layer=False)
    path = ctx.store.save("bert-base", model, lambda p: copy_tokenizer(ctx.args.bert_tokenizer, p))
    lengths = np.random.default_rng(0).integers(16, max_len + 1, size=num)

    def make(input_set: int) -> list[np.ndarray]:
        rng = np.random.default_rng(4000 + input_set)
        return [
            np.concatenate([[101], rng.integers(1000, 29000, size=n - 2), [102]]) for n in lengths
        ]

    sets = functools.cache(make)  # input set -> inputs, built once
    total = int(lengths.sum())
    baseline = None
    if not ctx.args.no_transformers:

        def hf(batch: int, input_set: int) -> list[int]:
            return _hf_embed(ctx, model, sets(input_set), batch)

        baseline = _sweep_baseline(
            ctx,
            ctx.hf_batches(num, (256, 128, 64, 32), (8, 4)),
            lambda b: hf(b, 0),
            hf,
            total,
            "tok/s",
        )
        baseline.notes.insert(
            0,
            "transformers: inputs sorted by length before batching (as sentence-transformers' "
            "`encode`), padded per batch, mean pooling + L2 normalize, vectors copied to host",
        )
    model = None  # free transformers' copy before our engine sizes its cache
    ctx.device.free()

    engine_kwargs = ctx.engine_kwargs(
        dict(max_num_seqs=512, max_num_batched_tokens=32768),
        dict(max_num_seqs=8, max_num_batched_tokens=512),
    )

    def prompts(input_set: int) -> list[dict[str, Any]]:
        return [{"prompt_token_ids": s.tolist()} for s in sets(input_set)]

    def run(llm: Any, batch: list[dict[str, Any]]) -> Any:
        return llm.embed(batch, use_tqdm=False)

    runs = [run_ours(ctx, path, engine_kwargs, v, prompts, run) for v in variants_for(ctx, False)]
    cost = encoder_cost(EncoderShape(d, layers, ffn), lengths.tolist())
    spec = RowSpec(
        "bert-base",
        "tok/s",
        total,
        ctx.machine.floor_seconds(cost.flops, cost.bytes),
        expected=1,
        intro=f"{num} inputs of 16-{max_len} tokens ({total:,} tokens), `LLM.embed`; "
        f"engine {engine_kwargs}",
    )
    return ours_rows(ctx, spec, baseline, runs)


def _hf_embed(ctx: Context, model: Any, seqs: list[np.ndarray], batch: int) -> list[int]:
    """`hf_mean_embeddings` on the run's device; returns 1 per input that got a vector."""
    vectors = hf_mean_embeddings(model, seqs, batch, ctx.device.name)
    return [int(v is not None and v.ndim == 1) for v in vectors]


def hf_mean_embeddings(
    model: Any, seqs: list[np.ndarray], batch: int, device: str
) -> list[torch.Tensor | None]:
    """sentence-transformers' `encode` loop on token ids: longest first, one padded batch at a
    time, mean pooling, normalize, to host; one [H] float32 vector per input, in input order."""
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    vectors: list[torch.Tensor | None] = [None] * len(seqs)
    with torch.inference_mode():
        for start in range(0, len(order), batch):
            chunk = order[start : start + batch]
            width = max(len(seqs[i]) for i in chunk)
            ids = np.zeros((len(chunk), width), dtype=np.int64)
            mask = np.zeros_like(ids)
            for row, i in enumerate(chunk):
                ids[row, : len(seqs[i])] = seqs[i]
                mask[row, : len(seqs[i])] = 1
            ids_t = torch.from_numpy(ids).to(device)
            mask_t = torch.from_numpy(mask).to(device)
            hidden = model(input_ids=ids_t, attention_mask=mask_t).last_hidden_state
            m = mask_t.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * m).sum(1) / m.sum(1)
            out = torch.nn.functional.normalize(pooled.float(), dim=-1).cpu()
            for row, i in enumerate(chunk):
                vectors[i] = out[row]
    return vectors


# ---------------------------------------------------------------- Llama
def bench_llama(ctx: Context) -> list[Row]:
    from transformers import LlamaConfig, LlamaForCausalLM

    num = ctx.num_inputs(ctx.sizes(64, 4))
    in_len, out_len = ctx.sizes((128, 256), (16, 5))
    d, layers, heads, kv_heads, ffn, vocab = ctx.sizes(
        (2048, 16, 32, 8, 8192, 128256), (64, 2, 4, 2, 128, 51865)
    )
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="sdpa",
    )
    model = build_model(ctx, LlamaForCausalLM, cfg)
    path = ctx.store.save("llama-1b", model, lambda p: copy_tokenizer(ctx.args.tokenizer, p))

    def make(input_set: int) -> np.ndarray:
        return np.random.default_rng(5000 + input_set).integers(3, 50000, size=(num, in_len))

    sets = functools.cache(make)  # input set -> inputs, built once
    total = num * out_len
    baseline = None
    if not ctx.args.no_transformers:
        gen_config = _generation_config(out_len, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        on_device: dict[int, torch.Tensor] = {}

        def hf(batch: int, input_set: int, limit: int | None = None) -> list[int]:
            if input_set not in on_device:
                on_device[input_set] = torch.from_numpy(sets(input_set)).to(ctx.device.name)
            x = on_device[input_set][:limit]
            counts: list[int] = []
            for i in range(0, len(x), batch):
                chunk = x[i : i + batch]
                out = model.generate(
                    input_ids=chunk,
                    attention_mask=torch.ones_like(chunk),
                    generation_config=gen_config,
                )
                counts += generated_counts(out, in_len, 2)
            return counts

        batches = ctx.hf_batches(num, (64, 32), (4, 2))
        baseline = _sweep_baseline(ctx, batches, lambda b: hf(b, 0, limit=b), hf, total, "tok/s")
        on_device.clear()
    model = None  # free transformers' copy before our engine sizes its cache
    ctx.device.free()

    engine_kwargs = ctx.engine_kwargs(
        dict(max_num_seqs=256, max_num_batched_tokens=16384),
        dict(max_num_seqs=8, max_num_batched_tokens=256),
    )

    def prompts(input_set: int) -> list[dict[str, Any]]:
        return [{"prompt_token_ids": row.tolist()} for row in sets(input_set)]

    runs = [
        run_ours(ctx, path, engine_kwargs, v, prompts, _generate_run(out_len))
        for v in variants_for(ctx, False)
    ]
    cost = decoder_cost(DecoderShape(d, layers, heads, kv_heads, ffn, vocab), num, in_len, out_len)
    spec = RowSpec(
        f"llama-1b, batch {num}",
        "tok/s",
        total,
        ctx.machine.floor_seconds(cost.flops, cost.bytes),
        expected=out_len,
        intro=f"{num} prompts, {in_len} tokens in / {out_len} forced out; engine {engine_kwargs}",
    )
    return ours_rows(ctx, spec, baseline, runs)


# ---------------------------------------------------------------- host overhead
def bench_host_overhead(ctx: Context) -> list[Row]:
    """Time per decode step of the whole `LLM.generate` loop on a tiny 4-layer Llama (device
    time negligible): eager vs CUDA graphs. Ours only."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=51865,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        attn_implementation="sdpa",
    )
    model = build_model(ctx, LlamaForCausalLM, cfg)
    path = ctx.store.save("tiny-llama", model, lambda p: copy_tokenizer(ctx.args.tokenizer, p))
    del model
    batch, steps = ctx.sizes((64, 256), (4, 8))

    def prompts(input_set: int) -> list[dict[str, Any]]:
        base = 5 + 1000 * input_set
        return [{"prompt_token_ids": [base + i, 6, 7, 8]} for i in range(batch)]

    run = _generate_run(steps)

    def measure(llm: Any) -> Samples:
        seconds = []
        for input_set in range(1, ctx.repeats + 1):
            batch_prompts = prompts(input_set)
            seconds.append(timed(ctx.device, lambda p=batch_prompts: run(llm, p))[0] / steps)
        return Samples(tuple(seconds))

    rows = []
    for eager in (True, False):
        kwargs = ctx.engine_kwargs(
            dict(max_num_seqs=batch, enforce_eager=eager),
            dict(max_num_seqs=batch, enforce_eager=eager),
        )
        mode = "eager" if eager else "CUDA graphs" if ctx.device.is_cuda else "no graphs on CPU"
        runs = [
            run_ours(ctx, path, kwargs, v, prompts, run, measure) for v in variants_for(ctx, False)
        ]
        spec = RowSpec(
            f"host overhead, decode step, batch {batch} ({mode})",
            "us/step",
            1.0,
            None,
            expected=steps,
            intro=f"whole `LLM.generate` loop per step, {steps} steps of a 4-layer d=256 Llama",
        )
        rows += ours_rows(ctx, spec, None, runs)
    return rows
