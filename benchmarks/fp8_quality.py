"""Which fp8 recipe keeps real whisper-base's words (issue 35 item 3: fp8 WER within 0.5 points
of fp16): the real weights on the real-speech workload of `whisper-base-real` (`_real_speech`:
fresh shifted/scaled variants of the LibriSpeech and JFK clips, EOS-ended greedy), one engine
per recipe, each warmed on one input set and timed on the next: WER against the references,
transcripts that differ from the fp16 engine's, and RTFx (one timed run: indicative).

    python3 benchmarks/fp8_quality.py --num-inputs 256
    python3 benchmarks/fp8_quality.py --device cpu --num-inputs 6 --recipes fp16,default  # smoke
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _context import asset  # noqa: E402
from _real_speech import load_clips, make_inputs, wer  # noqa: E402
from _whisper_real import _ours_run  # noqa: E402

DECODER_KEEP = (
    r"re:model\.decoder\.layers\.\d+\.(self_attn\.\w+|encoder_attn\.(q_proj|out_proj)|fc1|fc2)"
)
BASE_KEEP = ["model.encoder.layers.0", "model.encoder.layers.1", DECODER_KEEP]
"""Encoder layers 0-1 and the decoder's per-token GEMMs: the model's recipe before session 29
(which added every encoder fc2: "keep-enc-fc2" is today's default)."""
CROSS_KV = r"re:model\.decoder\.layers\.\d+\.encoder_attn\.kv_proj"
RECIPES: dict[str, list[str] | None] = {
    "fp16": None,  # not quantized
    "default": None,  # the model's recipe (WhisperForConditionalGeneration.fp8_keep)
    "all": [],  # every Linear fp8
    "base": BASE_KEEP,
    "keep-cross-kv": [*BASE_KEEP, CROSS_KV],
    "keep-enc0-2": [*BASE_KEEP, "model.encoder.layers.2"],
    "keep-enc0-2-cross-kv": [*BASE_KEEP, "model.encoder.layers.2", CROSS_KV],
    "keep-enc-attn": [*BASE_KEEP, r"re:model\.encoder\.layers\.\d+\.self_attn\.\w+"],
    "keep-enc-fc1": [*BASE_KEEP, r"re:model\.encoder\.layers\.\d+\.fc1"],
    "keep-enc-fc2": [*BASE_KEEP, r"re:model\.encoder\.layers\.\d+\.fc2"],
    "keep-last-enc": [*BASE_KEEP, "model.encoder.layers.5"],
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--num-inputs", type=int, default=256)
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--whisper-base", default=None)
    p.add_argument("--audio-dir", default=None)
    args = p.parse_args()
    from v1 import LLM

    path = args.whisper_base or asset("whisper-base")
    clips = load_clips(args.audio_dir)
    warm, timed_set = make_inputs(clips, args.num_inputs, 0), make_inputs(clips, args.num_inputs, 1)
    run = _ours_run()
    dtype = "float16" if args.device.startswith("cuda") else "float32"
    fp16_texts: list[str] | None = None
    print("| recipe | WER % | transcripts differing from fp16 | RTFx (one run) |")
    print("|---|---:|---:|---:|")
    for name in args.recipes.split(","):
        kwargs: dict = {} if name == "fp16" else {"quantization": "fp8"}
        if name not in ("fp16", "default"):
            kwargs["fp8_ignore"] = RECIPES[name]
        if not args.device.startswith("cuda"):
            kwargs["kv_cache_memory_bytes"] = 256 << 20
        llm = LLM(path, dtype=dtype, device=args.device, **kwargs)
        try:
            run(llm, warm)
            start = time.perf_counter()
            texts = [o.text for o in run(llm, timed_set)]
            wall = time.perf_counter() - start
        finally:
            llm.shutdown()
            del llm
            gc.collect()
        if name == "fp16":
            fp16_texts = texts
        differ = (
            sum(a.strip() != b.strip() for a, b in zip(texts, fp16_texts, strict=True))
            if fp16_texts is not None
            else "-"
        )
        print(
            f"| {name} | {100 * wer(timed_set.references, texts):.2f} | {differ} | "
            f"{timed_set.seconds / wall:,.0f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
