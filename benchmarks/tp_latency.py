"""Tensor-parallel latency (issue 34): a Llama-3-8B-shaped decoder (bf16, random weights) and
Whisper large-v3 (fp16, random weights) at TP 1, 2 (and 4 where the GPUs exist), in one process.

Llama: per-token decode latency at batch 1 and 8 = (t(N tokens) - t(1 token)) / (N - 1) over
the same 128-token prompts (fresh ones per pair), and throughput at batch 256 (N tokens each,
tokens/s over the whole run). Whisper: one 30 s clip, 100 forced tokens, wall time of
`LLM.transcribe` (time to the last token). Medians of --repeats with [min-max]; every engine
warms on full-size inputs first. Keep the `__main__` guard (TP starts worker processes).

    python benchmarks/tp_latency.py                      # TP 1,2[,4]: Llama then Whisper
    python benchmarks/tp_latency.py --device cpu --tiny  # smoke run on CPU (TP 1 only)
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _context import asset, copy_tokenizer  # noqa: E402
from _whisper import make_clips, transcribe_run, whisper_config  # noqa: E402

LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)
LLAMA_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=51865,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
PROMPT_LEN = 128


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", default=None, help="comma list (default 1,2[,4] as GPUs allow)")
    p.add_argument("--parts", default="llama,whisper", help="llama and/or whisper")
    p.add_argument("--tokens", type=int, default=None, help="decode tokens (default 128)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--tokenizer", default=asset("whisper-base"), help="whisper-base folder")
    p.add_argument(
        "--profile-dir",
        default=None,
        help="profile Llama steps --profile-steps on every rank (V1_TORCH_PROFILER_DIR); "
        "prints each rank's NCCL share of device time",
    )
    p.add_argument(
        "--profile-steps",
        default="700:740",
        help="worker steps profiled (default: inside the batch-8 decode runs at 128 tokens)",
    )
    return p.parse_args(argv)


def _summary(values: list[float], scale: float = 1.0, fmt: str = ",.2f") -> str:
    vals = [v * scale for v in values]
    return f"{statistics.median(vals):{fmt}} [{min(vals):{fmt}}-{max(vals):{fmt}}]"


def build(args: argparse.Namespace, root: str, kind: str) -> str:
    """The random model folder (whisper-base's tokenizer: prompts are token ids)."""
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        WhisperFeatureExtractor,
    )
    from transformers import WhisperForConditionalGeneration as Whisper

    cuda = args.device.startswith("cuda")
    path = os.path.join(root, kind)
    torch.manual_seed(0)
    with torch.device(args.device):
        if kind == "llama":
            cfg = LlamaConfig(**(LLAMA_TINY if args.tiny else LLAMA_8B))
            model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16 if cuda else None)
        else:
            cfg = whisper_config(argparse.Namespace(tiny=args.tiny), 32)
            model = Whisper._from_config(cfg, dtype=torch.float16 if cuda else None)
            model.generation_config = GenerationConfig.from_pretrained(args.tokenizer)
    model.save_pretrained(path)
    copy_tokenizer(args.tokenizer, path)
    if kind == "whisper":
        WhisperFeatureExtractor(feature_size=cfg.num_mel_bins).save_pretrained(path)
    del model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return path


def with_engine(
    args: argparse.Namespace, path: str, tp: int, fn: Callable[[Any], Any], kind: str
) -> Any:
    from v1 import LLM

    cuda = args.device.startswith("cuda")
    kwargs: dict[str, Any] = dict(max_num_seqs=256, multiprocess=True)
    if kind == "llama":
        kwargs["max_model_len"] = 1024
    if not cuda:
        kwargs["kv_cache_memory_bytes"] = 64 << 20
    if tp > 1:
        kwargs["tensor_parallel_size"] = tp
    llm = None
    profile_dir = None
    if args.profile_dir and kind == "llama":
        profile_dir = os.path.join(args.profile_dir, f"{kind}-tp{tp}")
        os.environ["V1_TORCH_PROFILER_DIR"] = profile_dir
        os.environ["V1_TORCH_PROFILER_STEPS"] = args.profile_steps
    try:
        llm = LLM(path, dtype="auto", device=args.device, **kwargs)
        return fn(llm)
    except Exception as e:  # noqa: BLE001 - one TP size failing must not hide the others
        traceback.print_exc()
        return f"FAILED: {type(e).__name__}: {e}"
    finally:
        if llm is not None:
            llm.shutdown()
        os.environ.pop("V1_TORCH_PROFILER_DIR", None)
        if profile_dir is not None:
            for name in sorted(os.listdir(profile_dir)) if os.path.isdir(profile_dir) else []:
                with open(os.path.join(profile_dir, name)) as f:
                    print(f"profile {kind} TP {tp} {name}: {f.readline().strip()}", flush=True)
        gc.unfreeze()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        gc.freeze()


def llama_rows(args: argparse.Namespace, llm: Any, tp: int) -> list[str]:
    from v1 import SamplingParams

    tokens = args.tokens or (8 if args.tiny else 128)
    rng = np.random.default_rng(tp)

    def prompts(n: int) -> list[dict[str, list[int]]]:
        ids = rng.integers(100, 50000, size=(n, PROMPT_LEN))
        return [{"prompt_token_ids": row.tolist()} for row in ids]

    def run(n: int, max_tokens: int) -> float:
        params = SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
        )
        batch = prompts(n)
        t0 = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - t0

    rows = []
    for batch in (1, 8):
        run(batch, 1), run(batch, tokens)  # warm-up
        per_token = []
        for _ in range(args.repeats):
            t_short, t_long = run(batch, 1), run(batch, tokens)
            per_token.append((t_long - t_short) / (tokens - 1))
        rows.append(
            f"| Llama-3-8B shape, decode latency, batch {batch} | {tp} | "
            f"{_summary(per_token, 1e3)} ms/token |"
        )
    big = 8 if args.tiny else 256
    run(big, tokens)
    seconds = [run(big, tokens) for _ in range(args.repeats)]
    rates = [big * tokens / s for s in seconds]
    rows.append(
        f"| Llama-3-8B shape, throughput, batch {big} x {tokens} tokens | {tp} | "
        f"{_summary(rates, 1.0, ',.0f')} tok/s |"
    )
    return rows


def whisper_rows(args: argparse.Namespace, llm: Any, tp: int) -> list[str]:
    tokens = 5 if args.tiny else 100
    run = transcribe_run(tokens)
    run(llm, make_clips(1, seed=99))
    seconds = []
    for i in range(args.repeats + 2):
        clip = make_clips(1, seed=100 + i)
        t0 = time.perf_counter()
        run(llm, clip)
        seconds.append(time.perf_counter() - t0)
    return [
        f"| Whisper large-v3 shape, one 30 s clip x {tokens} tokens, time to last token | {tp} | "
        f"{_summary(seconds, 1e3, ',.1f')} ms |"
    ]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu --tiny", file=sys.stderr)
        return 2
    num_gpus = torch.cuda.device_count() if cuda else 1
    sizes = [int(t) for t in args.tp.split(",")] if args.tp else [1, 2, 4]
    sizes = [t for t in sizes if t <= num_gpus]
    names = [torch.cuda.get_device_name(i) for i in range(num_gpus)] if cuda else ["CPU"]
    header = (
        f"Machine: {', '.join(names)}; torch {torch.__version__}\n"
        f"Command: python3 benchmarks/tp_latency.py {shlex.join(argv)}"
    )
    print(header, flush=True)
    rows: list[str] = []
    with tempfile.TemporaryDirectory(prefix="v1tp-") as root:
        for part in args.parts.split(","):
            path = build(args, root, part)
            fn = llama_rows if part == "llama" else whisper_rows
            for tp in sizes:
                print(f"\n== {part}, tensor_parallel_size={tp}", flush=True)
                start = time.perf_counter()
                got = with_engine(args, path, tp, lambda llm, tp=tp, fn=fn: fn(args, llm, tp), part)
                rows += got if isinstance(got, list) else [f"| {part} | {tp} | {got} |"]
                print("\n".join(rows[-3:]), flush=True)
                print(f"== {time.perf_counter() - start:.1f} s", flush=True)
    print(f"\n{header}\n\n| workload | TP | median [min-max] |\n| --- | ---: | --- |")
    print("\n".join(rows))
    return 1 if any("FAILED" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
