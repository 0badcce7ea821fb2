"""One Whisper request at a time (a server's quiet hours, a realtime turn): the wall of
`LLM.transcribe` on one fresh 7 s clip with `--tokens` forced tokens, for random weights of a
whisper-tiny / base / small / large-v3-turbo shape (fp16, the engine's defaults, core in this
process). Median [min-max] of `--repeats` requests after `--warmup` ones. CUDA only. One shape
a process: with several engines made one after another in one process (an earlier form of
this script), the second one's rows were missing from the output (session 28, not diagnosed).

    python3 benchmarks/whisper_request_latency.py --tokenizer ../shared/assets/whisper-base --shape base
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))

SHAPES = {
    "tiny": dict(d_model=384, layers=4, heads=6, mels=80),
    "base": dict(d_model=512, layers=6, heads=8, mels=80),
    "small": dict(d_model=768, layers=12, heads=12, mels=80),
    "turbo": dict(d_model=1280, layers=32, heads=20, mels=128, decoder_layers=4),
}


def build(shape: dict, tokenizer: str, root: str) -> str:
    from _context import copy_tokenizer
    from _whisper import shaped_whisper_config
    from transformers import GenerationConfig, WhisperFeatureExtractor
    from transformers import WhisperForConditionalGeneration as Whisper

    d, layers = shape["d_model"], shape["layers"]
    cfg = shaped_whisper_config(
        d,
        layers,
        shape.get("decoder_layers", layers),
        heads=shape["heads"],
        ffn=4 * d,
        mels=shape["mels"],
    )
    torch.manual_seed(0)
    model = Whisper(cfg).half()
    model.generation_config = GenerationConfig.from_pretrained(tokenizer)
    path = tempfile.mkdtemp(prefix="whisper-lat-", dir=root)
    model.save_pretrained(path)
    copy_tokenizer(tokenizer, path)
    WhisperFeatureExtractor(feature_size=shape["mels"]).save_pretrained(path)
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", default="../shared/assets/whisper-base")
    p.add_argument("--shape", default="base", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()

    from v1 import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    rng = np.random.default_rng(0)
    root = tempfile.mkdtemp(prefix="whisper-lat-")
    print(f"| shape | ms a request, median [min-max] of {args.repeats} | encoder graphs |")
    print("|---|---:|---|")
    name = args.shape
    try:
        llm = LLM(build(SHAPES[name], args.tokenizer, root), dtype="float16", multiprocess=False)
        try:
            state = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.state
            graphed = getattr(state, "encoder_graphs", None) is not None
            walls = []
            for i in range(args.warmup + args.repeats):
                clip = (0.1 * rng.standard_normal(7 * 16_000)).astype(np.float32)
                torch.cuda.synchronize()
                start = time.perf_counter()
                llm.transcribe((clip, 16_000), params, language="en", temperature=0.0)
                if i >= args.warmup:
                    walls.append((time.perf_counter() - start) * 1e3)
            print(
                f"| {name} | {statistics.median(walls):.1f} [{min(walls):.1f}-"
                f"{max(walls):.1f}] | {'yes' if graphed else 'no'} |",
                flush=True,
            )
        finally:
            llm.shutdown()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
