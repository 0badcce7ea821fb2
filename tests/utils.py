"""Shared test factories: a tiny trained tokenizer and tiny random models on disk (Llama, BART
family, T5 family, Whisper), each a config dict plus a `make_tiny_*_dir` builder taking overrides.

Everything is built offline in a temporary folder within a second or two; `ASSETS` points at the
real checkpoints, if present (the tiny Whisper borrows whisper-base's tokenizer).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

ASSETS = Path(__file__).resolve().parents[2] / "shared" / "assets"
"""Real checkpoints and audio (see ../shared/assets/README.md): tests that need them skip when
they are absent locally, and fail under CI (see `require_asset`)."""
IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def asset_missing_message(path: Path) -> str:
    return f"shared test asset {path} is absent (see ../shared/assets/README.md)"


def require_asset(path: Path) -> Path:
    """`path`, or a skip when it is absent; under CI (CI=true) a failure instead, so a
    checkout without the assets cannot pass while silently skipping the real-weight tests."""
    if not path.exists():
        if IN_CI:
            pytest.fail(asset_missing_message(path), pytrace=False)
        pytest.skip(asset_missing_message(path))
    return path


ONE_TORCH_THREAD = pytest.mark.usefixtures("one_torch_thread")
"""A module's `pytestmark`: its tests run with torch on one thread (tests/conftest.py)."""


def needs_assets(*paths: Path) -> Any:
    """A mark skipping the test when an asset is absent, except under CI, where the test runs
    and fails on the missing file."""
    import pytest

    missing = [p for p in paths if not p.exists()]
    return pytest.mark.skipif(
        bool(missing) and not IN_CI,
        reason=asset_missing_message(missing[0]) if missing else "",
    )


_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A journey of a thousand miles begins with a single step.",
    "To be or not to be, that is the question.",
    "All that glitters is not gold; all who wander are not lost.",
    "Hello world! Engines serve models: encoder, decoder and both.",
    "Numbers 0123456789 and symbols #$%&*()[]{}<>+-=/\\|~^_@ too.",
    "Straße, café, naïve, 東京, Привет, مرحبا, 😀 — unicode text.",
]

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")


def make_tiny_tokenizer(
    path: str | os.PathLike[str],
    *,
    vocab_size: int = 384,
    add_bos: bool = True,
    add_eos: bool = False,
) -> Any:
    """Trains a byte-level BPE tokenizer (GPT-2 style) on a small corpus and saves it as a
    transformers PreTrainedTokenizerFast in `path`: ids 0-3 are <pad> <s> </s> <unk>; `add_bos`
    starts every encoded text with <s> (Llama style), `add_eos` ends it with </s> (BART style)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    bos, eos = ("<s> " if add_bos else ""), (" </s>" if add_eos else "")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos}$A{eos}",
        pair=f"{bos}$A{eos} {bos}$B{eos}",
        special_tokens=[("<s>", 1), ("</s>", 2)],
    )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    wrapped.save_pretrained(str(path))
    return wrapped


_WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "hello",
    "world",
    "a",
    "an",
    "is",
    "not",
    "gold",
    "all",
    "that",
    "glitters",
    "who",
    "wander",
    "are",
    "lost",
    "engine",
    "model",
    "serve",
    "text",
    "query",
    "document",
    "relevant",
]


def make_tiny_wordpiece_tokenizer(path: str | os.PathLike[str]) -> Any:
    """A BERT-style WordPiece tokenizer (lower case, [CLS] a [SEP] b [SEP], token_type_ids)
    over a small vocabulary, saved as a transformers BertTokenizer in `path`."""
    from transformers import BertTokenizer

    path = Path(path)
    chars = "abcdefghijklmnopqrstuvwxyz0123456789.,!?;:'-"
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *(f"##{c}" for c in chars)]
    vocab = list(dict.fromkeys([*vocab, *_WORDS, "##ing", "##ed", "##s"]))
    tokenizer = BertTokenizer(vocab={token: i for i, token in enumerate(vocab)})
    tokenizer.save_pretrained(str(path))
    return tokenizer


def make_tiny_model_dir(
    config_cls: type,
    model_cls: type,
    path: str | os.PathLike[str],
    *,
    tokenizer_from: str | os.PathLike[str] | None = None,
    seed: int = 0,
    **config_kwargs: Any,
) -> str:
    """Saves a randomly initialised `model_cls(config_cls(**config_kwargs))` (float32) and a
    tokenizer into `path`, returning it as a string.

    `tokenizer_from`: a folder whose tokenizer files are copied (e.g. `ASSETS / "whisper-base"`);
    default: a fresh `make_tiny_tokenizer`. `vocab_size` defaults to the tokenizer's size and is
    raised to it if given smaller.
    """
    import torch
    from transformers import AutoTokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is None:
        tokenizer = make_tiny_tokenizer(path)
    else:
        source = Path(tokenizer_from)
        for item in source.iterdir() if source.resolve() != path.resolve() else []:
            if (
                item.is_file()
                and not item.name.endswith((".safetensors", ".bin"))
                and ("token" in item.name or item.name in ("vocab.json", "vocab.txt", "merges.txt"))
            ):
                shutil.copy(item, path / item.name)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    config_kwargs["vocab_size"] = max(config_kwargs.get("vocab_size", 0), len(tokenizer))
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        token_id = getattr(tokenizer, name, None)
        if token_id is not None:
            config_kwargs.setdefault(name, token_id)
    config = config_cls(**config_kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    model.save_pretrained(str(path))
    return str(path)


TINY_LLAMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
"""A LlamaConfig for a GQA model that runs in milliseconds on CPU."""


def make_tiny_llama_dir(path: str | os.PathLike[str], **overrides: Any) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    return make_tiny_model_dir(LlamaConfig, LlamaForCausalLM, path, **{**TINY_LLAMA, **overrides})


TINY_BART = dict(
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_position_embeddings=64,
)
"""A BART-family config (BART, mBART, Marian) that runs in milliseconds on CPU."""

TINY_BART_WIDE = dict(
    TINY_BART,
    d_model=64,
    encoder_ffn_dim=128,
    decoder_ffn_dim=128,
    max_position_embeddings=128,
    forced_eos_token_id=None,
    no_repeat_ngram_size=0,
)
"""The worker and GPU tests' BART: wider, plain greedy in transformers (no forced EOS, no
n-gram blocking)."""


def make_tiny_bart_dir(
    path: str | os.PathLike[str],
    *,
    family: str = "bart",
    bart_tokenizer: bool = True,
    add_bos: bool = True,
    base: dict[str, Any] = TINY_BART,
    seed: int = 0,
    **overrides: Any,
) -> str:
    """A random `family` ("bart", "mbart" or "marian") model of `base` + `overrides` in
    `path`. `bart_tokenizer`: the tiny tokenizer writes `<s> text </s>` (as BART; `text </s>`
    without `add_bos`, as Marian); False: the default tiny tokenizer (`<s> text`)."""
    from transformers import (
        BartConfig,
        BartForConditionalGeneration,
        MarianConfig,
        MarianMTModel,
        MBartConfig,
        MBartForConditionalGeneration,
    )

    classes = {
        "bart": (BartConfig, BartForConditionalGeneration),
        "mbart": (MBartConfig, MBartForConditionalGeneration),
        "marian": (MarianConfig, MarianMTModel),
    }[family]
    tokenizer_from = None
    if bart_tokenizer:
        Path(path).mkdir(parents=True, exist_ok=True)
        make_tiny_tokenizer(path, add_bos=add_bos, add_eos=True)
        tokenizer_from = path
    return make_tiny_model_dir(
        *classes, path, tokenizer_from=tokenizer_from, seed=seed, **{**base, **overrides}
    )


TINY_T5 = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)
"""A T5-family config (T5, mT5) that runs in milliseconds on CPU."""


def make_tiny_t5_dir(
    path: str | os.PathLike[str],
    *,
    family: str = "t5",
    add_bos: bool = False,
    seed: int = 0,
    **overrides: Any,
) -> str:
    """A random `family` ("t5" or "mt5") model of TINY_T5 + `overrides` in `path`, with the tiny
    tokenizer ending every text with </s> (and starting it with <s> if `add_bos`)."""
    from transformers import (
        MT5Config,
        MT5ForConditionalGeneration,
        T5Config,
        T5ForConditionalGeneration,
    )

    classes = {
        "t5": (T5Config, T5ForConditionalGeneration),
        "mt5": (MT5Config, MT5ForConditionalGeneration),
    }[family]
    Path(path).mkdir(parents=True, exist_ok=True)
    make_tiny_tokenizer(path, add_bos=add_bos, add_eos=True)
    return make_tiny_model_dir(
        *classes, path, tokenizer_from=path, seed=seed, **{**TINY_T5, **overrides}
    )


WHISPER_BASE = ASSETS / "whisper-base"
WHISPER_WINDOW = 1500
"""Encoder positions of one Whisper window."""
TINY_WHISPER = dict(
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_source_positions=WHISPER_WINDOW,
    max_target_positions=448,
)
"""A Whisper config of full-size windows that runs in milliseconds on CPU."""
WHISPER_VOCAB_SIZES = {"multilingual": 51865, "english_only": 51864, "large_v3": 51866}


def _shifted(gen: dict[str, Any], first: int, delta: int) -> dict[str, Any]:
    """The generation config with every special id >= `first` moved by `delta`."""

    def move(t: int) -> int:
        return t + delta if t >= first else t

    out = dict(gen)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        out[key] = move(gen[key])
    for key in ("no_timestamps_token_id", "prev_sot_token_id"):
        out[key] = move(gen[key])
    for key in ("suppress_tokens", "begin_suppress_tokens"):
        out[key] = [move(t) for t in gen[key]]
    for key in ("lang_to_id", "task_to_id"):
        out[key] = {k: move(v) for k, v in gen[key].items()}
    out["forced_decoder_ids"] = None
    return out


def whisper_generation_config(layout: str) -> dict[str, Any]:
    """whisper-base's generation config, or the `.en` layout (every special id one lower, no
    language or task tokens), or large-v3's (a 100th language, <|yue|>, before the tasks)."""
    import json

    gen = json.loads((WHISPER_BASE / "generation_config.json").read_text())
    if layout == "english_only":
        gen = _shifted(gen, 50257, -1)
        for key in ("lang_to_id", "task_to_id"):
            del gen[key]
        gen["is_multilingual"] = False
    elif layout == "large_v3":
        gen = _shifted(gen, 50358, 1)
        gen["lang_to_id"]["<|yue|>"] = 50358
    return gen


def make_tiny_whisper_dir(path: Path, *, layout: str = "multilingual", seed: int = 0) -> str:
    """A random 2+2-layer, 32-wide Whisper with a real vocabulary layout (multilingual,
    english_only or large_v3 with 128 mel bins), whisper-base's tokenizer and a matching
    feature extractor and generation config (needs the whisper-base asset)."""
    import torch
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
    )

    from tests.models.hf_reference import randomize_

    path.mkdir(parents=True, exist_ok=True)
    for item in WHISPER_BASE.iterdir():
        if item.suffix != ".safetensors" and not item.name.endswith("config.json"):
            shutil.copy(item, path / item.name)
    num_mel_bins = 128 if layout == "large_v3" else 80
    WhisperFeatureExtractor(feature_size=num_mel_bins).save_pretrained(str(path))
    gen = whisper_generation_config(layout)
    cfg = WhisperConfig(
        vocab_size=WHISPER_VOCAB_SIZES[layout],
        num_mel_bins=num_mel_bins,
        decoder_start_token_id=gen["decoder_start_token_id"],
        eos_token_id=gen["eos_token_id"],
        bos_token_id=gen["bos_token_id"],
        pad_token_id=gen["pad_token_id"],
        **TINY_WHISPER,
    )
    torch.manual_seed(seed)
    # std 0.5: outputs depend on the audio (smaller weights give one repeated token).
    model = randomize_(WhisperForConditionalGeneration(cfg), seed, std=0.5).eval()
    model.generation_config = GenerationConfig(**gen)
    model.save_pretrained(str(path))
    return str(path)


def count_clip_hashes(monkeypatch: Any) -> list[Any]:
    """Routes AudioClip's hash calls (BLAKE3) through a recorder (via pytest's `monkeypatch`):
    the returned list gets the argument of each call, so a test sees how often audio was hashed
    and whether the hash read the array itself (a memoryview of it) or a copy."""
    from blake3 import blake3

    import v1.audio.clip as clip_module

    calls: list[Any] = []

    def recorded(data: Any, **kwargs: Any) -> Any:
        calls.append(data)
        return blake3(data, **kwargs)

    monkeypatch.setattr(clip_module, "blake3", recorded)
    return calls


def forbid_resampling(monkeypatch: Any) -> None:
    """Makes v1.audio's resampler and block collector raise if anything uses them."""
    import v1.audio.decode as decode

    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("16 kHz audio went through the resampling collector")

    monkeypatch.setattr(decode, "_MonoCollector", fail)
    import soxr

    monkeypatch.setattr(soxr, "ResampleStream", fail)


def with_auto_bursts(config: Any, steps: int = 8) -> Any:
    """`config` as a GPU engine resolves an auto num_scheduler_steps (bursts of `steps` that
    skip streamed requests: EngineConfig.auto_num_scheduler_steps), forced on any device."""
    import dataclasses

    return dataclasses.replace(
        config,
        scheduler_config=dataclasses.replace(config.scheduler_config, num_scheduler_steps=steps),
        auto_num_scheduler_steps=True,
    )
