"""Loading the tokenizer (transformers) of a model config. Floor 0: it reads three fields of
any config-like object (`TokenizerSource`), so the core and the frontend both may use it."""

from __future__ import annotations

import os
from typing import Any, Protocol

# Files one of which a local folder needs: without any, transformers builds an empty tokenizer
# from the model config instead of failing.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "source.spm",
)


class TokenizerSource(Protocol):
    """What the loader reads of a ModelConfig."""

    @property
    def tokenizer_path(self) -> str: ...

    @property
    def revision(self) -> str | None: ...

    @property
    def trust_remote_code(self) -> bool: ...


def get_tokenizer(model_config: TokenizerSource) -> Any:
    """The transformers tokenizer of `model_config.tokenizer_path`.

    Raises ValueError naming the path when the folder or hub id has no loadable tokenizer.
    """
    from transformers import AutoTokenizer

    path = model_config.tokenizer_path
    if os.path.isdir(path) and not any(
        os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES
    ):
        raise ValueError(
            f"no tokenizer files in {path!r} (pass tokenizer=... to point at a tokenizer folder)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            path,
            revision=model_config.revision,
            trust_remote_code=model_config.trust_remote_code,
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"cannot load a tokenizer from {path!r} (pass tokenizer=... to point at one): {e}"
        ) from e
    return tokenizer
