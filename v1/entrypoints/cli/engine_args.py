"""Engine flags for every subcommand, one per engine argument of `v1.config`, with the help
text read from the docstring under each config field."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
from typing import Any

_SCALARS: dict[str, type] = {
    "int": int,
    "float": float,
    "str": str,
    "bool": bool,
    "list[str]": list,  # a flag taking zero or more strings
}


@functools.cache  # parsing a class's source is slow; make_parser asks once per engine flag
def attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it in the class body (one line; read-only)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for node, following in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _scalar_type(annotation: Any) -> tuple[type | None, bool]:
    """(the scalar type of a field annotation, whether None is allowed); (None, _) when the
    annotation is not a plain scalar. `list[str]` counts as one (`list`: a multi-value flag)."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    parts = [p.strip() for p in str(text).split("|")]
    optional = "None" in parts
    scalars = [p for p in parts if p != "None"]
    if len(scalars) != 1:
        return None, optional
    return _SCALARS.get(scalars[0]), optional


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return "unset" if f.default is None else repr(f.default)
    return "computed"


_NO_KV_CACHE = frozenset(
    {
        "block_size",
        "num_kv_blocks",
        "kv_cache_memory_bytes",
        "enable_prefix_caching",
        "enable_chunked_prefill",
        "max_model_len",
        "max_num_encoder_input_tokens",
        "encoder_cache_size",
    }
)
IGNORED_ENGINE_ARGS: dict[str, frozenset[str]] = {
    "serve": frozenset(),
    # Requests from the command line carry no priority.
    "generate": frozenset({"policy"}),
    # Whisper: its own tokenizer and decoder length, short prompts, built-in architecture.
    "transcribe": frozenset(
        {
            "policy",
            "tokenizer",
            "max_model_len",
            "trust_remote_code",
            "enable_chunked_prefill",
        }
    ),
    # Encoder-only models keep no KV cache and run each input whole.
    "embed": _NO_KV_CACHE | {"policy"},
}
"""Engine arguments a subcommand does not offer (they mean nothing to what it runs)."""


_FLAG_ALIASES: dict[str, tuple[str, ...]] = {"policy": ("--scheduling-policy",)}
"""vLLM's names of engine flags, accepted beside ours."""
_FLAG_CHOICES: dict[str, tuple[str, ...]] = {"policy": ("fcfs", "priority")}
"""Engine flags whose values argparse checks (an error before anything loads)."""


def add_engine_args(parser: argparse.ArgumentParser, ignored: frozenset[str] = frozenset()) -> None:
    """One flag per engine argument not in `ignored` (only flags given on the command line
    reach the engine)."""
    from v1.config import EngineConfig, engine_arg_fields

    group = parser.add_argument_group("engine arguments")
    docs: dict[type, dict[str, str]] = {}
    for owner, f in engine_arg_fields():
        kind, _ = _scalar_type(f.type)
        if kind is None or f.name in ignored:
            continue
        doc = docs.setdefault(owner, attribute_docs(owner)).get(f.name, "")
        help_text = f"{doc} [{owner.__name__}; default: {_default_text(f)}]".strip().replace(
            "%", "%%"
        )
        flag = "--" + f.name.replace("_", "-")
        aliases = _FLAG_ALIASES.get(f.name, ())
        if kind is bool:
            group.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        elif kind is list:
            group.add_argument(
                flag,
                dest=f.name,
                nargs="*",
                default=argparse.SUPPRESS,
                metavar=f.name.upper(),
                help=help_text,
            )
        else:
            group.add_argument(
                flag,
                *aliases,
                dest=f.name,
                type=kind,
                choices=_FLAG_CHOICES.get(f.name),
                default=argparse.SUPPRESS,
                metavar=f.name.upper(),
                help=help_text,
            )
    eager_doc = attribute_docs(EngineConfig).get("enforce_eager", "Disable CUDA graphs.")
    group.add_argument(
        "--enforce-eager",
        dest="enforce_eager",
        action="store_true",
        default=argparse.SUPPRESS,
        help=f"{eager_doc} [EngineConfig; default: False]",
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments given on the command line."""
    from v1.config import engine_arg_fields

    names = {f.name for _, f in engine_arg_fields()} | {"enforce_eager"}
    return {name: value for name, value in vars(args).items() if name in names}
