"""BERT-family embeddings, ours before / after the encoder-only step's fused kernels and deeper
pipelining, against transformers, in one process on one GPU (issue 35, item 6).

Two workloads, each 4096 inputs of random token ids (fresh ids for every timed run, the same
lengths), `LLM.embed` against transformers' sentence-transformers loop (inputs sorted by
length, longest first, one padded batch at a time, mean pooling + L2 normalize, vectors copied
to the host; fp16, sdpa attention):
- `--model PATH` (repeatable): a real checkpoint folder (all-MiniLM-L6-v2: 16-256 tokens, its
  sentence-transformers limit); its own pooling (mean + normalize for MiniLM);
- `bert-base` (random weights, BERT-base shape, 16-512 tokens) with a sentence-transformers
  mean + normalize head written beside it, so both sides pool alike; `--no-bert-base` skips it.

For each workload: transformers at each `--hf-batches` size (warm-up on the full input set,
then `--repeats` timed runs; the best median is the baseline), then our engine once per
`--variants` entry (VARIANTS below), each warmed on a full run then timed `--repeats` times:
- `before`: `V1_FUSED_ENCODER` off (the torch embeddings and pooling), max_steps_in_flight=2,
  outputs converted to float lists after the last step (as `LLM.embed` did);
- `after`: the defaults (fused kernels on, max_steps_in_flight auto: 3 for pooling on a GPU,
  outputs converted as they arrive, each vector's float list made at its first `.embedding`
  read: the line prints what making all of them costs, outside the timed figure);
- `flash` (opt-in): `after` with aten's flash varlen attention in place of the Triton
  encoder-only kernel (`V1_TRITON_ENCODER_ONLY=0`, the attention before session 26);
- `cudnn` (opt-in): `flash` plus `V1_CUDNN_VARLEN` (cuDNN ragged attention; the line says
  whether cuDNN took it or refused). Its encoder steps run eagerly: the op cannot be captured
  in the encoder's CUDA graphs (see `make_encoder_graphs`).
Then, unless `--no-profile`, one more run of each under torch.profiler: the device kernel time
of a run, i.e. the host-free ceiling of our kernels. Every variant prints the lowest cosine of
its embeddings to transformers' on the same inputs (fp16 both; ~0.999+ expected).

    python3 benchmarks/bert_embed.py --model .bench_assets/minilm --variants before,after,cudnn
    python3 benchmarks/bert_embed.py --device cpu --tiny --model ../shared/assets/all-MiniLM-L6-v2
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _context import TOKENIZER_FILES, asset  # noqa: E402
from _harness import Device, timed  # noqa: E402
from _text import hf_mean_embeddings  # noqa: E402


def _lengths(num: int, low: int, high: int) -> np.ndarray:
    return np.random.default_rng(0).integers(low, high + 1, size=num)


def _ids(lengths: np.ndarray, input_set: int) -> list[np.ndarray]:
    rng = np.random.default_rng(4000 + input_set)
    return [np.concatenate([[101], rng.integers(1000, 29000, size=n - 2), [102]]) for n in lengths]


def _write_mean_pooling(path: str, hidden: int) -> None:
    """A sentence-transformers head (mean pooling, then Normalize) beside a plain BertModel."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    Path(path, "modules.json").write_text(json.dumps(modules))
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    os.makedirs(os.path.join(path, "2_Normalize"), exist_ok=True)
    pooling = {
        "word_embedding_dimension": hidden,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
    }
    Path(path, "1_Pooling", "config.json").write_text(json.dumps(pooling))


def _build_bert_base(root: str, tokenizer: str, tiny: bool, dtype: torch.dtype) -> str:
    from transformers import BertConfig, BertModel

    d, layers, heads, ffn = (64, 2, 2, 128) if tiny else (768, 12, 12, 3072)
    cfg = BertConfig(
        hidden_size=d,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=ffn,
        architectures=["BertModel"],
    )
    torch.manual_seed(0)
    path = os.path.join(root, "bert-base")
    BertModel(cfg, add_pooling_layer=False).to(dtype).save_pretrained(path)
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(tokenizer, name)):
            shutil.copy(os.path.join(tokenizer, name), path)
    _write_mean_pooling(path, d)
    return path


def _hf_embed(model: Any, seqs: list[np.ndarray], batch: int, device: str) -> torch.Tensor:
    """[N, H] float32: `hf_mean_embeddings` (sentence-transformers' encode loop), stacked."""
    return torch.stack(hf_mean_embeddings(model, seqs, batch, device))  # type: ignore[arg-type]


def _device_seconds(device: Device, fn: Any) -> float:
    """Device kernel time of fn() (torch.profiler, self device time summed)."""
    device.sync()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.is_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        device.sync()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e6


def _summary(seconds: list[float], tokens: int) -> str:
    rates = sorted(tokens / s for s in seconds)
    return f"{statistics.median(rates):,.0f} [{rates[0]:,.0f}-{rates[-1]:,.0f}] tok/s"


def _median_rate(seconds: list[float], tokens: int) -> float:
    return statistics.median(tokens / s for s in seconds)


VARIANTS: dict[str, tuple[dict[str, bool], dict[str, Any]]] = {
    "before": (
        {"V1_FUSED_ENCODER": False, "V1_CUDNN_VARLEN": False, "V1_TRITON_ENCODER_ONLY": False},
        {"max_steps_in_flight": 2},
    ),
    "after": ({"V1_FUSED_ENCODER": True, "V1_CUDNN_VARLEN": False}, {}),
    "flash": (
        {"V1_FUSED_ENCODER": True, "V1_CUDNN_VARLEN": False, "V1_TRITON_ENCODER_ONLY": False},
        {},
    ),
    "cudnn": (
        {"V1_FUSED_ENCODER": True, "V1_CUDNN_VARLEN": True, "V1_TRITON_ENCODER_ONLY": False},
        {},
    ),
}
"""Our engine's variants: the v1.envs flags set while the engine is built and run (read at
forward / capture time), and extra LLM arguments. `before` is the code before issue 35's
BERT changes (torch embeddings and pooling, 2 steps in flight, outputs converted after the
last step: `_embed_converting_at_end`, aten's flash varlen attention); `after` the defaults;
`flash` the defaults with aten's flash varlen in place of the Triton encoder-only attention
kernel (`V1_TRITON_ENCODER_ONLY=0`); `cudnn` the defaults plus the experimental cuDNN ragged
attention. Not switchable, so in all three: steps of texts ship no
segment ids, and the pooling builds no per-token request index unless a mode needs it."""


def _prompt_ids(seq: np.ndarray, args: argparse.Namespace) -> Any:
    """One input's prompt_token_ids: the same int array transformers' side gets, or (with
    --id-lists, and for the `before` code, which takes lists only) a list."""
    return seq.tolist() if args.id_lists or "before" in args.variants.split(",") else seq


def _embed(llm: Any, batch: list[dict[str, Any]]) -> Any:
    return llm.embed(batch, use_tqdm=False)


def _embed_converting_at_end(llm: Any, batch: list[dict[str, Any]]) -> Any:
    """`LLM.embed` as it was before issue 35's change: every output converted to its
    EmbeddingRequestOutput with its float list made (the old eager `embedding` list) after the
    last step, none while steps run."""
    from v1.outputs import EmbeddingRequestOutput

    params = llm._pooling_params(None, batch, "embed", None)
    outputs = llm._run(batch, params, False, None)
    converted = [EmbeddingRequestOutput.from_base(o) for o in outputs]
    for o in converted:
        o.outputs.embedding  # noqa: B018 - the float list, made now as the old code did
    return converted


def _run_variant(
    args: argparse.Namespace,
    device: Device,
    path: str,
    dtype: torch.dtype,
    label: str,
    inputs: Any,
    tokens: int,
    hf_best: tuple[float, int],
    hf_vectors: torch.Tensor | None,
) -> dict[str, Any] | None:
    from v1 import LLM, envs

    try:
        from v1.attention.backends import triton as triton_backend
    except ImportError:  # no triton (CPU): the flags change nothing there
        triton_backend = None
    flags, extra = VARIANTS[label]
    saved = {name: getattr(envs, name) for name in flags}
    for name, value in flags.items():
        setattr(envs, name, value)
    if triton_backend is not None:
        triton_backend._CUDNN_VARLEN_OK[0] = True  # a refusal is per engine: try again
    llm = None
    try:
        # --defaults: what a user who knows no settings gets (issue 35 item 1).
        tuned = {} if args.defaults else dict(max_num_seqs=512)
        if not args.defaults:
            tuned["max_num_batched_tokens"] = args.max_num_batched_tokens
        llm = LLM(
            path,
            dtype=str(dtype).removeprefix("torch."),
            device=device.name,
            multiprocess=args.multiprocess,
            **tuned,
            **extra,
        )
        sc = llm.config.scheduler_config
        print(
            f"engine: max_num_seqs={sc.max_num_seqs}, "
            f"max_num_batched_tokens={sc.max_num_batched_tokens}",
            flush=True,
        )
        depth = llm.config.scheduler_config.max_steps_in_flight
        run = _embed_converting_at_end if label == "before" else _embed

        def embed(input_set: int) -> Any:
            batch = [{"prompt_token_ids": _prompt_ids(s, args)} for s in inputs(input_set)]
            return timed(device, lambda: run(llm, batch))

        _, out = embed(0)  # warm-up, full size
        assert len(out) == args.inputs and all(len(o.outputs.embedding) for o in out)
        seconds = []
        ours_vectors = None
        for i in range(1, args.repeats + 1):
            s, out = embed(i)
            seconds.append(s)
            if i == 1:
                # `embedding` float lists are made at first read (EmbeddingOutput): timed
                # apart, so the reader sees what a caller that wants lists pays on top.
                start = time.perf_counter()
                lists = [o.outputs.embedding for o in out]
                list_s = time.perf_counter() - start
                ours_vectors = np.array(lists, dtype=np.float32)
        rate = _median_rate(seconds, tokens)
        entry: dict[str, Any] = {
            "tok_s": rate,
            "ratio": rate / hf_best[0],
            "flags": flags,
            "steps_in_flight": depth,
            "float_lists_s": list_s,
        }
        if flags.get("V1_CUDNN_VARLEN") and triton_backend is not None and device.is_cuda:
            entry["cudnn_used"] = triton_backend._CUDNN_VARLEN_OK[0]
        on = ", ".join(f"{k.removeprefix('V1_')}={int(v)}" for k, v in flags.items())
        line = (
            f"ours {label} ({on}, {depth} steps in flight): {_summary(seconds, tokens)} = "
            f"{rate / hf_best[0]:.2f}x transformers"
        )
        if "cudnn_used" in entry:
            line += f"; cuDNN ragged attention {'used' if entry['cudnn_used'] else 'REFUSED'}"
            line += " (eager encoder steps: no CUDA graphs)"
        if label != "before":
            line += f"; float lists at first .embedding read +{list_s * 1e3:.0f} ms (not timed)"
        if hf_vectors is not None and ours_vectors is not None:
            cos = (ours_vectors * hf_vectors.numpy()).sum(-1)
            entry["min_cosine_to_hf"] = float(cos.min())
            line += f"; cosine to transformers min {cos.min():.5f}"
        print(line, flush=True)
        if not args.no_profile and device.is_cuda:
            batch = [{"prompt_token_ids": _prompt_ids(s, args)} for s in inputs(args.repeats + 1)]
            dev = _device_seconds(device, lambda: run(llm, batch))
            entry["device_s"] = dev
            print(
                f"   device kernel time of a run: {dev:.3f} s (host-free ceiling "
                f"{tokens / dev:,.0f} tok/s = {tokens / dev / hf_best[0]:.2f}x); median wall "
                f"{statistics.median(seconds):.3f} s",
                flush=True,
            )
        return entry
    except Exception as e:  # noqa: BLE001 - one variant failing must not hide the others
        import traceback

        traceback.print_exc()
        print(f"ours {label}: FAILED: {type(e).__name__}: {e}", flush=True)
        return None
    finally:
        for name, value in saved.items():
            setattr(envs, name, value)
        if llm is not None:
            llm.shutdown()
        llm = None
        gc.unfreeze()  # LLM froze the collector: let the engine's cycles go
        device.free()
        gc.freeze()


def bench(args: argparse.Namespace, device: Device, name: str, path: str, max_len: int) -> dict:
    from transformers import AutoModel

    dtype = torch.float16 if device.is_cuda else torch.float32
    lengths = _lengths(args.inputs, 16, max_len)
    tokens = int(lengths.sum())
    sets: dict[int, list[np.ndarray]] = {}

    def inputs(i: int) -> list[np.ndarray]:
        if i not in sets:
            sets[i] = _ids(lengths, i)
        return sets[i]

    print(
        f"\n== {name}: {args.inputs} inputs of 16-{max_len} tokens ({tokens:,} tokens)", flush=True
    )
    result: dict[str, Any] = {"workload": name, "tokens": tokens}

    # ---- transformers
    model = AutoModel.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    model = model.to(device.name).eval()
    hf_best: tuple[float, int] | None = None
    hf_vectors = None
    for batch in [int(b) for b in args.hf_batches.split(",")]:
        timed(device, lambda b=batch: _hf_embed(model, inputs(0), b, device.name))  # warm-up
        seconds = []
        for i in range(1, args.repeats + 1):
            s, vectors = timed(
                device, lambda b=batch, x=inputs(i): _hf_embed(model, x, b, device.name)
            )
            seconds.append(s)
            if i == 1:
                hf_vectors = vectors if hf_vectors is None else hf_vectors
        rate = _median_rate(seconds, tokens)
        print(f"transformers batch {batch}: {_summary(seconds, tokens)}", flush=True)
        if hf_best is None or rate > hf_best[0]:
            hf_best = (rate, batch)
    assert hf_best is not None
    result["hf"] = {"tok_s": hf_best[0], "batch": hf_best[1]}
    model = None
    device.free()

    # ---- ours, one engine per variant
    for label in args.variants.split(","):
        entry = _run_variant(args, device, path, dtype, label, inputs, tokens, hf_best, hf_vectors)
        if entry is not None:
            result[label] = entry
    hf_rate = hf_best[0]
    before, after = result.get("before"), result.get("after")
    if before and after:
        print(
            f"{name}: transformers {hf_rate:,.0f} tok/s (batch {hf_best[1]}); ours before "
            f"{before['tok_s']:,.0f} ({before['ratio']:.2f}x), after {after['tok_s']:,.0f} "
            f"({after['ratio']:.2f}x); after/before {after['tok_s'] / before['tok_s']:.3f}",
            flush=True,
        )
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", action="append", default=[], help="a real BERT-family folder")
    p.add_argument("--no-bert-base", action="store_true", help="skip the random BERT-base")
    p.add_argument(
        "--no-real", action="store_true", help="no real checkpoint (bert-base alone; --tokenizer)"
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer folder for bert-base")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: few short inputs")
    p.add_argument("--inputs", type=int, default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hf-batches", default="128,256")
    p.add_argument("--max-num-batched-tokens", type=int, default=32768)
    p.add_argument("--multiprocess", action="store_true", help="EngineCore in its own process")
    p.add_argument(
        "--defaults",
        action="store_true",
        help="LLM's own max_num_seqs and max_num_batched_tokens (default: 512 and the flag's)",
    )
    p.add_argument(
        "--id-lists",
        action="store_true",
        help="hand our engine the token ids as Python lists (default: the numpy arrays "
        "transformers gets)",
    )
    p.add_argument("--no-profile", action="store_true", help="skip the device-time runs")
    p.add_argument("--variants", default="before,after", help=f"comma list of {list(VARIANTS)}")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    device = Device(args.device)
    if device.is_cuda and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu --tiny", file=sys.stderr)
        return 2
    if args.tiny:
        args.inputs = args.inputs or 24
        args.max_num_batched_tokens = min(args.max_num_batched_tokens, 512)
        args.hf_batches = "8"
        torch.set_num_threads(1)
    args.inputs = args.inputs or 4096
    import transformers

    transformers.logging.set_verbosity_error()
    print(
        f"device: {device.describe()}; torch {torch.__version__}, transformers "
        f"{transformers.__version__}; {' '.join(sys.argv[1:])}",
        flush=True,
    )
    models = [] if args.no_real else args.model or [asset("all-MiniLM-L6-v2")]
    tokenizer = args.tokenizer or models[0]
    root = tempfile.mkdtemp(prefix="bert-embed-")
    results = []
    start = time.perf_counter()
    try:
        for path in models:
            from v1.config import make_engine_config

            limit = make_engine_config(path, device="cpu").model_config.info.pooling.max_input_len
            max_len = min(limit, 64 if args.tiny else 512)
            results.append(bench(args, device, f"{Path(path).name} (real)", path, max_len))
        if not args.no_bert_base:
            dtype = torch.float16 if device.is_cuda else torch.float32
            path = _build_bert_base(root, tokenizer, args.tiny, dtype)
            results.append(
                bench(args, device, "bert-base (random)", path, 64 if args.tiny else 512)
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n== summary ({time.perf_counter() - start:,.0f} s)")
    for r in results:
        hf = r["hf"]
        row = [f"{r['workload']}: transformers {hf['tok_s']:,.0f} (batch {hf['batch']})"]
        for label in VARIANTS:
            if label in r:
                e = r[label]
                dev = f", device {e['device_s']:.3f} s" if "device_s" in e else ""
                row.append(f"{label} {e['tok_s']:,.0f} = {e['ratio']:.2f}x{dev}")
        print("; ".join(row))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
