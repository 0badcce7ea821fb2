"""Whisper requests at the frontend edge: one audio window + a decoder prompt -> EngineCoreRequest.

Checks the audio, language and task, builds the decoder prompt from `ModelInfo.whisper_tokens`
and fills Whisper's sampling defaults. Built once per engine; the transcription plans use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from v1.audio import SAMPLE_RATE, AudioClip, AudioError, load_audio
from v1.core.protocol import EncoderInput, EngineCoreRequest, now
from v1.engine.inputs.base import InputBuilder
from v1.model_info import WHISPER_TASKS as TASKS
from v1.model_info import WhisperTokens, in_vocab
from v1.sampling_params import SamplingParams

if TYPE_CHECKING:
    from v1.config import ModelConfig
    from v1.model_info import ModelInfo

WINDOW_SECONDS = 30.0
"""Audio one request (one encoder input) holds."""
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "multi_modal_data", "language", "task"})
_VERBATIM_PREFIXES = ("<|startoftranscript|>", "<|startofprev|>")


class WhisperInputError(ValueError):
    """A Whisper prompt, language or task that cannot be served; the message says why."""


class WhisperInputBuilder(InputBuilder):
    """Builds the EngineCoreRequest of one Whisper window.

    Prompt forms (`build`):
    - `{"prompt": text, "multi_modal_data": {"audio": audio}, "language": ..., "task": ...}`:
      `text` (may be empty) is previous-text prompting; the decoder prompt is
      `<|startofprev|> text` (when given) `<|startoftranscript|><|lang|><|task|>` and
      `<|notimestamps|>` unless `params.whisper_timestamps`. `language` defaults to English
      (automatic detection is `Transcriber`'s job); English-only models take no language token.
    - the same with a text starting with `<|startoftranscript|>` or `<|startofprev|>`, or with
      `"prompt_token_ids"`: the decoder prompt verbatim (as vLLM's Whisper prompts).
    `audio` is anything `v1.audio.load_audio` reads (path, bytes, `(samples, sample_rate)`) or
    an `AudioClip`, at most one 30 s window long. 16 kHz mono float32 samples are used in place
    (not copied: leave them unchanged until the request ends); the content hash is computed once
    per clip (requests made from one `AudioClip` reuse it).
    """

    def __init__(
        self, model_config: ModelConfig, tokenizer: Any, info: ModelInfo | None = None
    ) -> None:
        super().__init__(model_config, tokenizer, info)
        tokens = self.info.whisper_tokens
        assert tokens is not None, f"{model_config.architecture} is not a Whisper model"
        self.tokens: WhisperTokens = tokens
        self.num_encoder_tokens: int = model_config.max_encoder_len
        gc = self.info.generation_config
        self.suppress_tokens = in_vocab(gc.suppress_tokens, self.vocab_size)
        self.begin_suppress_tokens = in_vocab(gc.begin_suppress_tokens, self.vocab_size)
        self.max_prompt_text_tokens = model_config.hf_config.max_target_positions // 2 - 1
        """Previous-text tokens kept (the last ones), as openai-whisper and transformers."""

    def check_params(self, params: Any) -> None:
        self.check_sampling_params(params, word_timestamps=True)

    def check_alignment_heads(self) -> None:
        """Word timestamps read the cross-attention heads the generation config names
        (`alignment_heads`, [decoder layer, head] pairs): WhisperInputError without them."""
        heads = [list(pair) for pair in self.info.alignment_heads]
        if not heads:
            raise WhisperInputError(
                "word timestamps need the checkpoint's alignment_heads; the generation config "
                f"of {self.model_config.model} has none"
            )
        cfg = self.model_config.hf_config
        layers, num_heads = cfg.decoder_layers, cfg.decoder_attention_heads
        outside = [
            pair
            for pair in heads
            if len(pair) != 2 or not (0 <= pair[0] < layers and 0 <= pair[1] < num_heads)
        ]
        if outside:
            raise WhisperInputError(
                f"alignment_heads {outside} of the generation config are outside the decoder "
                f"({layers} layers of {num_heads} heads): word timestamps cannot be computed"
            )

    # ---- public ----
    def build(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> EngineCoreRequest:
        """Raises ValueError (AudioError / WhisperInputError) on anything that cannot run."""
        _check_prompt(prompt)
        if params.word_timestamps:
            self.check_alignment_heads()
        decoder_ids = self._decoder_prompt(prompt, params.whisper_timestamps)
        self.check_room(len(decoder_ids), WhisperInputError)
        clip = self._audio(prompt.get("multi_modal_data"))
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=decoder_ids,
            sampling_params=self.sampling_params(params, len(decoder_ids)),
            encoder_input=self.encoder_input(clip),
            eos_token_id=self.tokens.eos,
            arrival_time=now() if arrival_time is None else arrival_time,
            priority=priority,
        )

    def encoder_input(self, clip: AudioClip) -> EncoderInput:
        """The encoder input of one window: its samples (not copied) and content hash; equal
        samples share one encoder run. With `audio_hash_in_core`, a clip nobody hashed yet goes
        without its hash (the core computes it)."""
        content_hash = clip.known_hash if self.audio_hash_in_core else clip.content_hash
        return EncoderInput(
            num_encoder_tokens=self.num_encoder_tokens,
            content_hash=content_hash or "",
            audio=clip.samples,
        )

    def build_child(
        self,
        first: EngineCoreRequest,
        prompt: Any,
        request_id: str,
        params: SamplingParams,
        *,
        priority: int = 0,
    ) -> EngineCoreRequest:
        """The audio is decoded and hashed once: children differ in id and seed only."""
        return self.with_params(first, request_id, params)

    def decoder_prompt_len(self, prompt: Any, truncate_prompt_tokens: int | None = None) -> int:
        """The decoder prompt's tokens with <|notimestamps|> (one more than with timestamps)."""
        _check_prompt(prompt)
        return len(self._decoder_prompt(prompt, timestamps=False))

    def with_params(
        self, request: EngineCoreRequest, request_id: str, params: SamplingParams
    ) -> EngineCoreRequest:
        """`request` (built by `build`) under another id and sampling params: n > 1 children
        share the first child's audio, decoder prompt and content hash."""
        return msgspec.structs.replace(
            request,
            request_id=request_id,
            sampling_params=self.sampling_params(params, len(request.prompt_token_ids)),
        )

    def sampling_params(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """Whisper's generation-config defaults for the fields left unset (None): suppress and
        begin-suppress tokens; max_tokens=None fills the decoder length."""
        changes: dict[str, Any] = {}
        if params.suppress_tokens is None and self.suppress_tokens:
            changes["suppress_tokens"] = list(self.suppress_tokens)
        if params.begin_suppress_tokens is None and self.begin_suppress_tokens:
            changes["begin_suppress_tokens"] = list(self.begin_suppress_tokens)
        if params.max_tokens is None:
            changes["max_tokens"] = self.max_model_len - num_prompt_tokens
        return params.clone(**changes) if changes else params

    def decoder_prompt(
        self,
        *,
        language: str | None = None,
        task: str = "transcribe",
        timestamps: bool = False,
        previous_text_ids: list[int] | None = None,
    ) -> list[int]:
        """`<|startofprev|> previous` `<|startoftranscript|><|lang|><|task|>[<|notimestamps|>]`
        (English-only models: no language or task token)."""
        tokens = self.tokens
        ids: list[int] = []
        if previous_text_ids:
            ids = [tokens.prev, *previous_text_ids[-self.max_prompt_text_tokens :]]
        ids.append(tokens.sot)
        code = self.check_language(language)
        self.check_task(task)
        if tokens.multilingual:
            ids += [tokens.language_ids[code or "en"], tokens.task_ids[task]]
        if not timestamps:
            ids.append(tokens.no_timestamps)
        return ids

    def check_language(self, language: str | None) -> str | None:
        """ISO code of `language` (an ISO code, `<|code|>` or a name such as "english"; any
        case); None stays None. English-only models accept English only."""
        if language is None:
            return None
        if not isinstance(language, str):
            raise WhisperInputError(f"language must be a string, got {type(language).__name__}")
        code = normalize_language(language)
        if not self.tokens.multilingual:
            if code != "en":
                raise WhisperInputError(
                    f"{self.model_config.model} is an English-only Whisper model; it cannot "
                    f"transcribe language {language!r} (use a multilingual checkpoint)"
                )
            return code
        if code is None or code not in self.tokens.language_ids:
            raise WhisperInputError(
                f"unsupported language {language!r}: pass an ISO 639-1 code such as 'en', 'fr' "
                f"or 'de', or a name such as 'english' ({len(self.tokens.language_ids)} "
                "languages are supported by this model)"
            )
        return code

    def check_task(self, task: str) -> str:
        if task not in TASKS:
            raise WhisperInputError(f"task must be 'transcribe' or 'translate', got {task!r}")
        if task == "translate" and not self.tokens.multilingual:
            raise WhisperInputError(
                f"{self.model_config.model} is an English-only Whisper model: it cannot "
                "translate (use a multilingual checkpoint)"
            )
        return task

    def text_prompt_ids(self, text: str) -> list[int]:
        """Previous-text token ids of a prompt string (" " + stripped text, as openai-whisper)."""
        text = text.strip()
        if not text:
            return []
        ids = self.tokenizer(" " + text, add_special_tokens=False)["input_ids"]
        return [t for t in ids if t < self.tokens.eos]

    # ---- pieces ----
    def _audio(self, multi_modal_data: Any) -> AudioClip:
        if not isinstance(multi_modal_data, Mapping) or "audio" not in multi_modal_data:
            raise WhisperInputError(
                "a Whisper request needs audio: {'multi_modal_data': {'audio': (samples, "
                "sample_rate)}}"
            )
        extra = set(multi_modal_data) - {"audio"}
        if extra:
            raise WhisperInputError(
                f"Whisper takes only audio, got multi_modal_data {sorted(extra)}"
            )
        audio = multi_modal_data["audio"]
        if isinstance(audio, AudioClip):
            load_audio((audio.samples, SAMPLE_RATE))  # the value checks only: no copy at 16 kHz
            clip = audio
        else:
            clip = AudioClip(load_audio(audio))
        if clip.duration_seconds > WINDOW_SECONDS:
            raise AudioError(
                f"audio of {clip.duration_seconds:.1f} s is longer than one {WINDOW_SECONDS:g} s "
                "Whisper window; use transcribe() for long-form audio"
            )
        return clip

    def _decoder_prompt(self, prompt: Mapping[str, Any], timestamps: bool) -> list[int]:
        explicit = prompt.get("prompt_token_ids")
        text = prompt.get("prompt", "")
        if explicit is not None:
            if "prompt" in prompt:
                raise WhisperInputError("pass either 'prompt' or 'prompt_token_ids', not both")
            return self._check_ids(explicit)
        if not isinstance(text, str):
            raise WhisperInputError(f"the Whisper prompt text must be a string, got {text!r}")
        if text.startswith(_VERBATIM_PREFIXES):
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            return self._check_ids(ids)
        return self.decoder_prompt(
            language=prompt.get("language"),
            task=prompt.get("task", "transcribe"),
            timestamps=timestamps,
            previous_text_ids=self.text_prompt_ids(text),
        )

    def _check_ids(self, ids: Any) -> list[int]:
        vocab = self.model_config.vocab_size
        if not isinstance(ids, (list, tuple)) or not ids:
            raise WhisperInputError("prompt_token_ids must be a non-empty list of token ids")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise WhisperInputError(f"decoder prompt token {t!r} is not an id in [0, {vocab})")
        return list(ids)


def normalize_language(language: str) -> str | None:
    """ISO code of an ISO code, `<|code|>` or an English language name; None if unknown."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES, TO_LANGUAGE_CODE

    key = language.strip().lower().removeprefix("<|").removesuffix("|>")
    if key in LANGUAGES:
        return key
    return TO_LANGUAGE_CODE.get(key)


def _check_prompt(prompt: Any) -> None:
    if not isinstance(prompt, Mapping):
        raise WhisperInputError(
            "a Whisper prompt is a dict {'prompt': text, 'multi_modal_data': {'audio': "
            f"(samples, sample_rate)}}}}, got {type(prompt).__name__}"
        )
    unknown = set(prompt) - _PROMPT_KEYS
    if unknown:
        raise WhisperInputError(
            f"unexpected Whisper prompt keys {sorted(unknown)}; allowed: {sorted(_PROMPT_KEYS)}"
        )
