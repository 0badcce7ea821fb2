"""Reading a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) onto
our model's Linears, with every check a bad folder needs: missing or malformed files, features
we do not serve, rank above max_lora_rank, targets or shapes of another base model.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import torch

from v1.lora.targets import LoRATargets
from v1.lora_request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_UNSUPPORTED_FLAGS = ("use_dora", "fan_in_fan_out", "lora_bias")


@dataclass
class LoRAAdapter:
    """One adapter on our layers: per Linear, per sub-projection, (A [r, in], B [out, r]) with
    the scaling (lora_alpha / r, or / sqrt(r) with rslora) folded into B. float32, host."""

    lora_int_id: int
    rank: int
    scaling: float
    weights: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)


def _read_config(path: str) -> dict:
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter folder {path!r} does not exist")
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter folder {path!r} has no {CONFIG_FILE}")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"malformed {CONFIG_FILE} in {path!r}: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"malformed {CONFIG_FILE} in {path!r}: not a JSON object")
    return config


def _scaling(config: dict, path: str, max_rank: int) -> tuple[int, float]:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"adapter {path!r} is {peft_type}, only LORA adapters are served")
    for flag in _UNSUPPORTED_FLAGS:
        if config.get(flag):
            raise ValueError(f"adapter {path!r} sets {flag}, which is not supported")
    for name in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(name):
            raise ValueError(f"adapter {path!r} sets {name}, which is not supported")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"malformed {CONFIG_FILE} in {path!r}: r must be an int >= 1")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"malformed {CONFIG_FILE} in {path!r}: lora_alpha must be a number")
    if rank > max_rank:
        raise ValueError(f"adapter {path!r} has rank {rank}, above max_lora_rank={max_rank}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale)


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        raise ValueError(f"LoRA adapter folder {path!r} has no {WEIGHTS_FILE} (safetensors only)")
    try:
        return load_file(weights_path, device="cpu")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"malformed {WEIGHTS_FILE} in {path!r}: {e}") from e


def load_adapter(request: LoRARequest, targets: LoRATargets, max_rank: int) -> LoRAAdapter:
    """The adapter at `request.lora_path` on the layers of `targets`; ValueError naming what
    is wrong with the folder."""
    path = request.lora_path
    rank, scale = _scaling(_read_config(path), path, max_rank)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(path).items():
        name = key.removeprefix(_PREFIX)
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.weight"
            if name.endswith(suffix):
                pairs.setdefault(name.removesuffix(suffix), {})[part] = tensor
                break
        else:
            raise ValueError(f"adapter {path!r} holds {key!r}, not a LoRA A/B weight we serve")
    if not pairs:
        raise ValueError(f"adapter {path!r} holds no LoRA weights")
    adapter = LoRAAdapter(lora_int_id=request.lora_int_id, rank=rank, scaling=scale)
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"adapter {path!r}: {module!r} lacks lora_A or lora_B")
        target, index = targets.resolve(module)
        a, b = ab["lora_A"], ab["lora_B"]
        in_size, out_size = target.input_size, target.output_sizes[index]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_size or b.shape[0] != out_size:
            raise ValueError(
                f"adapter {path!r}: {module!r} has A {tuple(a.shape)}, B {tuple(b.shape)}; the "
                f"model's layer takes {in_size} -> {out_size} features (an adapter for another "
                "base model?)"
            )
        if a.shape[0] != b.shape[1] or a.shape[0] > max_rank:
            raise ValueError(
                f"adapter {path!r}: {module!r} has rank {a.shape[0]} (B {b.shape[1]}), "
                f"max_lora_rank={max_rank}"
            )
        subs = adapter.weights.setdefault(target.name, {})
        if index in subs:
            raise ValueError(f"adapter {path!r}: {module!r} given twice")
        subs[index] = (a.float(), b.float() * scale)
    return adapter
