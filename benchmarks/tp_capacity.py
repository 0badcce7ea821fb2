"""A decoder that does not fit one GPU (issue 34): a Llama-3-70B-shaped checkpoint (bf16,
random weights, ~141 GB, sharded safetensors written here) loaded at tensor_parallel_size N,
each rank reading only its slices; then generation. Reports the checkpoint size, load time
(LLM() until ready), every GPU's memory in use after load (nvidia-smi) and decode tok/s.

    python benchmarks/tp_capacity.py --tp 2 --dir /dev/shm/llama70b     # an H200 pair
    python benchmarks/tp_capacity.py --tp 2 --tiny --device cpu --dir /tmp/x   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
from _context import asset, copy_tokenizer
from safetensors.torch import save_file

LLAMA_70B = dict(
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
TINY = dict(
    LLAMA_70B,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=51865,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dir", required=True, help="where the checkpoint is written (needs ~141 GB)")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    p.add_argument(
        "--layers-per-shard",
        type=int,
        default=1,
        help="1: layers share random values, never within a file",
    )
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--tokenizer", default=asset("whisper-base"))
    p.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    return p.parse_args(argv)


_RANDOM: dict[tuple[str, tuple[int, int]], torch.Tensor] = {}
"""Writing is the slow part of a 141 GB checkpoint: the layers share their random values."""


def layer_tensors(i: int, cfg: dict, gen: torch.Generator, device: str) -> dict[str, torch.Tensor]:
    d, f = cfg["hidden_size"], cfg["intermediate_size"]
    hd = d // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    shapes = {
        "self_attn.q_proj.weight": (d, d),
        "self_attn.k_proj.weight": (kv, d),
        "self_attn.v_proj.weight": (kv, d),
        "self_attn.o_proj.weight": (d, d),
        "mlp.gate_proj.weight": (f, d),
        "mlp.up_proj.weight": (f, d),
        "mlp.down_proj.weight": (d, f),
    }
    out = {}
    for name, shape in shapes.items():
        if (name, shape) not in _RANDOM:  # one random draw per projection, shared by the layers
            w = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
            _RANDOM[(name, shape)] = w.mul_(shape[1] ** -0.5).cpu()
        out[f"model.layers.{i}.{name}"] = _RANDOM[(name, shape)]
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out[f"model.layers.{i}.{norm}.weight"] = torch.ones(d, dtype=torch.bfloat16)
    return out


def write_checkpoint(args: argparse.Namespace, cfg: dict) -> tuple[str, float, float]:
    """(path, GB written, seconds)."""
    from transformers import LlamaConfig

    t0 = time.perf_counter()
    path = args.dir
    os.makedirs(path, exist_ok=True)
    LlamaConfig(**cfg, torch_dtype="bfloat16").save_pretrained(path)
    copy_tokenizer(args.tokenizer, path)
    device = args.device if args.device.startswith("cuda") else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    layers = cfg["num_hidden_layers"]
    groups = [
        list(range(s, min(s + args.layers_per_shard, layers)))
        for s in range(0, layers, args.layers_per_shard)
    ]
    num_files = len(groups) + 1
    weight_map, total = {}, 0
    for k, group in enumerate(groups + [None]):
        if group is None:
            d, v = cfg["hidden_size"], cfg["vocab_size"]
            tensors = {
                "model.embed_tokens.weight": torch.randn(
                    (v, d), generator=gen, device=device, dtype=torch.bfloat16
                )
                .mul_(0.02)
                .cpu(),
                "lm_head.weight": torch.randn(
                    (v, d), generator=gen, device=device, dtype=torch.bfloat16
                )
                .mul_(d**-0.5)
                .cpu(),
                "model.norm.weight": torch.ones(d, dtype=torch.bfloat16),
            }
        else:
            tensors = {}
            for i in group:
                tensors.update(layer_tensors(i, cfg, gen, device))
        name = f"model-{k + 1:05d}-of-{num_files:05d}.safetensors"
        save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
        for t_name, t in tensors.items():
            weight_map[t_name] = name
            total += t.numel() * t.element_size()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return path, total / 1e9, time.perf_counter() - t0


def gpu_memory() -> str:
    if not shutil.which("nvidia-smi"):
        return "n/a"
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,memory.used,memory.total", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return "; ".join(line.strip() for line in out.splitlines())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    cfg = dict(TINY if args.tiny else LLAMA_70B)
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    print(f"Command: python3 benchmarks/tp_capacity.py {shlex.join(argv)}", flush=True)
    path, gigabytes, write_s = write_checkpoint(args, cfg)
    print(
        f"checkpoint: {gigabytes:.1f} GB ({cfg['num_hidden_layers']} layers) written in "
        f"{write_s:.0f} s to {path}",
        flush=True,
    )
    from v1 import LLM, SamplingParams

    kwargs = dict(max_model_len=1024, max_num_seqs=64, device=args.device)
    if not args.device.startswith("cuda"):
        kwargs["kv_cache_memory_bytes"] = 64 << 20
    t0 = time.perf_counter()
    llm = LLM(path, tensor_parallel_size=args.tp, dtype="bfloat16", **kwargs)
    load_s = time.perf_counter() - t0
    print(f"loaded at TP {args.tp} in {load_s:.1f} s; GPU memory used: {gpu_memory()}", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    try:
        for batch in (1, 32):
            params = SamplingParams(
                temperature=0, max_tokens=args.tokens, ignore_eos=True, detokenize=False
            )
            rates = []
            for r in range(4):
                prompts = [
                    {"prompt_token_ids": rng.integers(100, 50000, 128).tolist()}
                    for _ in range(batch)
                ]
                t = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                s = time.perf_counter() - t
                assert all(len(o.outputs[0].token_ids) == args.tokens for o in outs)
                if r:  # the first is the warm-up
                    rates.append(batch * args.tokens / s)
            rows.append(
                f"| batch {batch} x {args.tokens} tokens (128-token prompts) | "
                f"{statistics.median(rates):,.1f} [{min(rates):,.1f}-{max(rates):,.1f}] tok/s |"
            )
            print(rows[-1], flush=True)
    finally:
        llm.shutdown()
        if not args.keep:
            shutil.rmtree(path, ignore_errors=True)
    print(f"\n70B-shaped ({gigabytes:.1f} GB bf16), TP {args.tp}: load {load_s:.1f} s")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
