"""The shared body of every model's `load_weights`: map checkpoint names onto parameters.

A model names its fused parameters in `packed_modules_mapping` (checkpoint module name ->
(fused module name, shard id)) and the checkpoint names it may skip in
`ignore_unexpected_patterns`; everything else in the checkpoint must land on a parameter.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from v1.models.layers.linear import default_weight_loader

PackedMapping = Mapping[str, tuple[str, int | str]]
_MAX_LISTED = 20


def format_names(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else "")


def _packed_target(name: str, packed: PackedMapping) -> tuple[str, int | str | None]:
    """Replace the checkpoint module name (a whole dotted component) by its fused module."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            fused, shard_id = packed[part]
            return ".".join([*parts[:i], fused, *parts[i + 1 :]]), shard_id
    return name, None


def lora_target_of(
    module_name: str, packed: PackedMapping, rename: Callable[[str], str] | None = None
) -> tuple[str, int | str | None]:
    """A checkpoint module name (as PEFT names LoRA targets) -> (our Linear's module name, its
    shard id in that fused Linear or None), by the model's own checkpoint renames."""
    name = module_name + ".weight"
    if rename is not None:
        name = rename(name)
    name, shard_id = _packed_target(name, packed)
    return name.removesuffix(".weight"), shard_id


def load_weights_into(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed_modules_mapping: PackedMapping | None = None,
    ignore_unexpected_patterns: Sequence[str] = (),
) -> set[str]:
    """Load (name, tensor) pairs into `module`'s parameters through their `weight_loader`.

    Returns the names of the parameters loaded (a fused parameter only once all its shards
    came). Raises ValueError on checkpoint names that match no parameter (and no ignore
    pattern), on shape mismatches, and on fused parameters that got only some shards."""
    packed = packed_modules_mapping or {}
    ignore = [re.compile(p) for p in ignore_unexpected_patterns]
    params = dict(module.named_parameters())  # tied weights appear once
    expected_shards: dict[str, set[int | str]] = defaultdict(set)
    for fused, shard_id in packed.values():
        expected_shards[fused].add(shard_id)
    got_shards: dict[str, set[int | str]] = defaultdict(set)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for ckpt_name, tensor in weights:
        name, shard_id = _packed_target(ckpt_name, packed)
        param = params.get(name)
        if param is None:
            if not any(p.search(ckpt_name) for p in ignore):
                unexpected.append(ckpt_name)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except ValueError as e:
            raise ValueError(
                f"cannot load checkpoint tensor {ckpt_name!r} into {name!r}: {e}"
            ) from e
        if shard_id is None:
            loaded.add(name)
        else:
            got_shards[name].add(shard_id)
    if unexpected:
        raise ValueError(
            f"checkpoint tensors that match no parameter of {type(module).__name__}: "
            f"{format_names(unexpected)}"
        )
    for name, shards in got_shards.items():
        fused = name.split(".")[-2]
        missing = expected_shards[fused] - shards
        if missing:
            raise ValueError(
                f"{name!r} got checkpoint shards {sorted(map(str, shards))} but not "
                f"{sorted(map(str, missing))}"
            )
        loaded.add(name)
    return loaded
