"""ModelInfo: torch-free facts about the served model, derived once per process from its
ModelConfig (`ModelConfig.info`) and its family's `ModelSpec` row: tasks, generation defaults,
Whisper's special tokens, pooling. Folder files are read on first use, once. This module does
not import v1.config (the config imports it): it reads a config through `ServedModelConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

from v1 import pooling_config
from v1.models.registry import WHISPER_TASKS, ModelKind, ModelSpec
from v1.pooling_config import ModelPoolingConfig

if TYPE_CHECKING:
    from v1.pooling_params import PoolingParams
    from v1.sampling_params import SamplingParams

GENERATE = "generate"
TRANSCRIPTION = "transcription"
EMBED = "embed"
CLASSIFY = "classify"
SCORE = "score"
NUM_TIMESTAMP_TOKENS = 1501
"""<|0.00|> ... <|30.00|>: the last ids of every Whisper vocabulary, after <|notimestamps|>."""


class ServedModelConfig(Protocol):
    """The fields of `v1.config.ModelConfig` this module reads."""

    model: str
    revision: str | None
    hf_config: Any
    architecture: str
    spec: ModelSpec
    vocab_size: int
    encoder_vocab_size: int
    max_encoder_len: int


def id_list(value: Any) -> list[int]:
    """Token ids of a config field that holds one id, a list of ids or None."""
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(t) for t in value]


def first_id(value: Any) -> int | None:
    """The first id of a config field that holds one id, a list of ids or None."""
    ids = id_list(value)
    return ids[0] if ids else None


def in_vocab(ids: Any, vocab_size: int) -> tuple[int, ...] | None:
    """The ids inside [0, vocab_size), or None when none is."""
    return tuple(t for t in id_list(ids) if 0 <= t < vocab_size) or None


def load_generation_config(model_config: ServedModelConfig) -> Any:
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


@dataclass(frozen=True)
class WhisperTokens:
    """The special token ids of a Whisper vocabulary: the decoder prompt is built from them and
    the sampler's timestamp rules read them."""

    sot: int
    """<|startoftranscript|> (the decoder start token)."""
    eos: int
    """<|endoftext|>; the text tokens are the ids below it."""
    prev: int
    """<|startofprev|>."""
    no_timestamps: int
    """<|notimestamps|>; never generated while timestamps are on."""
    no_speech: int
    """<|nospeech|> (<|nocaptions|> in older vocabularies)."""
    timestamp_begin: int
    """<|0.00|>; every id from here up is a timestamp."""
    task_ids: dict[str, int]
    """Empty for English-only models."""
    language_ids: dict[str, int]
    """ISO code -> <|code|> id; empty for English-only models."""
    max_initial_timestamp_index: int | None = None
    """The first timestamp is at most timestamp_begin + this (None: no limit)."""

    @property
    def multilingual(self) -> bool:
        return bool(self.language_ids)

    @property
    def language_of_id(self) -> dict[int, str]:
        return {token_id: code for code, token_id in self.language_ids.items()}


def whisper_tokens(model_config: ServedModelConfig, generation_config: Any) -> WhisperTokens:
    """Special ids from the generation config (what transformers' generate uses); ids a config
    omits come from the vocabulary's layout, which every Whisper vocabulary shares at its end:
    ... <|translate|> <|transcribe|> <|startoflm|> <|startofprev|> <|nospeech|> <|notimestamps|>
    and the 1501 timestamps."""
    gc, hf = generation_config, model_config.hf_config
    vocab_size = model_config.vocab_size
    eos = first_id(gc.eos_token_id)
    eos = eos if eos is not None else first_id(hf.eos_token_id)
    sot = first_id(gc.decoder_start_token_id)
    sot = sot if sot is not None else first_id(hf.decoder_start_token_id)
    no_timestamps = getattr(gc, "no_timestamps_token_id", None)
    if no_timestamps is None:
        no_timestamps = vocab_size - NUM_TIMESTAMP_TOKENS - 1
    no_timestamps = int(no_timestamps)
    if eos is None or sot is None or not 0 <= eos < no_timestamps < vocab_size:
        raise ValueError(
            f"{model_config.model}: cannot find Whisper's special tokens (eos {eos}, "
            f"<|startoftranscript|> {sot}, <|notimestamps|> {no_timestamps}, vocabulary "
            f"{vocab_size}): is the generation config complete?"
        )
    prev = getattr(gc, "prev_sot_token_id", None)
    prev = int(prev) if prev is not None else no_timestamps - 2
    multilingual = getattr(gc, "is_multilingual", None)
    lang_to_id = getattr(gc, "lang_to_id", None) or {}
    if multilingual is None:
        multilingual = bool(lang_to_id)
    languages: dict[str, int] = {}
    tasks: dict[str, int] = {}
    if multilingual:
        if not lang_to_id:
            raise ValueError(
                f"{model_config.model}: the generation config of a multilingual Whisper model "
                "has no lang_to_id"
            )
        languages = {token.strip("<|>"): int(i) for token, i in lang_to_id.items()}
        task_to_id = getattr(gc, "task_to_id", None) or {}
        layout = {"translate": no_timestamps - 5, "transcribe": no_timestamps - 4}
        tasks = {task: int(task_to_id.get(task, layout[task])) for task in WHISPER_TASKS}
    return WhisperTokens(
        sot=sot,
        eos=eos,
        prev=prev,
        no_timestamps=no_timestamps,
        no_speech=no_timestamps - 1,
        timestamp_begin=no_timestamps + 1,
        task_ids=tasks,
        language_ids=languages,
        max_initial_timestamp_index=getattr(gc, "max_initial_timestamp_index", None),
    )


class ModelInfo:
    """The facts about one model that more than one part of the engine needs.

    Cheap facts (from the model config) are set at construction; generation and pooling facts
    read folder files on first use and are kept. Build it once per process through
    `ModelConfig.info`; `supported_tasks` is what entry points ask ("transcription" in it, not
    the model kind).
    """

    def __init__(self, model_config: ServedModelConfig) -> None:
        self.model_config = model_config
        self.architecture: str = model_config.architecture
        self.spec: ModelSpec = model_config.spec
        self.kind: ModelKind = self.spec.kind
        """How requests run (decoder-only, encoder-decoder, encoder-only): input builders and
        model states are chosen by it, once."""
        self.is_whisper: bool = bool(self.spec.speech_tasks)
        """Speech input (audio encoder, Whisper's prompt and timestamp tokens)."""
        self.has_classifier: bool = self.kind == ModelKind.ENCODER_ONLY and (
            self.spec.has_classifier(self.architecture)
        )
        """A sequence-classification head (classify; score as a cross-encoder)."""
        self.generates: bool = self.kind != ModelKind.ENCODER_ONLY
        """Requests generate tokens (SamplingParams); False: one pooled output (PoolingParams)."""
        self.has_cross_attention: bool = self.kind == ModelKind.ENCODER_DECODER
        """The decoder attends over an encoder input (cross-attention blocks per request)."""
        self.prompt_vocab_size: int = (
            model_config.vocab_size if self.generates else model_config.encoder_vocab_size
        )
        """The vocabulary of a request's prompt_token_ids (the decoder's; an encoder-only
        model's input ids index its encoder vocabulary)."""
        self.supported_tasks: frozenset[str] = self._supported_tasks()
        """What the entry points may run: generate; transcription (speech models); embed and
        score (pooling models; score by cosine without a classifier); classify."""
        self.description: str = (
            "a Whisper speech model" if self.is_whisper else f"a {self.kind.value} model"
        )
        """The model kind in words, for error messages."""

    def _supported_tasks(self) -> frozenset[str]:
        if not self.generates:
            return frozenset({EMBED, SCORE, *((CLASSIFY,) if self.has_classifier else ())})
        if self.is_whisper:
            return frozenset({TRANSCRIPTION, GENERATE})
        return frozenset({GENERATE})

    # ---- generation ----
    @cached_property
    def generation_config(self) -> Any:
        """The transformers GenerationConfig (`load_generation_config`), read once."""
        return load_generation_config(self.model_config)

    def generation_defaults(self, tokenizer_eos_token_id: int | None) -> GenerationDefaults:
        """The sampling defaults of the generation config. The EOS a tokenizer names wins among
        several EOS ids of the generation config (the others become stop ids), and is the
        fallback when the generation config names none (then the model config's)."""
        mc, gc = self.model_config, self.generation_config
        vocab = mc.vocab_size
        eos_ids = id_list(gc.eos_token_id)
        if not eos_ids:
            eos_ids = id_list(tokenizer_eos_token_id) or id_list(
                getattr(mc.hf_config, "eos_token_id", None)
            )
        eos = tokenizer_eos_token_id if tokenizer_eos_token_id in eos_ids else None
        eos = eos if eos is not None else (eos_ids[0] if eos_ids else None)
        start = None
        if self.has_cross_attention:
            start = first_id(gc.decoder_start_token_id)
            if start is None:
                start = first_id(getattr(mc.hf_config, "decoder_start_token_id", None))
            start = start if start is not None else first_id(gc.bos_token_id)
            if start is None:
                raise ValueError(
                    f"{mc.model} sets no decoder_start_token_id (nor bos_token_id) in its "
                    f"generation config or model config"
                )
        return GenerationDefaults(
            decoder_start_token_id=start,
            eos_token_id=eos,
            extra_eos_token_ids=tuple(t for t in eos_ids if t != eos and 0 <= t < vocab),
            forced_bos_token_id=first_id(gc.forced_bos_token_id),
            forced_eos_token_id=first_id(gc.forced_eos_token_id),
            suppress_tokens=in_vocab(gc.suppress_tokens, vocab),
            begin_suppress_tokens=in_vocab(gc.begin_suppress_tokens, vocab),
            no_repeat_ngram_size=gc.no_repeat_ngram_size or 0,
            min_length=gc.min_length or 0,
            min_new_tokens=gc.min_new_tokens or 0,
        )

    @cached_property
    def whisper_tokens(self) -> WhisperTokens | None:
        """Whisper's special token ids (None for other models)."""
        if not self.is_whisper:
            return None
        return whisper_tokens(self.model_config, self.generation_config)

    @cached_property
    def alignment_heads(self) -> tuple[tuple[int, ...], ...]:
        """The generation config's [decoder layer, head] pairs whose cross-attention follows
        the speech (word timestamps), as listed; empty when it names none."""
        if not self.is_whisper:
            return ()
        heads = getattr(self.generation_config, "alignment_heads", None) or []
        return tuple(tuple(int(x) for x in pair) for pair in heads)

    # ---- pooling ----
    @cached_property
    def pooling(self) -> ModelPoolingConfig | None:
        """How an encoder-only model pools, normalizes and classifies, with its input limit
        (sentence-transformers files and the model config); None for generating models.
        Raises OSError when the folder's files cannot be read."""
        if self.generates:
            return None
        mc = self.model_config
        return pooling_config.load_pooling_config(
            mc.model,
            mc.revision,
            mc.hf_config,
            default_modes=self.spec.pooling_modes,
            max_input_len=mc.max_encoder_len,
            has_classifier=self.has_classifier,
        )

    def check_pooling_params(self, params: PoolingParams) -> None:
        """ValueError when this model cannot serve `params` (the edge and the core boundary
        call it)."""
        pooling = self.pooling
        assert pooling is not None, "pooling params on a generating model"
        pooling_config.validate_pooling_params(pooling, params)
