"""The model's config: what model to run and how to read it (`ModelConfig`), and the checks of
its fp8 options."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from v1.logger import init_logger
from v1.model_info import ModelInfo
from v1.models.registry import ModelKind, ModelSpec, architecture_for, get_model_spec

logger = init_logger("v1.config")  # the package's logger name, as before the split

_DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float", "fp32", "fp16", "bf16")
FP8_IGNORE_REGEX = "re:"
"""Prefix of an `fp8_ignore` entry that is a regular expression over full module names."""


def check_fp8_ignore(ignore: object) -> list[str]:
    """`ignore` as a list of entries, or ValueError when it is not a list of strings or holds
    a regular expression that does not compile (checked before the model loads)."""
    if isinstance(ignore, str) or not isinstance(ignore, Sequence):
        raise ValueError(
            f"fp8_ignore must be a list of module names or 're:' patterns, got {ignore!r}"
        )
    entries = list(ignore)
    for entry in entries:
        if not isinstance(entry, str) or not entry or entry == FP8_IGNORE_REGEX:
            raise ValueError(f"fp8_ignore entries must be non-empty strings, got {entry!r}")
        if entry.startswith(FP8_IGNORE_REGEX):
            try:
                re.compile(entry[len(FP8_IGNORE_REGEX) :])
            except re.error as e:
                raise ValueError(f"fp8_ignore entry {entry!r} is not a valid regex: {e}") from e
    return entries


@dataclass(frozen=True)
class ModelConfig:
    """What model to run and how to read it."""

    model: str
    """Local folder or Hugging Face hub id of the model."""
    tokenizer: str | None = None
    """Tokenizer folder or hub id; defaults to `model`."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) for model, config and tokenizer."""
    dtype: str = "auto"
    """Compute dtype: auto (float32 on CPU, the checkpoint's 16-bit dtype on GPU), float32,
    float16 or bfloat16."""
    max_model_len: int | None = None
    """Longest decoder sequence (prompt + output); defaults to the model's limit, capped at its
    sliding window if it has one (no more than the window may be asked for)."""
    max_encoder_input_len: int | None = None
    """Longest encoder input of one request, in encoder positions (encoder-decoder and
    encoder-only models); defaults to the model's limit. Lower it to serve with a smaller KV
    cache (each request reserves cross-attention blocks for its encoder input). Whisper's is
    fixed (1500)."""
    trust_remote_code: bool = False
    """Allow code from the model repository to run (off by default)."""
    seed: int = 0
    """Seed for random weights in tests and for sampling without a per-request seed."""
    quantization: str | None = None
    """fp8: Linear weights in float8_e4m3 with per-output-channel scales, activations scaled
    per token (torch._scaled_mm on sm89+ GPUs, an exact dequantizing reference elsewhere).
    Checkpoints already in fp8 (their quantization_config) are read as fp8 regardless. Which
    Linear layers stay in the model dtype: `fp8_ignore`."""
    fp8_ignore: list[str] | None = None
    """Linear layers fp8 leaves in the model dtype: module names (each covers the Linear layers
    under it, e.g. model.encoder.layers.0) or 're:' regexes a full name must match. Unset: the
    model's default recipe (Whisper: encoder layers 0-1 and the decoder's per-token GEMMs; BERT
    family: all but the first third of the encoder layers; others: none); [] quantizes every
    Linear. With an fp8 checkpoint, these layers are dequantized in addition to its own."""
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    """Fields set on the loaded HF config (for tests and odd checkpoints)."""
    hf_config: Any = field(default=None, compare=False, repr=False)
    """The transformers config; loaded from `model` when not given."""

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must be a local folder or a hub id, got an empty string")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be None or 'fp8', got {self.quantization!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_encoder_input_len is not None and self.max_encoder_input_len < 1:
            raise ValueError(
                f"max_encoder_input_len must be >= 1, got {self.max_encoder_input_len}"
            )
        if self.hf_config is None:
            from transformers import AutoConfig

            from v1.model_source import check_model_source

            check_model_source(self.model, revision=self.revision)
            if self.tokenizer and self.tokenizer != self.model:
                check_model_source(self.tokenizer, revision=self.revision, what="tokenizer")
            try:
                cfg = AutoConfig.from_pretrained(
                    self.model, revision=self.revision, trust_remote_code=self.trust_remote_code
                )
            except (OSError, ValueError) as e:
                raise ValueError(f"cannot load a model config from {self.model!r}: {e}") from e
            for key, value in self.hf_overrides.items():
                setattr(cfg, key, value)
            object.__setattr__(self, "hf_config", cfg)
        limit = self.derived_max_model_len
        if self.max_model_len is not None and limit is not None and self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} is longer than the model's limit of {limit}"
            )
        self._check_sliding_window()
        self._check_encoder_input_len()
        self._check_fp8_ignore()

    def _check_fp8_ignore(self) -> None:
        if self.fp8_ignore is None:
            return
        object.__setattr__(self, "fp8_ignore", check_fp8_ignore(self.fp8_ignore))
        quantized_checkpoint = getattr(self.hf_config, "quantization_config", None) is not None
        if self.quantization != "fp8" and not quantized_checkpoint:
            raise ValueError(
                "fp8_ignore applies to quantization='fp8' or a checkpoint already in fp8; "
                f"{self.model!r} is neither"
            )

    def _check_encoder_input_len(self) -> None:
        wanted = self.max_encoder_input_len
        if wanted is None:
            return
        if self.kind == ModelKind.DECODER_ONLY:
            raise ValueError(
                f"max_encoder_input_len needs an encoder; {self.architecture} has none"
            )
        limit = self._model_max_encoder_len
        if self.spec.fixed_encoder_len and wanted != limit:
            raise ValueError(
                f"{self.architecture}'s encoder input is always {limit} positions; "
                f"max_encoder_input_len={wanted} cannot change it"
            )
        if wanted > limit:
            raise ValueError(
                f"max_encoder_input_len={wanted} is longer than the model's limit of {limit}"
            )

    def _check_sliding_window(self) -> None:
        """The attention backends have no windowed attention, which equals full attention only
        while a sequence fits in the window: sequences are capped at the window (as vLLM did
        for backends without sliding windows)."""
        window = self.sliding_window
        if window is None:
            return
        if self.max_model_len is not None and self.max_model_len > window:
            raise ValueError(
                f"max_model_len={self.max_model_len} is longer than the sliding window of "
                f"{window} tokens of {self.architecture}: the attention backends do not "
                f"implement windowed attention, so sequences are limited to the window"
            )
        limit = self.derived_max_model_len
        if self.max_model_len is None and (limit is None or window < limit):
            logger.warning(
                "max_model_len is capped at %d (the model allows %s): %s uses sliding-window "
                "attention of %d tokens, which the attention backends do not implement; "
                "inside the window full attention is the same",
                window,
                limit,
                self.architecture,
                window,
            )

    # ---- derived values ----
    @cached_property
    def architecture(self) -> str:
        cfg = self.hf_config
        return architecture_for(getattr(cfg, "architectures", None), cfg.model_type)

    @cached_property
    def spec(self) -> ModelSpec:
        """The model family's row (v1/models/registry.py); ValueError when none serves it."""
        return get_model_spec(self.architecture)

    @property
    def kind(self) -> ModelKind:
        return self.spec.kind

    @cached_property
    def info(self) -> ModelInfo:
        """What the model is and can do (v1.model_info), derived once: every part of a process
        (frontend, EngineCore, model states) reads this one."""
        return ModelInfo(self)

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model

    @cached_property
    def derived_max_model_len(self) -> int | None:
        """The model's own decoder length limit (None: unbounded, e.g. T5 relative positions)."""
        return self.spec.max_decoder_len(self.hf_config)

    @cached_property
    def sliding_window(self) -> int | None:
        """The attention window transformers applies to some layer (None: every layer attends
        to the whole sequence), by the family's rule (`ModelSpec.window`)."""
        return self.spec.window(self.hf_config)

    @cached_property
    def effective_max_model_len(self) -> int:
        """Longest decoder sequence served: max_model_len, else the model's limit (512 when
        unbounded), capped at the sliding window (see `_check_sliding_window`)."""
        if self.max_model_len is not None:
            return self.max_model_len
        limit = self.derived_max_model_len
        limit = limit if limit is not None else 512
        return limit if self.sliding_window is None else min(limit, self.sliding_window)

    @cached_property
    def max_encoder_len(self) -> int:
        """Longest encoder input of one request, in encoder positions (Whisper: 1500):
        max_encoder_input_len, else the model's limit."""
        if self.max_encoder_input_len is not None:
            return self.max_encoder_input_len
        return self._model_max_encoder_len

    @cached_property
    def _model_max_encoder_len(self) -> int:
        if self.kind == ModelKind.DECODER_ONLY:
            return 0
        return self.spec.max_encoder_len(self.hf_config)

    @cached_property
    def vocab_size(self) -> int:
        """The vocabulary the decoder reads and generates from: Marian with
        share_encoder_decoder_embeddings=False gives the decoder its own `decoder_vocab_size`
        (the LM head's size, as in transformers)."""
        cfg = self.hf_config
        if getattr(cfg, "share_encoder_decoder_embeddings", True) is False:
            return getattr(cfg, "decoder_vocab_size", None) or cfg.vocab_size
        return cfg.vocab_size

    @cached_property
    def encoder_vocab_size(self) -> int:
        """The vocabulary of encoder input ids (Marian: the source vocabulary, `vocab_size`);
        the same as `vocab_size` unless the decoder has its own."""
        return self.hf_config.vocab_size

    def torch_dtype(self, device_type: str) -> Any:
        import torch

        names = {
            "float32": torch.float32,
            "float": torch.float32,
            "fp32": torch.float32,
            "float16": torch.float16,
            "half": torch.float16,
            "fp16": torch.float16,
            "bfloat16": torch.bfloat16,
            "bf16": torch.bfloat16,
        }
        if self.dtype != "auto":
            return names[self.dtype]
        if device_type == "cpu":
            return torch.float32
        cfg_dtype = getattr(self.hf_config, "dtype", None) or getattr(
            self.hf_config, "torch_dtype", None
        )
        if isinstance(cfg_dtype, str):
            cfg_dtype = names.get(cfg_dtype)
        if cfg_dtype in (torch.float16, torch.bfloat16):
            return cfg_dtype
        return torch.bfloat16
