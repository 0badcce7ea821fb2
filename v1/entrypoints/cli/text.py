"""`v1 generate` and `v1 embed`: prompts in, one completion line or one JSON embedding line
per input out; a model of the wrong kind is named with the subcommand that fits it."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

from v1.entrypoints.cli.engine_args import IGNORED_ENGINE_ARGS, add_engine_args, engine_kwargs


def add_generate_parser(sub: Any) -> None:
    p = sub.add_parser("generate", help="complete prompts (one output line per prompt)")
    p.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompts to complete")
    p.add_argument("--model", required=True, help="model folder or Hugging Face hub id")
    p.add_argument(
        "--max-tokens", type=int, default=64, help="tokens to generate (default: %(default)s)"
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature, 0 for greedy (default: %(default)s)",
    )
    add_engine_args(p, IGNORED_ENGINE_ARGS["generate"])


def add_embed_parser(sub: Any) -> None:
    p = sub.add_parser("embed", help="embed texts (JSON lines of vectors)")
    p.add_argument("texts", nargs="+", metavar="TEXT", help="texts to embed")
    p.add_argument("--model", required=True, help="embedding model folder or Hugging Face hub id")
    add_engine_args(p, IGNORED_ENGINE_ARGS["embed"])


_SUBCOMMAND_USAGE = {
    "transcribe": "v1 transcribe --model {model} FILE...",
    "generate": "v1 generate --model {model} PROMPT...",
    "embed": "v1 embed --model {model} TEXT...",
}


def check_model_kind(command: str, model: str, kwargs: Mapping[str, Any]) -> None:
    """ValueError naming the subcommand that fits when `model` cannot run `command` (a Whisper
    model given to `generate`, an embedding model to `generate`, a generative one to `embed`);
    reads only the model's config, before anything loads."""
    from v1.config import make_engine_config

    info = make_engine_config(model, **kwargs).model_config.info
    tasks = info.supported_tasks
    if "transcription" in tasks:
        fits, what = "transcribe", "a Whisper speech model"
    elif "generate" in tasks:
        fits, what = "generate", "a text generation model"
    else:
        fits, what = "embed", "an embedding (encoder-only) model"
    if fits == command:
        return
    usage = _SUBCOMMAND_USAGE[fits].format(model=model)
    raise ValueError(
        f"{model} is {what} ({info.architecture}), which `v1 {command}` cannot run: use `{usage}`"
    )


def run_generate(args: argparse.Namespace) -> int:
    from v1.entrypoints.llm import LLM
    from v1.sampling_params import SamplingParams

    check_model_kind("generate", args.model, engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    with LLM(args.model, **engine_kwargs(args)) as llm:
        outputs = llm.generate(list(args.prompts), params, use_tqdm=False)
    for out in outputs:
        print(out.outputs[0].text)
    return 0


def run_embed(args: argparse.Namespace) -> int:
    from v1.entrypoints.llm import LLM

    check_model_kind("embed", args.model, engine_kwargs(args))
    with LLM(args.model, **engine_kwargs(args)) as llm:
        outputs = llm.embed(list(args.texts), use_tqdm=False)
    for text, out in zip(args.texts, outputs, strict=True):
        print(json.dumps({"text": text, "embedding": out.outputs.embedding}))
    return 0
