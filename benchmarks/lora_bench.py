"""Multi-LoRA cost on Whisper: random-weight whisper-large-v3-turbo (32 encoder + 4 decoder
layers, d_model 1280) transcribing 256 30 s clips of noise with 100 forced tokens each, without
LoRA and with 1, 4 and 16 distinct rank-16 adapters (every q/k/v/out/fc1/fc2 of the encoder,
the decoder and the cross-attention), the clips spread over the adapters round-robin. Prints
RTFx (audio seconds / wall seconds) and the LoRA cost as a fraction of the no-LoRA time
(both with per-layer cross-attention, which LoRA needs; the default mode's no-LoRA row is
printed too).

Adapters are written in PEFT's folder format directly (adapter_config.json +
adapter_model.safetensors), so the benchmark needs no PEFT.

    python benchmarks/lora_bench.py                       # the GPU run (the lead's)
    python benchmarks/lora_bench.py --device cpu --tiny   # smoke run: 2+2 layers, 4 clips
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import numpy as np
import torch
from _context import asset

SAMPLE_RATE = 16000
CLIP_SECONDS = 30
TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")


def whisper_config(tiny: bool) -> Any:
    from transformers import WhisperConfig

    if tiny:
        sizes = dict(d_model=64, enc=2, dec=2, heads=2, ffn=128, mel=80, vocab=51865)
    else:
        sizes = dict(d_model=1280, enc=32, dec=4, heads=20, ffn=5120, mel=128, vocab=51866)
    return WhisperConfig(
        d_model=sizes["d_model"],
        encoder_layers=sizes["enc"],
        decoder_layers=sizes["dec"],
        encoder_attention_heads=sizes["heads"],
        decoder_attention_heads=sizes["heads"],
        encoder_ffn_dim=sizes["ffn"],
        decoder_ffn_dim=sizes["ffn"],
        num_mel_bins=sizes["mel"],
        vocab_size=sizes["vocab"],
        max_source_positions=1500,
        max_target_positions=448,
        decoder_start_token_id=50258,
        pad_token_id=50257,
        bos_token_id=50257,
        eos_token_id=50257,
    )


def save_model(cfg: Any, path: str, tokenizer: str, dtype: torch.dtype) -> None:
    """The random model with whisper-base's tokenizer and generation config in `path`."""
    from transformers import GenerationConfig, WhisperFeatureExtractor
    from transformers import WhisperForConditionalGeneration as Whisper

    torch.manual_seed(0)
    model = Whisper(cfg).to(dtype)
    model.generation_config = GenerationConfig.from_pretrained(tokenizer)
    model.save_pretrained(path)
    for name in os.listdir(tokenizer):
        if "token" in name or name in ("vocab.json", "merges.txt", "normalizer.json"):
            shutil.copy(os.path.join(tokenizer, name), path)
    WhisperFeatureExtractor(feature_size=cfg.num_mel_bins).save_pretrained(path)


def lora_modules(cfg: Any) -> list[tuple[str, int, int]]:
    """(PEFT module name, in, out) of every targeted projection."""
    d, ffn = cfg.d_model, cfg.encoder_ffn_dim
    out = []
    for stack, num_layers in (("encoder", cfg.encoder_layers), ("decoder", cfg.decoder_layers)):
        attns = ["self_attn"] + (["encoder_attn"] if stack == "decoder" else [])
        for i in range(num_layers):
            prefix = f"model.{stack}.layers.{i}"
            for attn in attns:
                for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                    out.append((f"{prefix}.{attn}.{proj}", d, d))
            out += [(f"{prefix}.fc1", d, ffn), (f"{prefix}.fc2", ffn, d)]
    return out


def save_adapter(cfg: Any, path: str, rank: int, seed: int) -> None:
    """A random rank-`rank` LoRA adapter in PEFT's folder format."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, k, n in lora_modules(cfg):
        key = f"base_model.model.{name}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(rank, k, generator=gen) * k**-0.5
        tensors[f"{key}.lora_B.weight"] = torch.randn(n, rank, generator=gen) * 0.01
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)


def run(
    args: argparse.Namespace,
    model_dir: str,
    adapters: list[str],
    clips: np.ndarray,
    cross_attention: str = "auto",
) -> list[float]:
    """Seconds of each of `args.repeats` timed transcription passes (after a warm-up pass on
    the full-size clips) with `adapters` (empty: LoRA off); each pass gets fresh audio."""
    from v1 import LLM, LoRARequest, SamplingParams

    engine_kwargs: dict[str, Any] = dict(
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=8192,
        cross_attention=cross_attention,
    )
    if args.tiny:
        engine_kwargs.update(max_num_seqs=8, max_num_batched_tokens=512, num_kv_blocks=2048)
    if adapters:
        engine_kwargs.update(enable_lora=True, max_loras=len(adapters), max_lora_rank=args.rank)
    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(adapters)]
    per_clip = [loras[i % len(loras)] for i in range(len(clips))] if loras else None
    params = SamplingParams(temperature=0.0, max_tokens=args.num_tokens, ignore_eos=True)
    prompts = [{"prompt": "", "multi_modal_data": {"audio": (clip, SAMPLE_RATE)}} for clip in clips]
    with LLM(model_dir, multiprocess=False, **engine_kwargs) as llm:
        llm.generate(prompts, params, use_tqdm=False, lora_request=per_clip)  # warm-up
        seconds = []
        for k in range(args.repeats):
            # Fresh audio for each timed pass: the encoder cache must not serve it.
            scale = np.float32(0.5 - 0.05 * k)
            prompts = [
                {"prompt": "", "multi_modal_data": {"audio": (clip * scale, SAMPLE_RATE)}}
                for clip in clips
            ]
            if args.device != "cpu":
                torch.cuda.synchronize()
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=per_clip)
            seconds.append(time.perf_counter() - start)
            assert all(len(o.outputs[0].token_ids) == args.num_tokens for o in outs)
    return seconds


def _row(adapters: Any, seconds: list[float], audio_seconds: float, base: float | None) -> dict:
    median = statistics.median(seconds)
    return dict(
        adapters=adapters,
        seconds=median,
        spread=[min(seconds), max(seconds)],
        rtfx=audio_seconds / median,
        lora_cost=None if base is None else median / base - 1.0,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="2+2-layer model, 4 clips (smoke)")
    parser.add_argument("--num-clips", type=int, default=None, help="default 256 (tiny: 4)")
    parser.add_argument("--num-tokens", type=int, default=None, help="default 100 (tiny: 4)")
    parser.add_argument("--adapters", default="1,4,16", help="adapter counts to compare")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--tokenizer", default=asset("whisper-base"))
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per row (median)")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    args.num_clips = args.num_clips or (4 if args.tiny else 256)
    args.num_tokens = args.num_tokens or (4 if args.tiny else 100)
    counts = [int(c) for c in args.adapters.split(",")]
    cfg = whisper_config(args.tiny)
    rng = np.random.default_rng(0)
    clips = rng.standard_normal((args.num_clips, SAMPLE_RATE * CLIP_SECONDS), dtype=np.float32)
    clips *= np.float32(0.1)
    audio_seconds = args.num_clips * CLIP_SECONDS
    rows = []
    with tempfile.TemporaryDirectory() as root:
        model_dir = os.path.join(root, "model")
        dtype = torch.float32 if args.device == "cpu" else torch.float16
        save_model(cfg, model_dir, args.tokenizer, dtype)
        adapters = []
        for i in range(max(counts)):
            adapters.append(os.path.join(root, f"adapter{i}"))
            save_adapter(cfg, adapters[-1], args.rank, seed=i)
        # LoRA runs per-layer cross-attention (adapters change the cross K/V projections);
        # the cost is measured against the same mode, the default (auto) shown beside it.
        rows.append(_row("0 (auto)", run(args, model_dir, [], clips), audio_seconds, None))
        rows.append(_row(0, run(args, model_dir, [], clips, "per_layer"), audio_seconds, None))
        base = rows[-1]["seconds"]
        rows[-1]["lora_cost"] = 0.0
        for count in counts:
            seconds = run(args, model_dir, adapters[:count], clips)
            rows.append(_row(count, seconds, audio_seconds, base))
    print(
        f"whisper-large-v3-turbo{' (tiny)' if args.tiny else ''}: {args.num_clips} clips, "
        f"{args.num_tokens} tokens each, rank {args.rank}, device {args.device}"
    )
    print(f"medians of {args.repeats} timed passes [min-max seconds]")
    print(f"{'adapters':>9} {'seconds':>9} {'spread':>15} {'RTFx':>9} {'LoRA cost':>10}")
    for row in rows:
        cost = "" if row["lora_cost"] is None else f"{row['lora_cost']:>+10.1%}"
        spread = f"[{row['spread'][0]:.2f}-{row['spread'][1]:.2f}]"
        print(
            f"{row['adapters']!s:>9} {row['seconds']:>9.2f} {spread:>15} {row['rtfx']:>9.1f} "
            f"{cost:>10}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
