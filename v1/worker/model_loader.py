"""Build a model from its config and fill it from safetensors checkpoints (local or the hub).

Only safetensors are read: pickled checkpoints (.bin, .pt) can run code when loaded and are
refused. A model comes back fully loaded or not at all: every parameter must be covered by the
checkpoint (the model's `load_weights` already refuses tensors it does not know).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from torch import nn

from v1.config import ModelConfig
from v1.logger import init_logger
from v1.models.checkpoint_slice import CheckpointSlice
from v1.models.registry import get_model_class
from v1.models.utils import format_names

if TYPE_CHECKING:
    from v1.distributed.parallel_state import TensorParallelGroup

logger = init_logger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
HUB_ALLOW_PATTERNS = [
    "*.safetensors",
    "*.json",
    "*.model",  # sentencepiece
    "*.tiktoken",
    "*.txt",  # merges.txt, vocab.txt
    "tokenizer*",
    "vocab*",
]
# Mistral repos also ship the same weights under other names for mistral's own tools.
HUB_IGNORE_PATTERNS = ["consolidated*", "original/*"]


def resolve_model_path(model: str, revision: str | None = None) -> str:
    """A local folder as is; otherwise download the hub repo's safetensors, configs and
    tokenizer files (nothing else) at `revision` and return the snapshot folder."""
    if os.path.isdir(model):
        return model
    from huggingface_hub import snapshot_download

    return snapshot_download(
        model,
        revision=revision,
        allow_patterns=HUB_ALLOW_PATTERNS,
        ignore_patterns=HUB_IGNORE_PATTERNS,
    )


def weight_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint folder (all shards named by the index if any)."""
    index = os.path.join(path, SAFETENSORS_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
        absent = [f for f in files if not os.path.isfile(f)]
        if absent:
            raise ValueError(f"{index} names shards that are not there: {format_names(absent)}")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    main = [f for f in files if not os.path.basename(f).startswith("consolidated")]
    if main:
        return main
    if files:
        return files
    pickles = sorted(name for name in os.listdir(path) if name.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise ValueError(
            f"{path} holds only pickled checkpoints ({', '.join(pickles)}); safetensors only: "
            "convert them (e.g. transformers' save_pretrained(..., safe_serialization=True))"
        )
    raise ValueError(
        f"no *.safetensors weights in {path} (pickled .bin/.pt checkpoints are never read: "
        "safetensors only)"
    )


def iterate_weights(
    path: str | list[str], lazy: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) on CPU from a checkpoint folder or a list of safetensors files,
    one tensor at a time. lazy: CheckpointSlices instead, read when (and as far as) a
    parameter's loader needs them (tensor-parallel ranks read only their slices)."""
    files = weight_files(path) if isinstance(path, str) else path
    for file in files:
        if not file.endswith(".safetensors"):
            raise ValueError(f"{file}: safetensors only")
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if lazy:
                    yield name, CheckpointSlice.of(f.get_slice(name))  # type: ignore[misc]
                else:
                    yield name, f.get_tensor(name)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def architecture_of(hf_config: Any) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise ValueError("the config names no architecture (hf_config.architectures is empty)")
    return archs[0]


def construct_model(
    hf_config: Any,
    device: str | torch.device,
    dtype: torch.dtype,
    architecture: str | None = None,
    tp: TensorParallelGroup | None = None,
) -> nn.Module:
    """An unloaded model (parameter values undefined) built directly on `device` in `dtype`;
    with `tp`, only this rank's part of each sharded parameter is allocated."""
    model_cls = get_model_class(architecture or architecture_of(hf_config))
    if tp is None:
        with torch.device(device), _default_dtype(dtype):
            return model_cls(hf_config)
    from v1.distributed.tensor_parallel import build_on_meta, shard_model

    with torch.device(device), _default_dtype(dtype), build_on_meta():
        model = model_cls(hf_config)
    return shard_model(model, tp, torch.device(device))


def check_all_loaded(model: nn.Module, loaded: set[str]) -> None:
    """ValueError naming every parameter the checkpoint did not provide."""
    missing = {name for name, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(
            f"checkpoint is missing {len(missing)} parameter(s) of {type(model).__name__}: "
            f"{format_names(missing)}"
        )


def load_model_from_weights(
    hf_config: Any,
    weights: Iterable[tuple[str, torch.Tensor]],
    device: str | torch.device,
    dtype: torch.dtype,
    architecture: str | None = None,
    quantization: str | None = None,
    tp: TensorParallelGroup | None = None,
    fp8_ignore: Sequence[str] | None = None,
) -> nn.Module:
    """Build the model for `hf_config` and load `weights` into it; every parameter must load.
    quantization="fp8" quantizes its Linear layers after loading but those `fp8_ignore` names
    (None: the model class's `default_fp8_ignore`, v1/quantization/fp8_recipes.py); a checkpoint already in
    fp8 (its config's `quantization_config`) is read as such whatever `quantization` says, its
    own high-precision layers and those `fp8_ignore` names left unquantized.
    `tp`: this rank's shard of the model (v1/distributed/tensor_parallel.py)."""
    from v1.quantization.fp8 import quantize_model_fp8
    from v1.quantization.fp8_checkpoint import Fp8CheckpointConfig, Fp8CheckpointReader
    from v1.quantization.fp8_recipes import fp8_ignored_modules

    checkpoint_fp8 = Fp8CheckpointConfig.from_hf_config(hf_config)
    if checkpoint_fp8 is not None and tp is not None and tp.world_size > 1:
        raise ValueError(
            "fp8 checkpoints (quantization_config in config.json) cannot be sharded with "
            "tensor_parallel_size > 1 yet; load the bf16/fp16 checkpoint with quantization='fp8'"
        )
    model = construct_model(hf_config, device, dtype, architecture, tp)
    reader = Fp8CheckpointReader(checkpoint_fp8) if checkpoint_fp8 is not None else None
    if reader is not None:
        reader.track(model)
        weights = reader.read(weights)
    loaded = model.load_weights(weights)
    check_all_loaded(model, loaded)
    if reader is not None:
        keep = fp8_ignored_modules(model, fp8_ignore) if fp8_ignore is not None else set()
        reader.quantize_loaded(model, keep)
    elif quantization == "fp8":
        quantize_model_fp8(model, fp8_ignored_modules(model, fp8_ignore))
    elif quantization is not None:
        raise ValueError(f"unknown quantization {quantization!r}")
    if torch.device(device).type == "cuda":
        from v1.models.layers.embedding import LMHead

        for module in model.modules():
            if isinstance(module, LMHead):
                module.pad_vocab_()
    return model.eval()


def load_model(
    model_config: ModelConfig,
    device: str | torch.device,
    dtype: torch.dtype,
    tp: TensorParallelGroup | None = None,
) -> nn.Module:
    """The model `model_config` names, loaded from its safetensors (local folder or hub id);
    with `tp`, this rank's shard, reading only its slices of the checkpoint."""
    path = resolve_model_path(model_config.model, model_config.revision)
    files = weight_files(path)
    logger.info(
        "loading %s from %d safetensors file(s) in %s", model_config.model, len(files), path
    )
    return load_model_from_weights(
        model_config.hf_config,
        iterate_weights(files, lazy=tp is not None),
        device,
        dtype,
        architecture=model_config.architecture,
        quantization=model_config.quantization,
        tp=tp,
        fp8_ignore=model_config.fp8_ignore,
    )
