"""ModelConfig's derived values: the sliding-window cap on max_model_len (the attention backends
have no windowed attention) and Marian's separate encoder and decoder vocabularies."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import transformers

from v1.config import ModelConfig

MAX_POSITIONS = 64


def tiny_hf_config(model_type: str, **overrides: Any) -> Any:
    """A 2-layer decoder-only transformers config (sizes do not matter here)."""
    base = dict(
        vocab_size=128,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=MAX_POSITIONS,
    )
    return transformers.AutoConfig.for_model(model_type, **{**base, **overrides})


def make_model_config(hf_config: Any, **kwargs: Any) -> ModelConfig:
    return ModelConfig(model=f"tiny-{hf_config.model_type}", hf_config=hf_config, **kwargs)


# ---- sliding windows ----


def test_sliding_window_caps_max_model_len(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="v1.config"):
        mc = make_model_config(tiny_hf_config("mistral", sliding_window=16))
    assert mc.sliding_window == 16
    assert mc.derived_max_model_len == MAX_POSITIONS
    assert mc.effective_max_model_len == 16
    (record,) = [r for r in caplog.records if r.name == "v1.config"]
    assert record.levelno == logging.WARNING
    assert "capped at 16" in record.getMessage() and "sliding-window" in record.getMessage()


def test_explicit_max_model_len_and_the_window(caplog: pytest.LogCaptureFixture) -> None:
    hf_config = tiny_hf_config("mistral", sliding_window=16)
    with pytest.raises(
        ValueError, match="max_model_len=32 is longer than the sliding window of 16"
    ):
        make_model_config(hf_config, max_model_len=32)
    with caplog.at_level(logging.WARNING, logger="v1.config"):
        assert make_model_config(hf_config, max_model_len=12).effective_max_model_len == 12
        assert make_model_config(hf_config, max_model_len=16).effective_max_model_len == 16
    assert not [r for r in caplog.records if r.name == "v1.config"]  # nothing was capped


@pytest.mark.parametrize(
    ("model_type", "overrides", "window"),
    [
        ("mistral", {"sliding_window": None}, None),
        ("mistral", {"sliding_window": 4 * MAX_POSITIONS}, 4 * MAX_POSITIONS),  # caps nothing
        # Qwen2 windows only with use_sliding_window, and only layers >= max_window_layers.
        ("qwen2", {"sliding_window": 16, "use_sliding_window": False}, None),
        ("qwen2", {"sliding_window": 16, "use_sliding_window": True, "max_window_layers": 1}, 16),
        ("qwen2", {"sliding_window": 16, "use_sliding_window": True, "max_window_layers": 2}, None),
        (
            "qwen2",
            {
                "sliding_window": 16,
                "use_sliding_window": True,
                "layer_types": ["full_attention"] * 2,
            },
            None,
        ),
        ("llama", {}, None),
    ],
)
def test_sliding_window_rules(
    model_type: str, overrides: dict[str, Any], window: int | None
) -> None:
    hf_config = tiny_hf_config(model_type, **overrides)
    if model_type == "qwen2":  # transformers' own per-layer rule agrees
        windowed = [t == "sliding_attention" for t in hf_config.layer_types]
        assert (hf_config.sliding_window if any(windowed) else None) == window
    mc = make_model_config(hf_config)
    assert mc.sliding_window == window
    expected_len = MAX_POSITIONS if window is None else min(window, MAX_POSITIONS)
    assert mc.effective_max_model_len == expected_len


# ---- vocabularies ----


def marian_config(**overrides: Any) -> Any:
    return transformers.MarianConfig(
        vocab_size=128, d_model=16, encoder_layers=1, decoder_layers=1, **overrides
    )


@pytest.mark.parametrize(
    ("hf_config", "encoder_vocab", "decoder_vocab"),
    [
        (marian_config(decoder_vocab_size=96, share_encoder_decoder_embeddings=False), 128, 96),
        # Shared embeddings: transformers sizes the LM head by vocab_size, whatever
        # decoder_vocab_size says.
        (marian_config(decoder_vocab_size=96), 128, 128),
        (tiny_hf_config("llama"), 128, 128),
    ],
    ids=["marian-own-decoder-vocab", "marian-shared", "llama"],
)
def test_encoder_and_decoder_vocab_sizes(
    hf_config: Any, encoder_vocab: int, decoder_vocab: int
) -> None:
    mc = make_model_config(hf_config)
    assert (mc.encoder_vocab_size, mc.vocab_size) == (encoder_vocab, decoder_vocab)
