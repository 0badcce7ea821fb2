"""Offline throughput: v1-engine vs transformers, same process, same GPU, same inputs.

Random weights with the real architectures' shapes (throughput does not depend on weight
values) and forced output lengths. Prints one row per workload: both figures and the ratio.

    python benchmarks/offline.py --workloads all --tokenizer DIR
    python benchmarks/offline.py --workloads whisper-turbo,bert-base --quick
    python benchmarks/offline.py --workloads whisper-large-v3 \
        --engine-args '{"cross_attention": "absorbed", "kv_cache_dtype": "fp8"}'

DIR holds tokenizer files (e.g. ../shared/assets/whisper-base); they are copied into each
random model folder so the engine's frontend has a tokenizer.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "normalizer.json",
    "preprocessor_config.json",
    "vocab.txt",
)


@dataclass
class Result:
    workload: str
    unit: str
    ours: float
    hf: float
    detail: str = ""

    @property
    def ratio(self) -> float:
        return self.ours / self.hf if self.hf else float("nan")


def timed(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def free_gpu() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def save_random(model: torch.nn.Module, tokenizer_dir: str, extra: dict | None = None) -> str:
    path = tempfile.mkdtemp(prefix="v1bench-")
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        src = os.path.join(tokenizer_dir, name)
        if os.path.exists(src):
            shutil.copy(src, path)
    if extra:
        for name, text in extra.items():
            with open(os.path.join(path, name), "w") as f:
                f.write(text)
    return path


ENGINE_ARGS: dict[str, object] = {}
"""Extra engine arguments for every engine run (--engine-args): cross_attention,
kv_cache_dtype, quantization, ... (they override a workload's own)."""


def make_llm(path: str, **kwargs: object):
    from v1 import LLM

    return LLM(path, **{"dtype": "float16", "multiprocess": False, **kwargs, **ENGINE_ARGS})


# ---------------------------------------------------------------- Whisper
def bench_whisper(
    name: str, decoder_layers: int, hf_batch: int, args: argparse.Namespace
) -> Result:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    from v1 import SamplingParams

    num_clips, num_tokens = (32, 20) if args.quick else (256, 100)
    cfg = WhisperConfig(
        d_model=1280,
        encoder_layers=32,
        decoder_layers=decoder_layers,
        encoder_attention_heads=20,
        decoder_attention_heads=20,
        encoder_ffn_dim=5120,
        decoder_ffn_dim=5120,
        num_mel_bins=128,
        vocab_size=51866,
        max_source_positions=1500,
        max_target_positions=448,
        decoder_start_token_id=50258,
        pad_token_id=50257,
        bos_token_id=50257,
        eos_token_id=50257,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = WhisperForConditionalGeneration(cfg).half().eval()
    gen_cfg = _whisper_generation_config(args.tokenizer)
    model.generation_config = gen_cfg
    path = save_random(model, args.tokenizer)
    with open(os.path.join(path, "preprocessor_config.json")) as f:
        pre = json.load(f)
    pre["feature_size"] = 128
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(pre, f)
    rng = np.random.default_rng(0)
    clips = [(rng.standard_normal(480000) * 0.1).astype(np.float32) for _ in range(num_clips)]
    audio_seconds = 30.0 * num_clips

    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=128)
    feats = torch.from_numpy(fe(clips, sampling_rate=16000, return_tensors="np").input_features)
    feats = feats.half().cuda()

    def run_hf() -> None:
        for i in range(0, num_clips, hf_batch):
            out = model.generate(
                feats[i : i + hf_batch],
                language="en",
                task="transcribe",
                min_new_tokens=num_tokens,
                max_new_tokens=num_tokens,
                do_sample=False,
            )
            assert out.shape[1] >= num_tokens

    model.generate(feats[:2], language="en", task="transcribe", max_new_tokens=4)
    hf_time = timed(run_hf)
    model = None
    free_gpu()

    llm = make_llm(
        path, max_num_seqs=256, max_num_batched_tokens=8192, max_num_encoder_input_tokens=1500 * 32
    )
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    audio = [(clip, 16000) for clip in clips]
    llm.transcribe(audio[:2], language="en", sampling_params=params.clone(max_tokens=4))
    results: list = []
    ours_time = timed(
        lambda: results.extend(llm.transcribe(audio, language="en", sampling_params=params))
    )
    assert len(results) == num_clips
    llm.shutdown()
    llm = None
    free_gpu()
    shutil.rmtree(path, ignore_errors=True)
    return Result(
        name,
        "RTFx",
        audio_seconds / ours_time,
        audio_seconds / hf_time,
        f"{num_clips} clips x {num_tokens} tokens; HF batch {hf_batch}",
    )


def _whisper_generation_config(tokenizer_dir: str):
    from transformers import GenerationConfig

    path = os.path.join(tokenizer_dir, "generation_config.json")
    return GenerationConfig.from_pretrained(tokenizer_dir) if os.path.exists(path) else None


# ---------------------------------------------------------------- BART
def bench_bart(args: argparse.Namespace) -> Result:
    from transformers import BartConfig, BartForConditionalGeneration

    from v1 import SamplingParams

    batch, in_len, out_len = (32, 128, 32) if args.quick else (128, 512, 128)
    cfg = BartConfig(
        vocab_size=50265,
        d_model=1024,
        encoder_layers=12,
        decoder_layers=12,
        encoder_attention_heads=16,
        decoder_attention_heads=16,
        encoder_ffn_dim=4096,
        decoder_ffn_dim=4096,
        max_position_embeddings=1024,
        forced_eos_token_id=None,
        forced_bos_token_id=None,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = BartForConditionalGeneration(cfg).half().eval()
    model.generation_config.forced_eos_token_id = None
    model.generation_config.no_repeat_ngram_size = 0
    path = save_random(model, args.tokenizer)
    rng = np.random.default_rng(0)
    ids = rng.integers(4, 50000, size=(batch, in_len))
    ids[:, 0], ids[:, -1] = 0, 2
    input_ids = torch.from_numpy(ids).cuda()

    def run_hf() -> None:
        out = model.generate(
            input_ids, num_beams=1, do_sample=False, min_new_tokens=out_len, max_new_tokens=out_len
        )
        assert out.shape[1] >= out_len

    model.generate(input_ids[:2], max_new_tokens=4)
    hf_time = timed(run_hf)
    model = None
    free_gpu()
    llm = make_llm(
        path, max_num_seqs=256, max_num_batched_tokens=16384, max_num_encoder_input_tokens=65536
    )
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    prompts = [{"prompt_token_ids": row.tolist()} for row in ids]
    llm.generate(prompts[:2], params.clone(max_tokens=4), use_tqdm=False)
    outs: list = []
    ours_time = timed(lambda: outs.extend(llm.generate(prompts, params, use_tqdm=False)))
    assert all(len(o.outputs[0].token_ids) == out_len for o in outs)
    llm.shutdown()
    free_gpu()
    shutil.rmtree(path, ignore_errors=True)
    total = batch * out_len
    return Result(
        "bart-large",
        "tok/s",
        total / ours_time,
        total / hf_time,
        f"batch {batch}, {in_len} in / {out_len} out",
    )


# ---------------------------------------------------------------- BERT
def bench_bert(args: argparse.Namespace) -> Result:
    from transformers import BertConfig, BertModel

    from v1 import PoolingParams

    num = 512 if args.quick else 4096
    cfg = BertConfig(architectures=["BertModel"])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = BertModel(cfg, add_pooling_layer=False).half().eval()
    path = save_random(model, args.bert_tokenizer)
    rng = np.random.default_rng(0)
    lengths = rng.integers(16, 513, size=num)
    seqs = [np.concatenate([[101], rng.integers(1000, 29000, size=n - 2), [102]]) for n in lengths]
    total_tokens = int(lengths.sum())
    hf_batch = 64

    def run_hf() -> None:
        for i in range(0, num, hf_batch):
            chunk = seqs[i : i + hf_batch]
            width = max(len(s) for s in chunk)
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, s in enumerate(chunk):
                ids[j, : len(s)] = torch.from_numpy(s)
                mask[j, : len(s)] = 1
            ids, mask = ids.cuda(), mask.cuda()
            with torch.inference_mode():
                hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
                pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
                torch.nn.functional.normalize(pooled.float(), dim=-1).cpu()

    run_hf()
    hf_time = timed(run_hf)
    model = None
    free_gpu()
    llm = make_llm(path, max_num_seqs=512, max_num_batched_tokens=32768)
    prompts = [{"prompt_token_ids": s.tolist()} for s in seqs]
    llm.embed(prompts[:64], use_tqdm=False)
    outs: list = []
    ours_time = timed(lambda: outs.extend(llm.embed(prompts, PoolingParams(), use_tqdm=False)))
    assert len(outs) == num
    llm.shutdown()
    free_gpu()
    shutil.rmtree(path, ignore_errors=True)
    return Result(
        "bert-base",
        "tok/s",
        total_tokens / ours_time,
        total_tokens / hf_time,
        f"{num} inputs of 16-512 tokens; HF padded batches of {hf_batch}",
    )


# ---------------------------------------------------------------- Llama
def bench_llama(args: argparse.Namespace) -> Result:
    from transformers import LlamaConfig, LlamaForCausalLM

    from v1 import SamplingParams

    batch, in_len, out_len = (16, 64, 32) if args.quick else (64, 128, 256)
    cfg = LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).half().eval()
    path = save_random(model, args.tokenizer)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 50000, size=(batch, in_len))
    input_ids = torch.from_numpy(ids).cuda()

    def run_hf() -> None:
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            min_new_tokens=out_len,
            max_new_tokens=out_len,
            pad_token_id=0,
        )
        assert out.shape[1] == in_len + out_len

    model.generate(input_ids[:2], max_new_tokens=4, pad_token_id=0)
    hf_time = timed(run_hf)
    model = None
    free_gpu()
    llm = make_llm(path, max_num_seqs=256, max_num_batched_tokens=16384)
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    prompts = [{"prompt_token_ids": row.tolist()} for row in ids]
    llm.generate(prompts[:2], params.clone(max_tokens=4), use_tqdm=False)
    ours_time = timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    llm.shutdown()
    free_gpu()
    shutil.rmtree(path, ignore_errors=True)
    total = batch * out_len
    return Result(
        "llama-1b",
        "tok/s",
        total / ours_time,
        total / hf_time,
        f"batch {batch}, {in_len} in / {out_len} out",
    )


# ---------------------------------------------------------------- host overhead
def bench_host_overhead(args: argparse.Namespace) -> list[Result]:
    """µs per decode step at batch 64 on a tiny model (GPU time negligible): eager vs graphs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from v1 import SamplingParams

    cfg = LlamaConfig(
        vocab_size=51865,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    path = save_random(LlamaForCausalLM(cfg).half(), args.tokenizer)
    steps = 64 if args.quick else 256
    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8]} for i in range(64)]
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    per_step = {}
    for eager in (True, False):
        llm = make_llm(path, max_num_seqs=64, enforce_eager=eager)
        llm.generate(prompts, params.clone(max_tokens=8), use_tqdm=False)
        t = timed(lambda llm=llm: llm.generate(prompts, params, use_tqdm=False))
        per_step[eager] = t / steps * 1e6
        llm.shutdown()
        free_gpu()
    shutil.rmtree(path, ignore_errors=True)
    return [
        Result(
            "decode step, batch 64 (tiny model)",
            "us/step (eager/graphs)",
            per_step[True],
            per_step[False],
            "ratio = eager / graphs",
        )
    ]


WORKLOADS: dict[str, Callable[[argparse.Namespace], object]] = {
    "whisper-large-v3": lambda a: bench_whisper("whisper-large-v3", 32, 64, a),
    "whisper-turbo": lambda a: bench_whisper("whisper-large-v3-turbo", 4, 128, a),
    "bart-large": bench_bart,
    "bert-base": bench_bert,
    "llama-1b": bench_llama,
    "host-overhead": bench_host_overhead,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="all")
    parser.add_argument("--tokenizer", default="../shared/assets/whisper-base")
    parser.add_argument("--bert-tokenizer", default="../shared/assets/all-MiniLM-L6-v2")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--json", default=None, help="also write results here")
    parser.add_argument(
        "--engine-args", default="{}", help="JSON object of extra engine arguments (all runs)"
    )
    args = parser.parse_args()
    ENGINE_ARGS.update(json.loads(args.engine_args))
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/offline.py needs a CUDA GPU")
    names = list(WORKLOADS) if args.workloads == "all" else args.workloads.split(",")
    results: list[Result] = []
    for name in names:
        print(f"== {name}", flush=True)
        try:
            out = WORKLOADS[name](args)
        except Exception as e:  # noqa: BLE001 - report and go on to the next workload
            import traceback

            traceback.print_exc()
            print(f"!! {name} failed: {type(e).__name__}: {e}", flush=True)
            continue
        for r in out if isinstance(out, list) else [out]:
            results.append(r)
            print(
                f"   {r.workload}: ours {r.ours:,.1f} vs transformers {r.hf:,.1f} {r.unit} "
                f"-> {r.ratio:.2f}x ({r.detail})",
                flush=True,
            )
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, engine args {ENGINE_ARGS}")
    print("| workload | unit | v1-engine | transformers | ratio | detail |")
    print("|---|---|---:|---:|---:|---|")
    for r in results:
        print(
            f"| {r.workload} | {r.unit} | {r.ours:,.1f} | {r.hf:,.1f} | {r.ratio:.2f}x | {r.detail} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ | {"ratio": r.ratio} for r in results], f, indent=1)


if __name__ == "__main__":
    main()
