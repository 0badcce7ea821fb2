"""Host time of the pooling path per engine step and per request, on CPU, with a tiny random
BERT (1 layer, hidden 32) so that the model's kernels are small beside the host work: 4096
inputs of 16-512 tokens through `LLM.embed` (the H100 workload's shape), each runner and core
phase timed (median per step, and per request where that is the unit).

    python3 benchmarks/pooling_host.py --tokenizer .bench_assets/minilm [--runs 3] [--cprofile]

--host-only replaces the model's main pass by zeros of its output's shape: on CPU the pass
takes ~250 ms a step and evicts the host's caches between the phases timed, where on a GPU
host the phases run back to back with the device working meanwhile; this times them so (and
~30x faster).

With --host-only, `--runs` uninstrumented runs come first: this process's CPU time per run
(`time.process_time`, steadier than wall time on a shared machine) less the pooling's own CPU
compute (`Pooler.launch`: a kernel launch on a GPU), per run, per step and per request. The
issue 35 workload (all-MiniLM-L6-v2, 4096 inputs of 16-256 tokens):

    python3 benchmarks/pooling_host.py --model ../shared/assets/all-MiniLM-L6-v2 --host-only
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import numpy as np
import torch
from _context import TOKENIZER_FILES
from profile_step import wrap

PER_STEP = (
    "schedule",
    "execute_model_async",
    "_update_states",
    "_prepare_inputs",
    "prepare_step",
    "forward",
    "finish_step",
    "get_output",
    "update_from_output",
)
PER_REQUEST = ("process_request", "add_processed_request", "to_embedding_output")
"""`to_embedding_output`: EmbeddingRequestOutput.from_base (the float list of a vector), done
as each output arrives, between steps."""


def build(tokenizer: str, hidden_size: int = 32) -> str:
    """A tiny random BertModel saved with the real tokenizer beside it."""
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        hidden_size=hidden_size,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        architectures=["BertModel"],
    )
    torch.manual_seed(0)
    path = tempfile.mkdtemp(prefix="bert-host-")
    BertModel(cfg, add_pooling_layer=False).save_pretrained(path)
    for name in TOKENIZER_FILES:  # the tokenizer only (no sentence-transformers limits)
        if (Path(tokenizer) / name).is_file():
            shutil.copy(Path(tokenizer) / name, Path(path) / name)
    return path


ARRAYS = False
"""--arrays: prompt_token_ids as 1-D int64 numpy arrays instead of lists."""


def inputs(num: int, seed: int, max_len: int = 512) -> list[dict[str, Any]]:
    """`num` token-id prompts of 16-`max_len` tokens (in random order, as bert_embed.py
    hands them to `LLM.embed`): lists, or with --arrays numpy arrays."""
    rng = np.random.default_rng(seed)
    out = []
    for n in rng.integers(16, max_len + 1, size=num):
        ids = np.concatenate([[101], rng.integers(1000, 29000, size=n - 2), [102]])
        out.append({"prompt_token_ids": ids if ARRAYS else ids.tolist()})
    return out


def instrument(llm: Any, timings: dict[str, list[float]]) -> None:
    from v1.worker.model_states.encoder_only import PendingPoolingStep

    core = llm.llm_engine.engine_core.engine_core
    runner = core.executor.worker.model_runner
    wrap(timings, core.scheduler, "schedule")
    wrap(timings, core.scheduler, "update_from_output")
    for name in ("execute_model_async", "_update_states", "_prepare_inputs"):
        wrap(timings, runner, name)
    for name in ("prepare_step", "forward", "finish_step"):
        wrap(timings, runner.state, name)
    wrap(timings, PendingPoolingStep, "get_output")
    wrap(timings, llm.llm_engine, "process_request")
    wrap(timings, llm.llm_engine, "add_processed_request")
    from v1.outputs import EmbeddingRequestOutput

    # A plain function on the class stays a plain function when read from it (staticmethod).
    wrap(timings, EmbeddingRequestOutput, "from_base", "to_embedding_output")


def skip_model(llm: Any) -> None:
    """The main pass returns zeros of its output's shape (--host-only)."""
    state = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.state
    hidden_size = state.model_config.hf_config.hidden_size
    # One buffer for every step (a fresh [T, H] tensor a step costs its page faults).
    out = torch.randn(state.config.scheduler_config.max_num_batched_tokens, hidden_size)

    def forward(step: Any, so: Any) -> torch.Tensor:
        return out[: len(step.input_ids)]

    state.forward = forward


def host_cpu_time(llm: Any, runs: int, batch_of: Any) -> None:
    """Prints the median host CPU time of `runs` uninstrumented `embed` runs, less the pooling's
    CPU compute (see the module docstring)."""
    from v1.models.layers.pooler import Pooler

    launch = Pooler.launch
    pooling: list[float] = []

    def timed_launch(self: Any, *a: Any, **k: Any) -> Any:
        start = time.process_time()
        try:
            return launch(self, *a, **k)
        finally:
            pooling.append(time.process_time() - start)

    Pooler.launch = timed_launch  # type: ignore[method-assign]
    hosts, steps = [], []
    try:
        for run in range(runs):
            batch = batch_of(run)
            pooling.clear()
            start = time.process_time()
            out = llm.embed(batch, use_tqdm=False)
            hosts.append(time.process_time() - start - sum(pooling))
            steps.append(len(pooling))
            del out
    finally:
        Pooler.launch = launch  # type: ignore[method-assign]
    host, num_steps = float(np.median(hosts)), int(np.median(steps))
    print(
        f"host CPU time per run: median {host * 1e3:.1f} ms (runs: "
        f"{', '.join(f'{h * 1e3:.0f}' for h in hosts)}); {num_steps} steps: "
        f"{host / num_steps * 1e6:,.0f} us per step, {host / len(batch) * 1e6:.1f} us per request",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", default=".bench_assets/minilm")
    parser.add_argument("--inputs", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cprofile", action="store_true", help="also profile one run")
    parser.add_argument("--host-only", action="store_true", help="no model pass (see above)")
    parser.add_argument(
        "--hidden-size",
        type=int,
        default=32,
        help="the vectors' width (768: BERT-base's outputs; the conversion to float lists "
        "scales with it); use with --host-only for widths past a few hundred",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="a real checkpoint folder (e.g. ../shared/assets/all-MiniLM-L6-v2) instead of the "
        "tiny random BERT: its pooling, its width; use with --host-only",
    )
    parser.add_argument(
        "--max-len", type=int, default=None, help="longest input (default 512, a --model's limit)"
    )
    parser.add_argument(
        "--arrays", action="store_true", help="token ids as numpy arrays (default: lists)"
    )
    args = parser.parse_args()
    global ARRAYS
    ARRAYS = args.arrays
    torch.set_num_threads(1)
    from v1 import LLM

    llm = LLM(
        args.model or build(args.tokenizer, args.hidden_size),
        dtype="float32",
        device="cpu",
        multiprocess=False,
        max_num_seqs=512,
        max_num_batched_tokens=32768,
    )
    if args.host_only:
        skip_model(llm)
    max_len = args.max_len or 512
    if args.model and args.max_len is None:
        max_len = min(max_len, llm.config.model_config.info.pooling.max_input_len)
    print(f"{args.inputs} inputs of 16-{max_len} tokens", flush=True)
    llm.embed(inputs(args.inputs, 0, max_len), use_tqdm=False)  # warm-up, full size
    if args.host_only:
        host_cpu_time(llm, args.runs, lambda run: inputs(args.inputs, run + 1, max_len))
    timings: dict[str, list[float]] = collections.defaultdict(list)
    instrument(llm, timings)
    per_run: dict[str, list[float]] = collections.defaultdict(list)
    for run in range(args.runs):
        timings.clear()
        batch = inputs(args.inputs, run + 1, max_len)
        start = time.perf_counter()
        llm.embed(batch, use_tqdm=False)
        per_run["wall (s)"].append(time.perf_counter() - start)
        for name in PER_STEP + PER_REQUEST:
            per_run[name].append(float(np.median(timings[name])) * 1e6)
        per_run["steps"].append(len(timings["schedule"]))
    for name, values in per_run.items():
        unit = "" if name in ("wall (s)", "steps") else " us"
        scope = " per request" if name in PER_REQUEST else ""
        runs = ", ".join(f"{v:.3f}" if name == "wall (s)" else f"{v:.0f}" for v in values)
        print(f"{name}{scope}: median {np.median(values):.3f}{unit} (runs: {runs})")
    if args.cprofile:
        prof = cProfile.Profile()
        prof.enable()
        llm.embed(inputs(args.inputs, 99, max_len), use_tqdm=False)
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(40)
        print(out.getvalue())
    llm.shutdown()


if __name__ == "__main__":
    main()
