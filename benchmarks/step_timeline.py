"""Per-step GPU timeline of a Whisper run: CUDA events around every step's launch give each
step's GPU span (encoder steps vs decode steps), the GPU's idle gaps between steps and the host
time before the first launch; --profile adds a torch profiler kernel table.

Random large-v3-turbo-shaped Whisper (--decoder-layers 32: large-v3), in-process, 256 clips of
30 s x 100 forced tokens after a full-size warm-up (CUDA only):

    python3 benchmarks/step_timeline.py --tokenizer .bench_assets/whisper-base \
        [--cross-attention per_layer] [--quantization fp8] [--kv-cache-dtype fp8] [--profile]
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import numpy as np
import torch
from profile_step import build, clip_maker, make_engine


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer", default=".bench_assets/whisper-base")
    p.add_argument("--decoder-layers", type=int, default=4)
    p.add_argument("--clips", type=int, default=256)
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--quantization", default=None)
    p.add_argument("--cross-attention", default=None)
    p.add_argument("--kv-cache-dtype", default=None)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    from v1 import SamplingParams

    kw = {"quantization": args.quantization} if args.quantization else {}
    if args.cross_attention:
        kw["cross_attention"] = args.cross_attention
    if args.kv_cache_dtype:
        kw["kv_cache_dtype"] = args.kv_cache_dtype
    llm = make_engine(build(args), **kw)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    clips = clip_maker(args.clips)

    llm.transcribe(clips(), params, language="en", temperature=0.0, use_tqdm=False)
    core = llm.llm_engine.engine_core.engine_core
    runner = core.executor.worker.model_runner
    rec = []
    launch = runner.execute_model_async

    def timed(so):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        s.record()
        out = launch(so)
        e.record()
        t1 = time.perf_counter()
        rec.append(
            (
                s,
                e,
                len(so.encoder_hashes_to_run),
                so.total_num_scheduled_tokens,
                len(so.num_scheduled_tokens),
                t0,
                t1,
            )
        )
        return out

    runner.execute_model_async = timed
    for rep in range(2):
        rec.clear()
        audio = clips()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.transcribe(audio, params, language="en", temperature=0.0, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        enc_span = dec_span = idle = 0.0
        n_enc = n_dec = 0
        first_launch = rec[0][5] - t0
        rows = []
        for i, (s, e, nenc, ntok, nreq, h0, h1) in enumerate(rec):
            span = s.elapsed_time(e) / 1e3
            gap = rec[i - 1][1].elapsed_time(s) / 1e3 if i else 0.0
            idle += max(gap, 0)
            if nenc:
                enc_span += span
                n_enc += 1
            else:
                dec_span += span
                n_dec += 1
            rows.append((nenc, ntok, nreq, span * 1e3, gap * 1e3, (h1 - h0) * 1e3))
        print(
            f"rep {rep}: wall {wall:.3f}s RTFx {args.clips * 30 / wall:.0f}; host before first launch {first_launch:.3f}s; "
            f"encoder steps {n_enc} GPU {enc_span:.3f}s; other steps {n_dec} GPU {dec_span:.3f}s; GPU idle between steps {idle:.3f}s; "
            f"after last launch {t0 + wall - rec[-1][6]:.3f}s"
        )
        if rep == 1:
            for r in rows[:40]:
                nenc, ntok, nreq, gpu, gap, host = r
                print(
                    f"  enc {nenc} tok {ntok} req {nreq}  gpu {gpu:.2f} ms  gap {gap:.2f} ms  "
                    f"launch host {host:.2f} ms"
                )
            dec = np.array([r[3] for r in rows if r[0] == 0 and r[2] == args.clips])
            if len(dec):
                print(f"full-batch decode steps: {len(dec)}, GPU median {np.median(dec):.2f} ms")
    if args.profile:
        rec.clear()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            llm.transcribe(clips(), params, language="en", temperature=0.0, use_tqdm=False)
            torch.cuda.synchronize()
        print(
            prof.key_averages().table(
                sort_by="cuda_time_total", row_limit=40, max_name_column_width=90
            )
        )
    llm.shutdown()


if __name__ == "__main__":
    main()
