"""Where each PEFT target module of an adapter lands in our model: the Linear (fused or not),
which of its sub-projections (q/k/v of a QKV Linear, gate/up of a gate-up Linear), and whether
it is fed encoder rows. Built from the model's own declarations and checkpoint renames.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from v1.models.layers.linear import Linear


@dataclass(frozen=True)
class LoRATarget:
    """One of our Linears as LoRA sees it."""

    name: str
    """Module name in our model."""
    input_size: int
    output_sizes: tuple[int, ...]
    """Sub-projections along the output (one for an unfused Linear); each gets its own A/B."""
    encoder_side: bool
    """Fed encoder rows (encoder layers, cross-attention K/V): reads the encoder indices."""


class LoRATargets:
    """The LoRA view of one model (built on any device, the meta device included)."""

    def __init__(self, model: nn.Module) -> None:
        if not hasattr(model, "lora_target"):
            raise ValueError(f"{type(model).__name__} does not support LoRA adapters")
        self.model = model
        self.allowed = frozenset(model.lora_target_modules)
        encoder = model.lora_encoder_modules
        encoder_re = re.compile(encoder) if encoder else None
        self.linears: dict[str, Linear] = {
            name: m for name, m in model.named_modules() if isinstance(m, Linear)
        }
        self.targets: dict[str, LoRATarget] = {
            name: LoRATarget(
                name=name,
                input_size=m.input_size,
                output_sizes=tuple(getattr(m, "output_sizes", (m.output_size,))),
                encoder_side=bool(encoder_re and encoder_re.search(name)),
            )
            for name, m in self.linears.items()
        }

    def resolve(self, peft_module: str) -> tuple[LoRATarget, int]:
        """A PEFT module name (the checkpoint's, e.g. model.layers.0.self_attn.q_proj) ->
        (our Linear, the sub-projection index in it). ValueError when the model has none."""
        leaf = peft_module.rsplit(".", 1)[-1]
        if leaf not in self.allowed:
            raise ValueError(
                f"LoRA target module {peft_module!r} is not supported for "
                f"{type(self.model).__name__} (supported: {sorted(self.allowed)})"
            )
        local, shard_id = self.model.lora_target(peft_module)
        target = self.targets.get(local)
        if target is None:
            raise ValueError(
                f"LoRA target module {peft_module!r} matches no layer of "
                f"{type(self.model).__name__} (an adapter for another base model?)"
            )
        if shard_id is None:
            if len(target.output_sizes) != 1:
                raise ValueError(f"LoRA target {peft_module!r} names a whole fused layer")
            return target, 0
        start, _ = self.linears[local].shard_range(shard_id)
        offsets = [sum(target.output_sizes[:i]) for i in range(len(target.output_sizes))]
        return target, offsets.index(start)


def lora_targets_for_config(hf_config: Any, architecture: str) -> LoRATargets:
    """The LoRA view of a model built on the meta device (no memory): what a frontend checks
    adapters against before any reaches the engine."""
    from v1.models.registry import get_model_class

    with torch.device("meta"):
        model = get_model_class(architecture)(hf_config)
    return LoRATargets(model)
