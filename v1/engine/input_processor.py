"""Frontend edge: a user prompt + params -> a validated EngineCoreRequest.

Tokenizes, checks every limit with a clear ValueError (nothing invalid reaches the core), builds
the first-class encoder input of encoder-decoder models and fills sampling defaults from the
model's generation config (`GenerationDefaults`). Whisper audio goes to `whisper_inputs`.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from v1.config import ModelConfig, ModelKind
from v1.core.protocol import EncoderInput, EngineCoreRequest, now
from v1.pooling_params import PoolingParams
from v1.sampling_params import SamplingParams

Params = SamplingParams | PoolingParams

_PROMPT_KEYS = {
    "prompt": {"prompt", "multi_modal_data"},
    "prompt_token_ids": {"prompt_token_ids", "token_type_ids"},
    "encoder_prompt": {"encoder_prompt", "decoder_prompt"},
    "text": {"text", "text_pair"},
}


class InputProcessor:
    """Turns prompts into EngineCoreRequests for one model (see DESIGN.md section 2).

    - decoder-only: a string or {"prompt_token_ids"} is the decoder prompt;
      truncate_prompt_tokens keeps its LAST N tokens (as vLLM).
    - encoder-decoder (text): a string or token ids are the ENCODER input and the decoder starts
      from [decoder_start_token_id]; {"encoder_prompt", "decoder_prompt"} sets both (a decoder
      string is tokenized without special tokens; decoder_start_token_id is prepended unless the
      prompt starts with it, as transformers does with decoder_input_ids).
    - encoder-only: the text (or a text pair, with token_type_ids) is the input.
    Encoder inputs longer than the model allows are an error unless truncate_prompt_tokens is set;
    then the FIRST tokens are kept and a final special token (EOS / [SEP]) stays last, like the
    tokenizer's own `truncation=True`.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: Any,
        *,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.kind = model_config.kind
        self.vocab_size = model_config.vocab_size
        self.max_model_len = model_config.effective_max_model_len
        self.max_encoder_len = model_config.max_encoder_len
        if self.kind == ModelKind.ENCODER_ONLY and max_num_batched_tokens is not None:
            # An encoder-only input runs whole in one step.
            self.max_encoder_len = min(self.max_encoder_len, max_num_batched_tokens)
        self.special_ids = set(tokenizer.all_special_ids)
        self.is_whisper = model_config.is_whisper
        self.defaults: GenerationDefaults | None = None
        if self.kind != ModelKind.ENCODER_ONLY and not self.is_whisper:
            self.defaults = GenerationDefaults.from_model(model_config, tokenizer)
        self._whisper_builder: Any = None

    # ---- public ----
    def process(
        self,
        request_id: str,
        prompt: Any,
        params: Params,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> EngineCoreRequest:
        """Validates and tokenizes one prompt; raises ValueError on anything the core would
        reject or the model cannot serve."""
        self._check_params(params)
        arrival_time = now() if arrival_time is None else arrival_time
        if self.is_whisper:
            return self._whisper().build(
                request_id, prompt, params, arrival_time=arrival_time, priority=priority
            )
        if isinstance(prompt, dict) and "multi_modal_data" in prompt:
            _check_keys(prompt)
            raise ValueError(
                f"multi_modal_data (audio) is only accepted by Whisper models, not "
                f"{self.model_config.architecture}"
            )
        if self.kind == ModelKind.ENCODER_ONLY:
            assert isinstance(params, PoolingParams)
            ids, type_ids = self._encoder_only_input(prompt, params.truncate_prompt_tokens)
            return EngineCoreRequest(
                request_id=request_id,
                prompt_token_ids=ids,
                pooling_params=params,
                token_type_ids=type_ids,
                arrival_time=arrival_time,
                priority=priority,
            )
        assert isinstance(params, SamplingParams) and self.defaults is not None
        encoder_input = None
        if self.kind == ModelKind.ENCODER_DECODER:
            enc_ids, dec_ids = self._encoder_decoder_input(prompt, params.truncate_prompt_tokens)
            encoder_input = make_encoder_input(enc_ids)
        else:
            dec_ids = self._decoder_only_input(prompt, params.truncate_prompt_tokens)
        if len(dec_ids) >= self.max_model_len:
            raise ValueError(
                f"the decoder prompt has {len(dec_ids)} tokens, which leaves no room to generate "
                f"within max_model_len={self.max_model_len}"
            )
        params, eos_token_id = self.defaults.apply(params, len(dec_ids))
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=dec_ids,
            sampling_params=params,
            encoder_input=encoder_input,
            eos_token_id=eos_token_id,
            arrival_time=arrival_time,
            priority=priority,
        )

    def process_pair(
        self,
        request_id: str,
        text_a: str,
        text_b: str,
        pooling_params: PoolingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> EngineCoreRequest:
        """A text pair for a cross-encoder, tokenized as one input with segment ids."""
        return self.process(
            request_id,
            {"text": text_a, "text_pair": text_b},
            pooling_params,
            arrival_time=arrival_time,
            priority=priority,
        )

    def prompt_texts(self, prompt: Any) -> tuple[str | None, str | None]:
        """(decoder prompt text, encoder prompt text) of a prompt, for RequestOutput."""
        if isinstance(prompt, dict) and "encoder_prompt" in prompt:
            return _text_of(prompt.get("decoder_prompt")), _text_of(prompt["encoder_prompt"])
        if self.kind == ModelKind.ENCODER_DECODER and not self.is_whisper:
            return None, _text_of(prompt)
        return _text_of(prompt), None

    # ---- params ----
    def _check_params(self, params: Any) -> None:
        if self.kind == ModelKind.ENCODER_ONLY:
            if not isinstance(params, PoolingParams):
                raise ValueError(
                    f"{self.model_config.architecture} is an encoder-only (pooling) model: use "
                    f"embed/classify/score with PoolingParams, not {type(params).__name__}"
                )
            if params.task in ("classify", "score") and not self._has_classifier:
                raise ValueError(
                    f"task {params.task!r} needs a sequence classification model; "
                    f"{self.model_config.architecture} has no classifier head (use task 'embed')"
                )
            return
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"{self.model_config.architecture} is a generative model: pass SamplingParams, "
                f"not {type(params).__name__} (embed/classify/score need an encoder-only model)"
            )
        params.validate_for_model(self.vocab_size)
        if params.stop and not params.detokenize:
            raise ValueError("stop strings need detokenize=True")

    @property
    def _has_classifier(self) -> bool:
        return self.model_config.architecture.endswith("ForSequenceClassification")

    # ---- prompts per model kind ----
    def _decoder_only_input(self, prompt: Any, truncate: int | None) -> list[int]:
        ids, _ = self._singleton(prompt, add_special_tokens=True, what="prompt")
        if truncate is not None and len(ids) > truncate:
            ids = ids[-truncate:]
        return ids

    def _encoder_decoder_input(
        self, prompt: Any, truncate: int | None
    ) -> tuple[list[int], list[int]]:
        start = self.defaults.decoder_start_token_id
        if isinstance(prompt, dict) and "encoder_prompt" in prompt:
            _check_keys(prompt)
            enc_prompt, dec_prompt = prompt["encoder_prompt"], prompt.get("decoder_prompt")
        else:
            enc_prompt, dec_prompt = prompt, None
        if isinstance(enc_prompt, dict) and "encoder_prompt" in enc_prompt:
            raise ValueError("an encoder_prompt cannot itself be an encoder/decoder pair")
        enc_ids, _ = self._singleton(enc_prompt, add_special_tokens=True, what="encoder prompt")
        enc_ids, _ = self._fit_encoder(enc_ids, None, truncate, text=None)
        dec_ids = [start]
        if dec_prompt is not None:
            ids, _ = self._singleton(dec_prompt, add_special_tokens=False, what="decoder prompt")
            dec_ids = ids if ids[0] == start else [start, *ids]
        return enc_ids, dec_ids

    def _encoder_only_input(
        self, prompt: Any, truncate: int | None
    ) -> tuple[list[int], list[int] | None]:
        text: tuple[str, ...] | None = None
        if isinstance(prompt, dict) and "text" in prompt:
            _check_keys(prompt)
            text = (_check_text(prompt["text"]), _check_text(prompt["text_pair"]))
            enc = self.tokenizer(*text)
            ids, type_ids = list(enc["input_ids"]), _opt_list(enc.get("token_type_ids"))
        elif isinstance(prompt, dict) and "encoder_prompt" in prompt:
            raise ValueError("encoder/decoder prompt pairs need an encoder-decoder model")
        else:
            ids, type_ids = self._singleton(prompt, add_special_tokens=True, what="input")
            if isinstance(prompt, (str, dict)) and "prompt_token_ids" not in prompt:
                text = (prompt if isinstance(prompt, str) else prompt["prompt"],)
        if type_ids is not None:
            limit = getattr(self.model_config.hf_config, "type_vocab_size", 2)
            if len(type_ids) != len(ids) or any(not 0 <= t < limit for t in type_ids):
                raise ValueError(
                    f"token_type_ids must be one id in [0, {limit}) per input token "
                    f"({len(ids)} tokens, {len(type_ids)} type ids)"
                )
        return self._fit_encoder(ids, type_ids, truncate, text=text)

    # ---- shared pieces ----
    def _singleton(
        self, prompt: Any, *, add_special_tokens: bool, what: str
    ) -> tuple[list[int], list[int] | None]:
        """Token ids (and token type ids) of a string, TextPrompt or TokensPrompt."""
        if isinstance(prompt, str):
            text = _check_text(prompt, what)
            enc = self.tokenizer(text, add_special_tokens=add_special_tokens)
            ids, type_ids = list(enc["input_ids"]), _opt_list(enc.get("token_type_ids"))
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            _check_keys(prompt)
            ids = self._check_token_ids(prompt["prompt_token_ids"], what)
            type_ids = _opt_list(prompt.get("token_type_ids"))
            if type_ids is not None and self.kind != ModelKind.ENCODER_ONLY:
                raise ValueError("token_type_ids are only accepted by encoder-only models")
        elif isinstance(prompt, dict) and "prompt" in prompt:
            _check_keys(prompt)
            return self._singleton(prompt["prompt"], add_special_tokens=add_special_tokens, what=what)
        else:
            raise ValueError(
                f"a {what} must be a string, {{'prompt': str}} or {{'prompt_token_ids': "
                f"[int, ...]}}, got {_describe(prompt)}"
            )
        if not ids:
            raise ValueError(f"the {what} is empty after tokenization")
        return ids, type_ids

    def _check_token_ids(self, ids: Any, what: str) -> list[int]:
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"prompt_token_ids of the {what} must be a list of ints")
        if not ids:
            raise ValueError(f"the {what} is empty (prompt_token_ids=[])")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValueError(f"prompt_token_ids of the {what} must be ints, got {t!r}")
            if not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"token id {t} in the {what} is outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )
        return list(ids)

    def _fit_encoder(
        self,
        ids: list[int],
        type_ids: list[int] | None,
        truncate: int | None,
        *,
        text: tuple[str, ...] | None,
    ) -> tuple[list[int], list[int] | None]:
        """Checks an encoder input against the model's limit, truncating when asked."""
        limit = self.max_encoder_len if truncate is None else min(truncate, self.max_encoder_len)
        if len(ids) <= limit:
            return ids, type_ids
        if truncate is None:
            raise ValueError(
                f"the input has {len(ids)} tokens, more than this model's limit of {limit} "
                f"(set truncate_prompt_tokens to truncate it)"
            )
        if text is not None:
            # The tokenizer truncates text (and text pairs) the way the model was trained on.
            enc = self.tokenizer(*text, truncation=True, max_length=limit)
            return list(enc["input_ids"]), _opt_list(enc.get("token_type_ids"))
        keep_last = ids[-1] in self.special_ids and limit > 1
        head = limit - 1 if keep_last else limit
        tail = ids[-1:] if keep_last else []
        new_type_ids = None
        if type_ids is not None:
            new_type_ids = type_ids[:head] + (type_ids[-1:] if keep_last else [])
        return ids[:head] + tail, new_type_ids

    def _whisper(self) -> Any:
        if self._whisper_builder is None:
            from v1.engine.whisper_inputs import WhisperInputBuilder

            self._whisper_builder = WhisperInputBuilder(self.model_config, self.tokenizer)
        return self._whisper_builder


def make_encoder_input(token_ids: list[int]) -> EncoderInput:
    """A token encoder input; its hash is the sha256 of the ids as little-endian int64."""
    data = np.asarray(token_ids, dtype="<i8").tobytes()
    return EncoderInput(
        num_encoder_tokens=len(token_ids),
        content_hash=hashlib.sha256(data).hexdigest(),
        token_ids=list(token_ids),
    )


def _check_keys(prompt: dict[str, Any]) -> None:
    for key, allowed in _PROMPT_KEYS.items():
        if key in prompt:
            extra = set(prompt) - allowed
            if extra:
                raise ValueError(f"unexpected prompt keys {sorted(extra)} next to {key!r}")
            return
    raise ValueError(f"a prompt dict needs one of {sorted(_PROMPT_KEYS)}, got {sorted(prompt)}")


def _check_text(text: Any, what: str = "prompt") -> str:
    if not isinstance(text, str):
        raise ValueError(f"the {what} text must be a string, got {_describe(text)}")
    if not text:
        raise ValueError(f"the {what} is an empty string")
    return text


def _text_of(prompt: Any) -> str | None:
    if isinstance(prompt, str):
        return prompt
    return prompt.get("prompt") if isinstance(prompt, dict) else None


def _opt_list(values: Any) -> list[int] | None:
    return None if values is None else list(values)


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return f"a dict with keys {sorted(value)}"
    return type(value).__name__
