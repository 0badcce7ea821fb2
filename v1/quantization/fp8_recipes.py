"""Which Linear layers `quantization="fp8"` leaves in the model dtype: the user's `fp8_ignore`,
else the model class's own keep-list (its `default_fp8_ignore()` method; none: every Linear is
fp8). An entry is a module name covering every Linear at or under it, or "re:" and a regular
expression a Linear's full name must match (engine names: fused `qkv_proj`, `kv_proj`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from v1.config import FP8_IGNORE_REGEX, check_fp8_ignore
from v1.quantization.fp8 import linear_layers

if TYPE_CHECKING:
    from torch import nn


def covers(entry: str, name: str) -> bool:
    """Whether an fp8_ignore entry covers the module called `name`."""
    if entry.startswith(FP8_IGNORE_REGEX):
        return re.fullmatch(entry[len(FP8_IGNORE_REGEX) :], name) is not None
    return name == entry or name.startswith(entry + ".")


def default_fp8_ignore(model: nn.Module) -> list[str]:
    """The entries the model class keeps in the model dtype when the user names none."""
    recipe = getattr(model, "default_fp8_ignore", None)
    return list(recipe()) if recipe is not None else []


def fp8_ignored_modules(model: nn.Module, ignore: Sequence[str] | None) -> set[str]:
    """Names of the Linear modules of `model` that stay unquantized: those `ignore` covers, or,
    when None, those the model's default recipe does. An entry covering no Linear is a
    ValueError (a typo, or a checkpoint's unfused name such as `q_proj`)."""
    entries = default_fp8_ignore(model) if ignore is None else check_fp8_ignore(ignore)
    names = [name for name, _ in linear_layers(model)]
    ignored: set[str] = set()
    for entry in entries:
        covered = {name for name in names if covers(entry, name)}
        if not covered:
            examples = ", ".join(names[:4] + names[-2:]) if names else "none"
            raise ValueError(
                f"fp8_ignore entry {entry!r} covers no Linear layer of {type(model).__name__} "
                f"(its Linear layers are named like {examples})"
            )
        ignored |= covered
    return ignored


def decoder_per_token_linears(model: nn.Module) -> list[str]:
    """An encoder-decoder model's decoder Linears but the cross-attention K/V projections (of
    the encoder output), by name; none for a model without cross-attention. fp8 slowed these
    small-M GEMMs down (BART-large, 256 requests of 512 in / 128 out, H100: every Linear fp8
    53,733 tok/s against 57,436 in fp16; keeping these 58,150 against 57,208)."""
    linears = dict(linear_layers(model))
    linear_ids = {id(layer) for layer in linears.values()}
    cross_kv = {
        f"{name}.kv_proj" if name else "kv_proj"
        for name, m in model.named_modules()
        if id(getattr(m, "kv_proj", None)) in linear_ids
    }
    if not cross_kv:
        return []
    return [
        name
        for name in linears
        if (name.startswith("decoder.") or ".decoder." in name) and name not in cross_kv
    ]
