"""Encoder inputs the core keeps by content hash, so a request may name one instead of sending it
(beam search continues every beam as a new request each step). The first request sends the
input; later ones send only its hash and length, resolved here from the most recent payloads
(least recently used dropped first, within a byte budget).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from v1.audio.clip import audio_content_hash
from v1.core.protocol import EncoderInput

MAX_HELD_BYTES = 1 << 30
"""Payload bytes kept (1 GiB: ~550 Whisper windows of float32 audio)."""


def with_content_hash(enc: EncoderInput) -> EncoderInput:
    """`enc`, hashed: audio sent without its content hash ("", a data-parallel frontend's) gets
    the BLAKE3 digest of its samples, the one `AudioClip` computes, so equal audio still shares
    one encoder run whichever side hashed it. ValueError for any other input without a hash."""
    if enc.content_hash:
        return enc
    if not isinstance(enc.audio, np.ndarray):
        raise ValueError("an encoder input needs a content_hash (only audio may leave it empty)")
    try:
        enc.content_hash = audio_content_hash(np.ascontiguousarray(enc.audio), one_thread=True)
    except (TypeError, BufferError) as e:
        raise ValueError(f"cannot hash the encoder input's audio: {e}") from e
    return enc


def _payload_bytes(enc: EncoderInput) -> int:
    if enc.audio is not None:
        return int(getattr(enc.audio, "nbytes", 0))
    return 8 * len(enc.token_ids or ())


class EncoderInputStore:
    def __init__(self, max_bytes: int = MAX_HELD_BYTES) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._inputs: OrderedDict[str, EncoderInput] = OrderedDict()

    def resolve(self, enc: EncoderInput) -> EncoderInput:
        """`enc` with its payload: a full input is remembered and returned as is; a reference
        (no token_ids, no audio) gets the payload last sent under its hash. Raises ValueError
        for a reference to an input not held (never sent, or dropped since)."""
        if enc.token_ids is not None or enc.audio is not None:
            self._remember(enc)
            return enc
        held = self._inputs.get(enc.content_hash)
        if held is None or held.num_encoder_tokens != enc.num_encoder_tokens:
            raise ValueError(
                f"encoder input {enc.content_hash!r} was sent without its data and the core "
                f"does not hold it (send token_ids or audio again)"
            )
        self._inputs.move_to_end(enc.content_hash)
        return held

    def _remember(self, enc: EncoderInput) -> None:
        old = self._inputs.pop(enc.content_hash, None)
        if old is not None:
            self.num_bytes -= _payload_bytes(old)
        size = _payload_bytes(enc)
        if size > self.max_bytes:
            return
        self._inputs[enc.content_hash] = enc
        self.num_bytes += size
        while self.num_bytes > self.max_bytes:
            _, dropped = self._inputs.popitem(last=False)
            self.num_bytes -= _payload_bytes(dropped)
