"""Sampling parameters of a generation request (names follow vLLM).

A msgspec Struct so it crosses the process boundary as-is; `__post_init__` checks every field that
can be checked without the model, `validate_for_model` the rest (vocabulary, lengths).
"""

from __future__ import annotations

import math

import msgspec

_INT_MAX = 2**31 - 1


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    n: int = 1
    """Completions per prompt."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 (or -1) disables top-k."""
    min_p: float = 0.0
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever else is in the batch."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    """None: up to the model's length limit."""
    min_tokens: int = 0
    """EOS and stop token ids are suppressed until this many tokens are generated."""
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    """Top-N logprobs per generated token (the sampled token's logprob is always included)."""
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    truncate_prompt_tokens: int | None = None
    """Keep only the last N prompt tokens (encoder prompt for encoder-decoder models)."""
    # Generation-config rules (filled from the model's generation_config when left None).
    no_repeat_ngram_size: int | None = None
    suppress_tokens: list[int] | None = None
    """Token ids never generated."""
    begin_suppress_tokens: list[int] | None = None
    """Token ids not generated as the first output token."""
    forced_token_ids: list[list[int]] | None = None
    """[[output_index, token_id], ...]: the token forced at that output index (forced_bos)."""
    forced_eos_token_id: int | None = None
    """Forced as the last token when max length is reached."""
    allowed_token_ids: list[int] | None = None
    """Only these token ids may be generated (e.g. Whisper language detection)."""
    whisper_timestamps: bool = False
    """Apply Whisper's timestamp rules (set by the Whisper input path)."""

    def __post_init__(self) -> None:
        self._check()

    def _check(self) -> None:  # noqa: C901 - a flat list of independent checks
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1 or self.n > 128:
            raise bad("n", "must be an integer in [1, 128]")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, "must be a finite number")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", "must be -1, 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if self.max_tokens is not None and not 1 <= self.max_tokens <= _INT_MAX:
            raise bad("max_tokens", "must be >= 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", "must be in [0, 20]")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise bad("seed", "must fit in 64 bits")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise bad("truncate_prompt_tokens", "must be >= 1")
        if self.no_repeat_ngram_size is not None and self.no_repeat_ngram_size < 0:
            raise bad("no_repeat_ngram_size", "must be >= 0")
        if self.stop is not None and any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be a list of non-empty strings")
        for name in (
            "stop_token_ids",
            "suppress_tokens",
            "begin_suppress_tokens",
            "allowed_token_ids",
        ):
            ids = getattr(self, name)
            if ids is not None and any(not isinstance(t, int) or t < 0 for t in ids):
                raise bad(name, "must be a list of non-negative token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def all_stop_token_ids(self) -> list[int]:
        return list(self.stop_token_ids or [])

    def validate_for_model(self, vocab_size: int) -> None:
        """Checks that need the model: every token id inside the vocabulary."""
        for name in (
            "stop_token_ids",
            "suppress_tokens",
            "begin_suppress_tokens",
            "allowed_token_ids",
        ):
            ids = getattr(self, name) or []
            for t in ids:
                if t >= vocab_size:
                    raise ValueError(f"{name} contains {t}, outside the vocabulary of {vocab_size}")
        for pair in self.forced_token_ids or []:
            if len(pair) != 2 or pair[0] < 0 or not 0 <= pair[1] < vocab_size:
                raise ValueError(f"forced_token_ids entry {pair} is not [index, token_id]")

    def clone(self, **changes: object) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)
