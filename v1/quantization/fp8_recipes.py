"""Which Linear layers `quantization="fp8"` leaves in the model dtype: the per-architecture
default recipes (measured on the real whisper-base and MiniLM: docs/architecture.md, "FP8")
and the user's `fp8_ignore`, which replaces the default.

An `fp8_ignore` entry is a module name, covering every Linear at or under it (e.g.
"model.encoder.layers.0"), or "re:" and a regular expression a Linear's full name must match
(compressed-tensors' convention), e.g. r"re:.*\\.fc2". Names are the engine's (fused
`qkv_proj`, `kv_proj`), as the log line of a quantized load lists them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

REGEX_PREFIX = "re:"


def check_fp8_ignore(ignore: object) -> list[str]:
    """`ignore` as a list of entries, or ValueError when it is not a list of strings or holds
    a regular expression that does not compile (checked before the model loads)."""
    if isinstance(ignore, str) or not isinstance(ignore, Sequence):
        raise ValueError(
            f"fp8_ignore must be a list of module names or 're:' patterns, got {ignore!r}"
        )
    entries = list(ignore)
    for entry in entries:
        if not isinstance(entry, str) or not entry or entry == REGEX_PREFIX:
            raise ValueError(f"fp8_ignore entries must be non-empty strings, got {entry!r}")
        if entry.startswith(REGEX_PREFIX):
            try:
                re.compile(entry[len(REGEX_PREFIX) :])
            except re.error as e:
                raise ValueError(f"fp8_ignore entry {entry!r} is not a valid regex: {e}") from e
    return entries


def _matches(entry: str, name: str) -> bool:
    if entry.startswith(REGEX_PREFIX):
        return re.fullmatch(entry[len(REGEX_PREFIX) :], name) is not None
    return name == entry or name.startswith(entry + ".")


def fp8_ignored_modules(model: nn.Module, ignore: Sequence[str] | None) -> set[str]:
    """Names of the Linear modules of `model` that stay unquantized: those `ignore` covers, or,
    when None, those the model's default recipe does. An entry covering no Linear is a
    ValueError (a typo, or a checkpoint's unfused name such as `q_proj`)."""
    from v1.models.layers.linear import Linear

    entries = default_fp8_ignore(model) if ignore is None else check_fp8_ignore(ignore)
    names = [name for name, m in model.named_modules() if isinstance(m, Linear)]
    ignored: set[str] = set()
    for entry in entries:
        covered = {name for name in names if _matches(entry, name)}
        if not covered:
            examples = ", ".join(names[:4] + names[-2:]) if names else "none"
            raise ValueError(
                f"fp8_ignore entry {entry!r} covers no Linear layer of {type(model).__name__} "
                f"(its Linear layers are named like {examples})"
            )
        ignored |= covered
    return ignored


# ---- default recipes ----


def default_fp8_ignore(model: nn.Module) -> list[str]:
    """The modules `quantization="fp8"` keeps in the model dtype when the user names none.

    fp8 (e4m3) rounds every weight and activation to ~2.6% relative error whatever the scale
    granularity, so the recipes keep out the GEMMs whose error the output is most sensitive to
    per FLOP they would save (measured per layer and projection, docs/architecture.md):
    - Whisper: encoder layers 0 and 1 (layer 0's attention alone moves the output more than
      layers 1-5 together) and the decoder's per-token GEMMs (a few % of the FLOPs, in
      bandwidth-bound steps) stay; encoder layers 2+ and the cross-attention K/V projection of
      the encoder states (the compute-bound GEMMs over every encoder position) are fp8.
    - BERT family (BERT, RoBERTa, XLM-R encoders and their task heads): the first third of the
      encoder layers (rounded up) is fp8; later layers, pooler and heads are not (a small
      sentence-embedding model loses cosine to fp32 in every layer, the deeper ones most).
    - Other encoder-decoder models (BART, mBART, Marian, T5): the decoder's per-token GEMMs
      stay, as for Whisper; the encoder and the cross-attention K/V projections are fp8. At
      decode batch sizes those GEMMs read few rows, and their fp8 form (an activation
      quantizer per Linear, a row-wise scaled GEMM at small M) was slower: BART-large, 256
      requests of 512 in / 128 out on an H100, every Linear fp8 gave 53,733 tok/s against
      57,436 in fp16; this recipe 58,150 against 57,208 (another machine).
    - Other architectures: every Linear is fp8 (LM heads, embeddings and convolutions never
      are)."""
    from v1.models.bert import BertEncoder
    from v1.models.whisper import WhisperForConditionalGeneration

    if isinstance(model, WhisperForConditionalGeneration):
        return [
            "model.encoder.layers.0",
            "model.encoder.layers.1",
            r"re:model\.decoder\.layers\.\d+\."
            r"(self_attn\.\w+|encoder_attn\.(q_proj|out_proj)|fc1|fc2)",
        ]
    encoders = [(name, m) for name, m in model.named_modules() if isinstance(m, BertEncoder)]
    if encoders:
        return _bert_ignore(model, encoders)
    return _decoder_per_token_linears(model)


def _decoder_per_token_linears(model: nn.Module) -> list[str]:
    """An encoder-decoder model's decoder Linears but the cross-attention K/V projections (of
    the encoder output), by name; none for a model without cross-attention."""
    from v1.models.layers.linear import Linear

    cross_kv = {
        f"{name}.kv_proj" if name else "kv_proj"
        for name, m in model.named_modules()
        if isinstance(getattr(m, "kv_proj", None), Linear)
    }
    if not cross_kv:
        return []
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, Linear)
        and (name.startswith("decoder.") or ".decoder." in name)
        and name not in cross_kv
    ]


def _bert_ignore(model: nn.Module, encoders: list[tuple[str, nn.Module]]) -> list[str]:
    from v1.models.layers.linear import Linear

    quantized: list[str] = []
    ignore: list[str] = []
    for name, encoder in encoders:
        prefix = f"{name}.layer" if name else "layer"
        num_layers = len(encoder.layer)
        num_fp8 = math.ceil(num_layers / 3)
        quantized += [f"{prefix}.{i}" for i in range(num_fp8)]
        ignore += [f"{prefix}.{i}" for i in range(num_fp8, num_layers)]
    # Pooler and task heads: every Linear outside the encoder layers.
    ignore += [
        name
        for name, m in model.named_modules()
        if isinstance(m, Linear)
        and not any(_matches(entry, name) for entry in (*quantized, *ignore))
    ]
    return ignore
