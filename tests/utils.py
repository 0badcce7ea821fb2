"""Shared test factories: a tiny trained tokenizer and tiny random transformers models on disk.

Used by the engine, entrypoint, encoder-decoder and pooling tests. Everything is built offline in
a temporary folder within a second or two; `ASSETS` points at the real checkpoints, if present.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

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
        import pytest

        if IN_CI:
            pytest.fail(asset_missing_message(path), pytrace=False)
        pytest.skip(asset_missing_message(path))
    return path


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
