"""Where bert-base's wall time exceeds its device time (issue 35 item 6): bert_embed.py's
workload (random BERT-base weights, fp16, 4096 inputs of 16-512 tokens in random order, the
engine in this process with max_num_seqs=512 and 32,768 tokens a step), warmed on a full run,
then runs under torch.profiler: the time from the call to the first kernel, every device gap
of more than --gap-ms between kernels (where in the run, how long), and the time from the last
kernel to the call's return. CUDA only.

    python3 benchmarks/pooling_gaps.py --tokenizer .bench_assets/minilm
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from bert_embed import _build_bert_base, _ids, _lengths  # noqa: E402


def kernel_spans(prof: torch.profiler.profile) -> list[tuple[float, float]]:
    """(start, end) us of every device kernel / memcpy / memset, sorted."""
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() >= 0:
            spans.append((e.time_range.start, e.time_range.end))
    return sorted(spans)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer", default=".bench_assets/minilm")
    p.add_argument("--inputs", type=int, default=4096)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--gap-ms", type=float, default=0.2)
    args = p.parse_args()
    from v1 import LLM

    path = _build_bert_base(tempfile.mkdtemp(), args.tokenizer, False, torch.float16)
    llm = LLM(
        path, dtype="float16", max_num_seqs=512, max_num_batched_tokens=32768, multiprocess=False
    )
    flag = torch.zeros(1, device="cuda")
    lengths = _lengths(args.inputs, 16, 512)

    def batch(i: int) -> list[dict[str, np.ndarray]]:
        return [{"prompt_token_ids": ids} for ids in _ids(lengths, i)]

    llm.embed(batch(0), use_tqdm=False)  # warm-up, full size
    for run in range(1, args.runs + 1):
        inputs = batch(run)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            flag.add_(1)  # a marker kernel: the call starts
            start = time.perf_counter()
            llm.embed(inputs, use_tqdm=False)
            wall = time.perf_counter() - start
            flag.add_(1)  # a marker kernel: the call has returned
            torch.cuda.synchronize()
        spans = kernel_spans(prof)
        (_, called), (returned, _) = spans[0], spans[-1]
        spans = spans[1:-1]
        busy, gaps, end = 0.0, [], spans[0][0]
        for s, e in spans:
            if s - end > args.gap_ms * 1e3:
                gaps.append((end - spans[0][0], s - end))
            busy += max(0.0, e - max(s, end))
            end = max(end, e)
        print(
            f"run {run}: wall {wall * 1e3:.1f} ms; device busy {busy / 1e3:.1f} ms; call to "
            f"first kernel {(spans[0][0] - called) / 1e3:.1f} ms, last kernel to return "
            f"{(returned - end) / 1e3:.1f} ms; {len(gaps)} gaps over {args.gap_ms} ms between, "
            f"{sum(g for _, g in gaps) / 1e3:.1f} ms in all"
        )
        for at, gap in gaps[:25]:
            print(f"   at {at / 1e3:7.1f} ms: {gap / 1e3:.2f} ms idle")
    llm.shutdown()


if __name__ == "__main__":
    main()
