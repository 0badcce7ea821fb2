"""The input builder interface, and the token-prompt pieces the text model kinds share.

One builder per model kind turns a validated user prompt into the EngineCoreRequest; the
InputProcessor picks it once (`v1.engine.inputs.make_input_builder`) and checks the request's
params with it before building.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import numpy as np

from v1.core.admission import checked_ids
from v1.core.protocol import EncoderInput, EngineCoreRequest
from v1.sampling_params import SamplingParams

if TYPE_CHECKING:
    from v1.config import ModelConfig
    from v1.model_info import ModelInfo

PROMPT_KEYS = {
    "prompt": {"prompt", "multi_modal_data"},
    "prompt_token_ids": {"prompt_token_ids", "token_type_ids"},
    "encoder_prompt": {"encoder_prompt", "decoder_prompt"},
    "text": {"text", "text_pair"},
}


class InputBuilder(ABC):
    """Builds the EngineCoreRequest of one prompt of one model kind."""

    prompt_is_decoder_prompt: bool = False
    """A plain prompt (a string or token ids) is the decoder prompt (decoder-only models), not
    the encoder's input: its tokens are the decoder's, counted against max_model_len."""
    audio_hash_in_core: bool = False
    """Audio inputs (Whisper) of a clip not hashed yet go without their content hash (""): the
    engine core that takes one computes the same digest. Data parallelism: N cores hash on
    their own CPUs instead of the one frontend thread hashing every clip."""

    def __init__(self, model_config: ModelConfig, tokenizer: Any, info: ModelInfo | None = None):
        self.model_config = model_config
        self.info = info if info is not None else model_config.info
        self.tokenizer = tokenizer
        self.vocab_size = model_config.vocab_size
        self.encoder_vocab_size = model_config.encoder_vocab_size
        self.max_model_len = model_config.effective_max_model_len
        self.max_encoder_len = model_config.max_encoder_len

    @abstractmethod
    def check_params(self, params: Any) -> None:
        """ValueError when `params` (SamplingParams or PoolingParams) cannot run on this model."""

    @abstractmethod
    def build(
        self,
        request_id: str,
        prompt: Any,
        params: Any,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> EngineCoreRequest:
        """The request of one prompt (params already checked); ValueError on a bad prompt."""

    @abstractmethod
    def decoder_prompt_len(self, prompt: Any, truncate_prompt_tokens: int | None = None) -> int:
        """Decoder-prompt tokens `prompt` becomes (0 without a decoder), for room checks
        against max_model_len before a request is built."""

    def build_child(
        self,
        first: EngineCoreRequest,
        prompt: Any,
        request_id: str,
        params: Any,
        *,
        priority: int = 0,
    ) -> EngineCoreRequest:
        """Another n > 1 child of the prompt `first` was built from (`params`: its seed)."""
        return self.build(request_id, prompt, params, priority=priority)

    def pretokenize(self, prompts: list[Any]) -> list[Any]:
        """`prompts` for `build`, with the texts this builder tokenizes one by one tokenized in
        one call (a fast tokenizer runs a batch on its own threads). The default: unchanged."""
        return prompts

    def prompt_texts(self, prompt: Any) -> tuple[str | None, str | None]:
        """(decoder prompt text, encoder prompt text) of a prompt, for RequestOutput."""
        if isinstance(prompt, dict) and "encoder_prompt" in prompt:
            return text_of(prompt.get("decoder_prompt")), text_of(prompt["encoder_prompt"])
        return text_of(prompt), None

    def check_room(self, num_decoder_tokens: int, error: type[ValueError] = ValueError) -> None:
        if num_decoder_tokens >= self.max_model_len:
            raise error(
                f"the decoder prompt has {num_decoder_tokens} tokens, which leaves no room to "
                f"generate within max_model_len={self.max_model_len}"
            )

    def check_sampling_params(self, params: Any, *, word_timestamps: bool = False) -> None:
        """The checks of every generating model's params (`word_timestamps`: the model can
        time words)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"{self.model_config.architecture} is a generative model: pass SamplingParams, "
                f"not {type(params).__name__} (embed/classify/score need an encoder-only model)"
            )
        params.validate_for_model(self.vocab_size)
        if params.structured_outputs is not None:
            params.structured_outputs.validate()
        if params.stop and not params.detokenize:
            raise ValueError("stop strings need detokenize=True")
        if params.word_timestamps and not word_timestamps:
            raise ValueError(
                f"word_timestamps needs a Whisper model; {self.model_config.model} is "
                f"{self.model_config.architecture}"
            )


class TokenInputBuilder(InputBuilder):
    """Text prompts as token ids: tokenizing, vocabulary checks and encoder truncation."""

    accepts_token_type_ids: bool = False

    def __init__(self, model_config: ModelConfig, tokenizer: Any, info: ModelInfo | None = None):
        super().__init__(model_config, tokenizer, info)
        self.special_ids = set(tokenizer.all_special_ids)

    def singleton(
        self, prompt: Any, *, add_special_tokens: bool, what: str, vocab_size: int
    ) -> tuple[list[int], list[int] | None]:
        """Token ids (and token type ids) of a string, TextPrompt or TokensPrompt; token ids
        must be inside `vocab_size` (the encoder's vocabulary for encoder inputs: Marian's
        decoder may have a smaller one of its own)."""
        if isinstance(prompt, str):
            text = check_text(prompt, what)
            enc = self.tokenizer(text, add_special_tokens=add_special_tokens)
            ids, type_ids = list(enc["input_ids"]), opt_list(enc.get("token_type_ids"))
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            check_keys(prompt)
            ids = self._check_token_ids(prompt["prompt_token_ids"], what, vocab_size)
            type_ids = opt_list(prompt.get("token_type_ids"))
            if type_ids is not None and not self.accepts_token_type_ids:
                raise ValueError("token_type_ids are only accepted by encoder-only models")
        elif isinstance(prompt, dict) and "prompt" in prompt:
            check_keys(prompt)
            if prompt.get("multi_modal_data") is not None:
                raise self._audio_error()
            return self.singleton(
                prompt["prompt"],
                add_special_tokens=add_special_tokens,
                what=what,
                vocab_size=vocab_size,
            )
        elif isinstance(prompt, dict) and "multi_modal_data" in prompt:
            raise self._audio_error()
        else:
            raise ValueError(
                f"{'an' if what[0] in 'aeiou' else 'a'} {what} must be a string, "
                f"{{'prompt': str}} or {{'prompt_token_ids': "
                f"[int, ...]}}, got {describe(prompt)}"
            )
        if not ids:
            raise ValueError(f"the {what} is empty after tokenization")
        return ids, type_ids

    def fit_encoder(
        self,
        ids: list[int],
        type_ids: list[int] | None,
        truncate: int | None,
        *,
        pair: tuple[str, str] | None = None,
    ) -> tuple[list[int], list[int] | None]:
        """Checks an encoder input against the model's limit, truncating when asked: the FIRST
        tokens are kept and a final special token (EOS / [SEP]) stays last, like the
        tokenizer's own `truncation=True`."""
        limit = self.max_encoder_len if truncate is None else min(truncate, self.max_encoder_len)
        if len(ids) <= limit:
            return ids, type_ids
        if truncate is None:
            raise ValueError(
                f"the input has {len(ids)} tokens, more than this model's limit of {limit} "
                f"(set truncate_prompt_tokens to truncate it)"
            )
        if pair is not None:
            # Text pairs: the tokenizer's longest-first truncation (what cross-encoders use).
            enc = self.tokenizer(*pair, truncation=True, max_length=limit)
            return list(enc["input_ids"]), opt_list(enc.get("token_type_ids"))
        keep_last = ids[-1] in self.special_ids and limit > 1
        head = limit - 1 if keep_last else limit
        tail = ids[-1:] if keep_last else []
        new_type_ids = None
        if type_ids is not None:
            new_type_ids = type_ids[:head] + (type_ids[-1:] if keep_last else [])
        return ids[:head] + tail, new_type_ids

    def _audio_error(self) -> ValueError:
        return ValueError(
            f"multi_modal_data (audio) is only accepted by Whisper models, not "
            f"{self.model_config.architecture}"
        )

    def _check_token_ids(self, ids: Any, what: str, vocab_size: int) -> list[int]:
        if isinstance(ids, np.ndarray):
            return self._check_id_array(ids, what, vocab_size).tolist()
        if not isinstance(ids, (list, tuple)):
            raise ValueError(
                f"prompt_token_ids of the {what} must be a list of ints (or a 1-D integer "
                "numpy array)"
            )
        if not ids:
            raise ValueError(f"the {what} is empty (prompt_token_ids=[])")
        checked = checked_ids(ids, vocab_size)
        if checked is not None:
            return checked
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValueError(f"prompt_token_ids of the {what} must be ints, got {t!r}")
            if not 0 <= t < vocab_size:
                raise ValueError(
                    f"token id {t} in the {what} is outside the {self._vocab_name(vocab_size)} "
                    f"[0, {vocab_size})"
                )
        return list(ids)

    def _check_id_array(self, ids: np.ndarray, what: str, vocab_size: int) -> np.ndarray:
        """A token-id array checked as a list would be: 1-D, integer, ids of the vocabulary."""
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ValueError(
                f"prompt_token_ids of the {what} must be a 1-D integer array, got dtype "
                f"{ids.dtype} and shape {ids.shape}"
            )
        if ids.size == 0:
            raise ValueError(f"the {what} is empty (prompt_token_ids=[])")
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise ValueError(
                f"token id {bad} in the {what} is outside the {self._vocab_name(vocab_size)} "
                f"[0, {vocab_size})"
            )
        return ids

    def _vocab_name(self, vocab_size: int) -> str:
        if self.encoder_vocab_size == self.vocab_size:
            return "vocabulary"
        side = "encoder" if vocab_size == self.encoder_vocab_size else "decoder"
        return f"{side} vocabulary"


def make_encoder_input(token_ids: list[int]) -> EncoderInput:
    """A token encoder input; its hash is the sha256 of the ids as little-endian int64."""
    data = np.asarray(token_ids, dtype="<i8").tobytes()
    return EncoderInput(
        num_encoder_tokens=len(token_ids),
        content_hash=hashlib.sha256(data).hexdigest(),
        token_ids=list(token_ids),
    )


def check_keys(prompt: dict[str, Any]) -> None:
    for key, allowed in PROMPT_KEYS.items():
        if key in prompt:
            extra = set(prompt) - allowed
            if extra:
                raise ValueError(f"unexpected prompt keys {sorted(extra)} next to {key!r}")
            return
    raise ValueError(f"a prompt dict needs one of {sorted(PROMPT_KEYS)}, got {sorted(prompt)}")


def check_text(text: Any, what: str = "prompt") -> str:
    if not isinstance(text, str):
        raise ValueError(f"the {what} text must be a string, got {describe(text)}")
    if not text:
        raise ValueError(f"the {what} is an empty string")
    return text


def text_of(prompt: Any) -> str | None:
    if isinstance(prompt, str):
        return prompt
    return prompt.get("prompt") if isinstance(prompt, dict) else None


def opt_list(values: Any) -> list[int] | None:
    return None if values is None else list(values)


def describe(value: Any) -> str:
    if isinstance(value, dict):
        return f"a dict with keys {sorted(value)}"
    return type(value).__name__


class GenerationInputBuilder(TokenInputBuilder):
    """Token prompts of a generating model (decoder-only or text encoder-decoder): sampling
    parameters, their unset fields filled from the model's generation config (`defaults`)."""

    def __init__(self, model_config: ModelConfig, tokenizer: Any, info: ModelInfo | None = None):
        super().__init__(model_config, tokenizer, info)
        self.defaults = self.info.generation_defaults(tokenizer.eos_token_id)

    def check_params(self, params: Any) -> None:
        self.check_sampling_params(params)
