"""Where a text workload's time goes: BERT-base embeddings or BART-large generation, shaped as
in `offline.py`, warmed on full-size inputs, then one run timed per EngineCore host phase
(schedule, launch, read-back, update) and one run under the torch profiler (device kernels,
host functions).

    python benchmarks/profile_text.py --workload bert --tokenizer ../shared/assets/all-MiniLM-L6-v2
    python benchmarks/profile_text.py --workload bart --tokenizer ../shared/assets/whisper-base
"""

from __future__ import annotations

import argparse
import collections
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _context import TOKENIZER_FILES
from profile_step import wrap


def build(args: argparse.Namespace) -> str:
    from transformers import BartConfig, BartForConditionalGeneration, BertConfig, BertModel

    if args.workload == "bert":
        cfg = BertConfig(architectures=["BertModel"])
        with torch.device("cuda"):
            model = BertModel(cfg, add_pooling_layer=False).half()
    else:
        cfg = BartConfig.from_dict(
            dict(
                d_model=1024,
                encoder_layers=12,
                decoder_layers=12,
                encoder_attention_heads=16,
                decoder_attention_heads=16,
                encoder_ffn_dim=4096,
                decoder_ffn_dim=4096,
                vocab_size=50265,
                max_position_embeddings=1024,
                architectures=["BartForConditionalGeneration"],
            )
        )
        with torch.device("cuda"):
            model = BartForConditionalGeneration(cfg).half()
    path = tempfile.mkdtemp(prefix=f"{args.workload}-prof-")
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:  # the tokenizer only (no sentence-transformers limits)
        if (Path(args.tokenizer) / name).is_file():
            shutil.copy(Path(args.tokenizer) / name, Path(path) / name)
    del model
    torch.cuda.empty_cache()
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", choices=("bert", "bart"), default="bert")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--inputs", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--trace", default=None, help="write a chrome trace here")
    args = parser.parse_args()

    from v1 import LLM, SamplingParams

    bert = args.workload == "bert"
    path = build(args)
    llm = LLM(
        path,
        dtype="float16",
        multiprocess=False,
        max_num_seqs=args.max_num_seqs or (512 if bert else 256),
        max_num_batched_tokens=args.max_num_batched_tokens or (32768 if bert else 16384),
    )
    num = args.inputs or (4096 if bert else 256)
    rng = np.random.default_rng(0)
    if bert:
        lengths = rng.integers(16, 513, size=num)
    else:
        lengths = np.full(num, 512)

    def inputs() -> list[dict[str, Any]]:
        return [
            {"prompt_token_ids": [101, *rng.integers(1000, 29000, size=n - 2).tolist(), 102]}
            for n in lengths
        ]

    params = SamplingParams(temperature=0, max_tokens=128, min_tokens=128, ignore_eos=True)

    def run(batch: list[dict[str, Any]]) -> Any:
        if bert:
            return llm.embed(batch, use_tqdm=False)
        return llm.generate(batch, params, use_tqdm=False)

    run(inputs())  # warm-up, full size
    core = llm.llm_engine.engine_core.engine_core
    runner = core.executor.worker.model_runner
    timings: dict[str, list[float]] = collections.defaultdict(list)
    wrap(timings, core.scheduler, "schedule")
    wrap(timings, core.scheduler, "update_from_output")
    wrap(timings, runner, "execute_model_async")
    # Inside execute_model_async: batch updates, input building, the main pass's launch (a
    # graph replay or eager kernels) and the pooling or sampling launch.
    wrap(timings, runner, "_update_states")
    wrap(timings, runner, "_prepare_inputs")
    wrap(timings, runner.state, "forward")
    wrap(timings, runner.state, "finish_step")
    wrap(timings, core, "step")
    wrap(timings, llm.llm_engine.input_processor, "process")
    wrap(timings, llm.llm_engine, "process_request")  # per request, before the first step
    wrap(timings, llm.llm_engine, "add_processed_request")  # per request: core admission
    wrap(timings, llm.llm_engine.output_processor, "process_outputs")
    batch = inputs()
    torch.cuda.synchronize()
    start = time.perf_counter()
    run(batch)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    tokens = int(lengths.sum()) if bert else num * 128
    print(f"unprofiled wall {wall:.3f} s, {tokens / wall:,.0f} tok/s")
    for name, values in timings.items():
        ms = np.array(values) * 1e3
        print(
            f"{name}: {len(ms)} calls, median {np.median(ms):.3f} ms, "
            f"p90 {np.percentile(ms, 90):.3f} ms, total {ms.sum():.0f} ms"
        )

    batch = inputs()
    torch.cuda.synchronize()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        run(batch)
        torch.cuda.synchronize()
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events)
    print(f"profiled: device kernel time {device_us / 1e6:.3f} s")
    print(events.table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=70))
    print(events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))
    if args.trace:
        prof.export_chrome_trace(args.trace)
    llm.shutdown()


if __name__ == "__main__":
    main()
