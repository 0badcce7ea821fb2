"""Frontend edge: a user prompt + params -> a validated EngineCoreRequest.

Tokenizes, checks every limit with a clear ValueError (nothing invalid reaches the core), builds
the first-class encoder input of encoder-decoder models and fills sampling defaults from the
model's generation config (`GenerationDefaults`). Whisper audio goes to `whisper_inputs`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
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


@dataclass(frozen=True)
class GenerationDefaults:
    """Generation-config fields that change greedy output, used as sampling defaults.

    Each fills a SamplingParams field the user left unset (None; min_tokens left at 0), and only
    where transformers' generate() applies it too (decoder-only and text encoder-decoder models):
    - forced_bos_token_id -> forced_token_ids=[[0, id]], only for a one-token decoder prompt
      (transformers forces it at decoder length 1 only);
    - forced_eos_token_id -> forced_eos_token_id (forced as the last token of max_tokens);
    - suppress_tokens, begin_suppress_tokens, no_repeat_ngram_size (> 0) -> the same fields;
      begin_suppress_tokens is skipped when forced_bos applies (transformers then suppresses at
      the second output token, which the params cannot express);
    - min_length -> min_tokens = min_length - len(decoder prompt); min_new_tokens -> min_tokens;
      clipped to max_tokens;
    - eos_token_id (generation config, else tokenizer, else model config) is the request's EOS;
      further ids of an EOS list join stop_token_ids unless ignore_eos (as vLLM).
    Not used: max_length (max_tokens keeps vLLM's default of 16; None runs to max_model_len),
    sampling knobs (temperature, top_k, top_p, penalties) and beam search settings.
    """

    decoder_start_token_id: int | None = None
    eos_token_id: int | None = None
    extra_eos_token_ids: tuple[int, ...] = ()
    forced_bos_token_id: int | None = None
    forced_eos_token_id: int | None = None
    suppress_tokens: tuple[int, ...] | None = None
    begin_suppress_tokens: tuple[int, ...] | None = None
    no_repeat_ngram_size: int = 0
    min_length: int = 0
    min_new_tokens: int = 0

    @classmethod
    def from_model(cls, model_config: ModelConfig, tokenizer: Any) -> GenerationDefaults:
        gc = load_generation_config(model_config)
        vocab = model_config.vocab_size
        eos_ids = _id_list(gc.eos_token_id)
        if not eos_ids:
            eos_ids = _id_list(tokenizer.eos_token_id) or _id_list(
                getattr(model_config.hf_config, "eos_token_id", None)
            )
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id in eos_ids else None
        eos = eos if eos is not None else (eos_ids[0] if eos_ids else None)
        start = None
        if model_config.kind == ModelKind.ENCODER_DECODER:
            start = _first_id(gc.decoder_start_token_id)
            if start is None:
                start = _first_id(getattr(model_config.hf_config, "decoder_start_token_id", None))
            start = start if start is not None else _first_id(gc.bos_token_id)
            if start is None:
                raise ValueError(
                    f"{model_config.model} sets no decoder_start_token_id (nor bos_token_id) in "
                    f"its generation config or model config"
                )

        def in_vocab(ids: Any) -> tuple[int, ...] | None:
            ids = _id_list(ids)
            return tuple(t for t in ids if 0 <= t < vocab) or None

        return cls(
            decoder_start_token_id=start,
            eos_token_id=eos,
            extra_eos_token_ids=tuple(t for t in eos_ids if t != eos and 0 <= t < vocab),
            forced_bos_token_id=_first_id(gc.forced_bos_token_id),
            forced_eos_token_id=_first_id(gc.forced_eos_token_id),
            suppress_tokens=in_vocab(gc.suppress_tokens),
            begin_suppress_tokens=in_vocab(gc.begin_suppress_tokens),
            no_repeat_ngram_size=gc.no_repeat_ngram_size or 0,
            min_length=gc.min_length or 0,
            min_new_tokens=gc.min_new_tokens or 0,
        )

    def apply(
        self, params: SamplingParams, num_prompt_tokens: int
    ) -> tuple[SamplingParams, int | None]:
        """(params with the defaults filled in, the request's eos_token_id)."""
        changes: dict[str, Any] = {}
        forced_bos = (
            self.forced_bos_token_id is not None
            and num_prompt_tokens == 1
            and params.forced_token_ids is None
        )
        if forced_bos:
            changes["forced_token_ids"] = [[0, self.forced_bos_token_id]]
        if params.forced_eos_token_id is None and self.forced_eos_token_id is not None:
            changes["forced_eos_token_id"] = self.forced_eos_token_id
        if params.suppress_tokens is None and self.suppress_tokens:
            changes["suppress_tokens"] = list(self.suppress_tokens)
        if params.begin_suppress_tokens is None and self.begin_suppress_tokens and not forced_bos:
            changes["begin_suppress_tokens"] = list(self.begin_suppress_tokens)
        if params.no_repeat_ngram_size is None and self.no_repeat_ngram_size > 0:
            changes["no_repeat_ngram_size"] = self.no_repeat_ngram_size
        min_tokens = max(self.min_length - num_prompt_tokens, self.min_new_tokens)
        if params.min_tokens == 0 and min_tokens > 0:
            cap = params.max_tokens if params.max_tokens is not None else min_tokens
            changes["min_tokens"] = min(min_tokens, cap)
        if self.extra_eos_token_ids and not params.ignore_eos:
            stop_ids = list(params.stop_token_ids or [])
            stop_ids += [t for t in self.extra_eos_token_ids if t not in stop_ids]
            changes["stop_token_ids"] = stop_ids
        return (params.clone(**changes) if changes else params), self.eos_token_id


def load_generation_config(model_config: ModelConfig) -> Any:
    """The model's GenerationConfig as transformers loads it: generation_config.json, else the
    generation fields of config.json, else those of the loaded model config."""
    from transformers import GenerationConfig

    kwargs = {"revision": model_config.revision}
    try:
        return GenerationConfig.from_pretrained(model_config.model, **kwargs)
    except OSError:
        pass
    try:
        return GenerationConfig.from_pretrained(
            model_config.model, config_file_name="config.json", _from_model_config=True, **kwargs
        )
    except OSError:
        return GenerationConfig.from_model_config(model_config.hf_config)


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
    Encoder token ids are checked against the encoder's vocabulary; decoder prompts and sampling
    token ids against the decoder's (Marian's decoder may have a vocabulary of its own).
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
        self.encoder_vocab_size = model_config.encoder_vocab_size
        self.max_model_len = model_config.effective_max_model_len
        self.max_encoder_len = model_config.max_encoder_len
        self.pooling_config: Any = None
        if self.kind == ModelKind.ENCODER_ONLY:
            from v1.models.sentence_transformers import load_pooling_config

            # sentence-transformers max_seq_length (MiniLM: 256), Matryoshka, classifier head.
            self.pooling_config = load_pooling_config(model_config)
            self.max_encoder_len = min(self.max_encoder_len, self.pooling_config.max_input_len)
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
    def process_all(
        self, request_id: str, prompt: Any, params: Any, *, priority: int = 0
    ) -> list[EngineCoreRequest]:
        """The core requests one user request becomes: itself, or its n children for n > 1
        sampling (ids and seeds from ParentRequest). Raises ValueError on invalid input."""
        if isinstance(params, SamplingParams) and params.n > 1:
            from v1.engine.output_processor import ParentRequest

            parent = ParentRequest(request_id, params)
            if self.is_whisper:
                # The audio is decoded and hashed once: children differ in id and seed only.
                ids = parent.child_ids
                first = self.process(ids[0], prompt, parent.child_params(0), priority=priority)
                builder = self._whisper()
                return [first] + [
                    builder.with_params(first, ids[i], parent.child_params(i))
                    for i in range(1, params.n)
                ]
            return [
                self.process(
                    parent.child_request_id(i, request_id),
                    prompt,
                    parent.child_params(i),
                    priority=priority,
                )
                for i in range(params.n)
            ]
        return [self.process(request_id, prompt, params, priority=priority)]

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
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        arrival_time = now() if arrival_time is None else arrival_time
        if self.is_whisper:
            return self._whisper().build(
                request_id, prompt, params, arrival_time=arrival_time, priority=priority
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
            if params.task in ("classify", "score") and not self.has_classifier:
                raise ValueError(
                    f"task {params.task!r} needs a sequence classification model; "
                    f"{self.model_config.architecture} has no classifier head (use task 'embed')"
                )
            from v1.models.sentence_transformers import validate_pooling_params

            validate_pooling_params(self.pooling_config, params)
            return
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
        if params.word_timestamps and not self.is_whisper:
            raise ValueError(
                f"word_timestamps needs a Whisper model; {self.model_config.model} is "
                f"{self.model_config.architecture}"
            )

    @property
    def has_classifier(self) -> bool:
        """A sequence classification model (classify; score as a cross-encoder)."""
        return self.model_config.architecture.endswith("ForSequenceClassification")

    # ---- prompts per model kind ----
    def _decoder_only_input(self, prompt: Any, truncate: int | None) -> list[int]:
        ids, _ = self._singleton(
            prompt, add_special_tokens=True, what="prompt", vocab_size=self.vocab_size
        )
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
        enc_ids, _ = self._singleton(
            enc_prompt,
            add_special_tokens=True,
            what="encoder prompt",
            vocab_size=self.encoder_vocab_size,
        )
        enc_ids, _ = self._fit_encoder(enc_ids, None, truncate)
        dec_ids = [start]
        if dec_prompt is not None:
            ids, _ = self._singleton(
                dec_prompt,
                add_special_tokens=False,
                what="decoder prompt",
                vocab_size=self.vocab_size,
            )
            dec_ids = ids if ids[0] == start else [start, *ids]
        return enc_ids, dec_ids

    def _encoder_only_input(
        self, prompt: Any, truncate: int | None
    ) -> tuple[list[int], list[int] | None]:
        pair: tuple[str, str] | None = None
        if isinstance(prompt, dict) and "text" in prompt:
            _check_keys(prompt)
            pair = (_check_text(prompt["text"]), _check_text(prompt.get("text_pair")))
            enc = self.tokenizer(*pair)
            ids, type_ids = list(enc["input_ids"]), _opt_list(enc.get("token_type_ids"))
        elif isinstance(prompt, dict) and "encoder_prompt" in prompt:
            raise ValueError("encoder/decoder prompt pairs need an encoder-decoder model")
        else:
            ids, type_ids = self._singleton(
                prompt, add_special_tokens=True, what="input", vocab_size=self.encoder_vocab_size
            )
        if type_ids is not None:
            limit = getattr(self.model_config.hf_config, "type_vocab_size", 2)
            if len(type_ids) != len(ids) or any(not 0 <= t < limit for t in type_ids):
                raise ValueError(
                    f"token_type_ids must be one id in [0, {limit}) per input token "
                    f"({len(ids)} tokens, {len(type_ids)} type ids)"
                )
        return self._fit_encoder(ids, type_ids, truncate, pair=pair)

    # ---- shared pieces ----
    def _singleton(
        self, prompt: Any, *, add_special_tokens: bool, what: str, vocab_size: int
    ) -> tuple[list[int], list[int] | None]:
        """Token ids (and token type ids) of a string, TextPrompt or TokensPrompt; token ids
        must be inside `vocab_size` (the encoder's vocabulary for encoder inputs: Marian's
        decoder may have a smaller one of its own)."""
        if isinstance(prompt, str):
            text = _check_text(prompt, what)
            enc = self.tokenizer(text, add_special_tokens=add_special_tokens)
            ids, type_ids = list(enc["input_ids"]), _opt_list(enc.get("token_type_ids"))
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            _check_keys(prompt)
            ids = self._check_token_ids(prompt["prompt_token_ids"], what, vocab_size)
            type_ids = _opt_list(prompt.get("token_type_ids"))
            if type_ids is not None and self.kind != ModelKind.ENCODER_ONLY:
                raise ValueError("token_type_ids are only accepted by encoder-only models")
        elif isinstance(prompt, dict) and "prompt" in prompt:
            _check_keys(prompt)
            if prompt.get("multi_modal_data") is not None:
                raise self._audio_error()
            return self._singleton(
                prompt["prompt"],
                add_special_tokens=add_special_tokens,
                what=what,
                vocab_size=vocab_size,
            )
        elif isinstance(prompt, dict) and "multi_modal_data" in prompt:
            raise self._audio_error()
        else:
            raise ValueError(
                f"a {what} must be a string, {{'prompt': str}} or {{'prompt_token_ids': "
                f"[int, ...]}}, got {_describe(prompt)}"
            )
        if not ids:
            raise ValueError(f"the {what} is empty after tokenization")
        return ids, type_ids

    def _audio_error(self) -> ValueError:
        return ValueError(
            f"multi_modal_data (audio) is only accepted by Whisper models, not "
            f"{self.model_config.architecture}"
        )

    def _check_token_ids(self, ids: Any, what: str, vocab_size: int) -> list[int]:
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"prompt_token_ids of the {what} must be a list of ints")
        if not ids:
            raise ValueError(f"the {what} is empty (prompt_token_ids=[])")
        # Fast path (C speed): all plain ints inside the vocabulary.
        if set(map(type, ids)) == _INT_TYPE and min(ids) >= 0 and max(ids) < vocab_size:
            return list(ids)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValueError(f"prompt_token_ids of the {what} must be ints, got {t!r}")
            if not 0 <= t < vocab_size:
                raise ValueError(
                    f"token id {t} in the {what} is outside the {self._vocab_name(vocab_size)} "
                    f"[0, {vocab_size})"
                )
        return list(ids)

    def _vocab_name(self, vocab_size: int) -> str:
        if self.encoder_vocab_size == self.vocab_size:
            return "vocabulary"
        side = "encoder" if vocab_size == self.encoder_vocab_size else "decoder"
        return f"{side} vocabulary"

    def _fit_encoder(
        self,
        ids: list[int],
        type_ids: list[int] | None,
        truncate: int | None,
        *,
        pair: tuple[str, str] | None = None,
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
        if pair is not None:
            # Text pairs: the tokenizer's longest-first truncation (what cross-encoders use).
            enc = self.tokenizer(*pair, truncation=True, max_length=limit)
            return list(enc["input_ids"]), _opt_list(enc.get("token_type_ids"))
        keep_last = ids[-1] in self.special_ids and limit > 1
        head = limit - 1 if keep_last else limit
        tail = ids[-1:] if keep_last else []
        new_type_ids = None
        if type_ids is not None:
            new_type_ids = type_ids[:head] + (type_ids[-1:] if keep_last else [])
        return ids[:head] + tail, new_type_ids

    @property
    def whisper_builder(self) -> Any:
        """The Whisper input builder (built once; transcription reuses it)."""
        return self._whisper()

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


_INT_TYPE = {int}


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


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(t) for t in value]


def _first_id(value: Any) -> int | None:
    ids = _id_list(value)
    return ids[0] if ids else None


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
