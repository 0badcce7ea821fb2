"""Sampling parameters of a generation request (names follow vLLM).

A msgspec Struct so it crosses the process boundary as-is; `__post_init__` checks every field that
can be checked without the model, `validate_for_model` the rest (vocabulary, lengths).
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from v1.structured_output.params import StructuredOutputsParams

_INT_MAX = 2**31 - 1
"""Largest count or id accepted: every integer field fits the int32/int64 tensors it is written to."""
FLOAT32_MAX = 3.4028234663852886e38
"""Largest float accepted: every float field is written to a float32 tensor."""
MAX_STOP_STRINGS = 128
"""Most stop strings per request: each one is searched for in every new piece of text."""
MAX_STOP_STRING_CHARS = 4096
"""Longest stop string, in characters."""


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
    logprobs_mode: str = "raw"
    """"raw": log_softmax of the model's logits (vLLM's default). "processed": the logits rules
    (penalties, masks, forced and Whisper timestamp tokens) applied to log_softmax of the logits,
    without renormalizing: the scores transformers' beam search adds up."""
    prompt_logprobs: int | None = None
    """Top-N logprobs per prompt token after the first (decoder-only models; the prompt is
    computed in full, without prefix-cache hits)."""
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
    word_timestamps: bool = False
    """Whisper: once the request ends, time its generated text tokens from the cross-attention
    alignment heads (DTW, as openai-whisper): `RequestOutput.extras["token_times"]` holds
    len(text tokens) + 1 boundary times in seconds from the start of the audio window; text
    token k spans [times[k], times[k + 1]]."""
    logit_bias: dict[int, float] | None = None
    """token id -> bias in [-100, 100] added to its logit before sampling (OpenAI semantics)."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to JSON (a schema or any object): a grammar mask at every step."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ValueError (message starting with the field name) for a value outside the
        range its sampling tensor holds. Runs on construction and decoding, and again in the
        EngineCore, which cannot trust an object changed after construction."""
        self._validate_types()
        self._validate_ranges()
        self._validate_lists()
        self._validate_logit_bias_and_structure()

    def _bad(self, name: str, why: str) -> ValueError:
        return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

    def _validate_types(self) -> None:
        """Numbers are numbers: finite floats within float32, integers (not bools) where the
        field is a count or an id."""
        bad = self._bad
        if not _is_int(self.n) or self.n < 1 or self.n > 128:
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
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or abs(value) > FLOAT32_MAX
            ):
                raise bad(name, "must be a finite number (within float32 range)")
        for name in ("top_k", "min_tokens"):
            if not _is_int(getattr(self, name)):
                raise bad(name, "must be an integer")
        for name in (
            "max_tokens",
            "seed",
            "logprobs",
            "truncate_prompt_tokens",
            "no_repeat_ngram_size",
            "forced_eos_token_id",
        ):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise bad(name, "must be an integer or null")

    def _validate_ranges(self) -> None:  # noqa: C901 - a flat list of independent checks
        """Each number within the range its sampling rule and tensor take."""
        bad = self._bad
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not -1 <= self.top_k <= _INT_MAX:
            raise bad("top_k", f"must be -1, 0 (disabled) or a positive integer <= {_INT_MAX}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if self.max_tokens is not None and not 1 <= self.max_tokens <= _INT_MAX:
            raise bad("max_tokens", f"must be in [1, {_INT_MAX}]")
        if not 0 <= self.min_tokens <= _INT_MAX:
            raise bad("min_tokens", f"must be in [0, {_INT_MAX}]")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", "must be in [0, 20]")
        if self.logprobs_mode not in ("raw", "processed"):
            raise bad("logprobs_mode", 'must be "raw" or "processed"')
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= 20
        ):
            raise bad("prompt_logprobs", "must be an integer in [0, 20]")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise bad("seed", "must fit in 64 bits")
        if (
            self.truncate_prompt_tokens is not None
            and not 1 <= self.truncate_prompt_tokens <= _INT_MAX
        ):
            raise bad("truncate_prompt_tokens", f"must be in [1, {_INT_MAX}]")
        if self.no_repeat_ngram_size is not None and not 0 <= self.no_repeat_ngram_size <= _INT_MAX:
            raise bad("no_repeat_ngram_size", f"must be in [0, {_INT_MAX}]")
        if self.forced_eos_token_id is not None and not 0 <= self.forced_eos_token_id <= _INT_MAX:
            raise bad("forced_eos_token_id", "must be a token id")

    def _validate_lists(self) -> None:
        """Stop strings, token id lists, forced tokens and the word-timestamps switch."""
        bad = self._bad
        if self.stop is not None and len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"must hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if self.stop is not None and any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be a list of non-empty strings")
        if self.stop is not None and any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise bad("stop", f"strings must be at most {MAX_STOP_STRING_CHARS} characters")
        for name in (
            "stop_token_ids",
            "suppress_tokens",
            "begin_suppress_tokens",
            "allowed_token_ids",
        ):
            ids = getattr(self, name)
            if ids is not None and not _are_token_ids(ids):
                raise bad(name, "must be a list of token ids (integers in [0, 2**31))")
        if not isinstance(self.word_timestamps, bool):
            raise bad("word_timestamps", "must be a boolean")
        for pair in self.forced_token_ids or []:
            if (
                not isinstance(pair, (list, tuple))
                or len(pair) != 2
                or not all(_is_int(v) and 0 <= v <= _INT_MAX for v in pair)
            ):
                raise bad("forced_token_ids", "must be a list of [output_index, token_id] pairs")

    def _validate_logit_bias_and_structure(self) -> None:
        for token, bias in (self.logit_bias or {}).items():
            if not _is_int(token) or not 0 <= token <= _INT_MAX:
                raise ValueError(f"logit_bias keys must be token ids, got {token!r}")
            if (
                isinstance(bias, bool)
                or not isinstance(bias, (int, float))
                or not -100.0 <= bias <= 100.0
            ):
                raise ValueError(
                    f"logit_bias values must be numbers in [-100, 100], got {bias!r} for {token}"
                )
        if self.structured_outputs is not None:
            if self.ignore_eos:
                raise ValueError(
                    "structured_outputs cannot be combined with ignore_eos (the document ends "
                    "with EOS)"
                )
            if self.min_tokens:
                raise ValueError(
                    "structured_outputs cannot be combined with min_tokens (EOS must stay "
                    "possible once the document is complete)"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def all_stop_token_ids(self) -> list[int]:
        return list(self.stop_token_ids or [])

    def validate_for_model(self, vocab_size: int) -> None:
        """Checks that need the model: every token id inside the vocabulary."""
        if self.forced_eos_token_id is not None and self.forced_eos_token_id >= vocab_size:
            raise ValueError(
                f"forced_eos_token_id {self.forced_eos_token_id} is outside the vocabulary of "
                f"{vocab_size}"
            )
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
        for t in self.logit_bias or {}:
            if t >= vocab_size:
                raise ValueError(f"logit_bias contains {t}, outside the vocabulary of {vocab_size}")
        for pair in self.forced_token_ids or []:
            if len(pair) != 2 or pair[0] < 0 or not 0 <= pair[1] < vocab_size:
                raise ValueError(f"forced_token_ids entry {pair} is not [index, token_id]")

    def clone(self, **changes: object) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)


def _are_token_ids(ids: Any) -> bool:
    """Every entry an int (not a bool) in [0, 2**31): whole-list builtins, since Whisper's
    suppress list (~90 ids) is checked on every window request."""
    if isinstance(ids, (list, tuple)) and ids and set(map(type, ids)) == {int}:
        return min(ids) >= 0 and max(ids) <= _INT_MAX
    return all(_is_int(t) and 0 <= t <= _INT_MAX for t in ids)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
