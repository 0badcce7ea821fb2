"""Words from timed Whisper tokens (openai-whisper's word splitting): tokens join into words at
spaces (at whole characters for languages written without spaces), punctuation joins the word
it belongs to, and a word spans its first token's start to its last token's end.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass

PREPEND_PUNCTUATION = "\"'“¿([{-"
"""Marks that belong to the word after them."""
APPEND_PUNCTUATION = "\"'.。,，!！?？:：”)]}、"
"""Marks that belong to the word before them."""
UNSPACED_LANGUAGES = frozenset({"zh", "ja", "th", "lo", "my", "yue"})
"""Languages written without spaces: a word is every whole character."""
_REPLACEMENT = "\ufffd"


@dataclass
class TranscriptionWord:
    word: str
    """As decoded, with its leading space (openai-whisper)."""
    start: float
    """Seconds from the start of the audio."""
    end: float
    probability: float | None = None
    """Mean probability of the word's tokens as they were decoded (faster-whisper's word
    probability: the mean of its tokens' probabilities); None when not known."""


@dataclass
class _Word:
    text: str
    indices: list[int]
    """Positions of its tokens in the token list."""


def split_words(
    token_ids: Sequence[int], decode: Callable[[list[int]], str], language: str, eos: int
) -> list[tuple[str, list[int]]]:
    """(word, positions of its tokens) of text token ids, punctuation merged."""
    pieces = _split_on_characters(token_ids, decode)
    if language not in UNSPACED_LANGUAGES:
        pieces = _join_at_spaces(pieces, token_ids, eos)
    return [(w.text, w.indices) for w in _merge_punctuation(pieces)]


def timed_words(
    token_ids: Sequence[int],
    boundaries: Sequence[float],
    offset: float,
    decode: Callable[[list[int]], str],
    language: str,
    eos: int,
    probs: Sequence[float] | None = None,
) -> list[TranscriptionWord]:
    """Words of `token_ids` whose token k spans [boundaries[k], boundaries[k + 1]] seconds
    after `offset`; `probs` (one per token) give each word the mean of its tokens'."""
    if len(boundaries) != len(token_ids) + 1:
        raise ValueError(f"{len(token_ids)} tokens need {len(token_ids) + 1} boundary times")
    if probs is not None and len(probs) != len(token_ids):
        probs = None

    def probability(indices: list[int]) -> float | None:
        if probs is None:
            return None
        values = [probs[i] for i in indices]
        mean = sum(values) / len(values)
        return None if mean != mean else round(mean, 4)  # NaN: not known

    return [
        TranscriptionWord(
            text,
            round(offset + boundaries[indices[0]], 3),
            round(offset + boundaries[indices[-1] + 1], 3),
            probability(indices),
        )
        for text, indices in split_words(token_ids, decode, language, eos)
    ]


def span_words(
    spans: Sequence[Sequence[int]],
    token_times: Sequence[float],
    text_probs: Sequence[float] | None,
    offset: float,
    decode: Callable[[list[int]], str],
    language: str,
    eos: int,
) -> list[list[TranscriptionWord]]:
    """The timed words of each span of a window's text tokens (consecutive runs of the tokens
    `token_times` times), empty where the times do not cover a span."""
    seg_words: list[list[TranscriptionWord]] = []
    cursor = 0
    for text_ids in spans:
        n = len(text_ids)
        if n and cursor + n < len(token_times):
            seg_words.append(
                timed_words(
                    text_ids,
                    token_times[cursor : cursor + n + 1],
                    offset,
                    decode,
                    language,
                    eos,
                    text_probs[cursor : cursor + n] if text_probs else None,
                )
            )
        else:
            seg_words.append([])
        cursor += n
    return seg_words


class WordClock:
    """Words of one file's segments on the file's clock: each window's token times (from its
    start) are taken by its segments' text tokens in order; words are kept in time order and
    inside the audio."""

    def __init__(
        self, decode: Callable[[list[int]], str], eos: int, language: str, duration: float
    ) -> None:
        self.decode = decode
        self.eos = eos
        self.language = language
        self.duration = duration
        self.last_end = 0.0
        self.times: list[float] = []
        self.probs: list[float] | None = None
        self.offset = 0.0
        self.cursor = 0

    def start_window(
        self, token_times: list[float], offset: float, probs: list[float] | None = None
    ) -> None:
        """The next window: its text tokens' boundary times (and probabilities), and its
        start in seconds."""
        self.times = token_times
        self.probs = probs
        self.offset = offset
        self.cursor = 0

    def segment_words(self, text_ids: list[int]) -> list[TranscriptionWord]:
        """Words of the window's next segment (its text token ids)."""
        first, self.cursor = self.cursor, self.cursor + len(text_ids)
        if not text_ids:
            return []
        if self.cursor >= len(self.times):
            raise ValueError(f"{len(self.times)} token times for at least {self.cursor} tokens")
        words = timed_words(
            text_ids,
            self.times[first : self.cursor + 1],
            self.offset,
            self.decode,
            self.language,
            self.eos,
            self.probs[first : self.cursor] if self.probs is not None else None,
        )
        for word in words:
            word.start = min(max(word.start, self.last_end), self.duration)
            word.end = min(max(word.end, word.start), self.duration)
            self.last_end = word.end
        return words


def _split_on_characters(
    token_ids: Sequence[int], decode: Callable[[list[int]], str]
) -> list[_Word]:
    """Runs of tokens that decode to whole characters (a multi-byte character may span
    several tokens; until it is complete the decoding ends in U+FFFD)."""
    full = decode(list(token_ids))
    pieces: list[_Word] = []
    current: list[int] = []
    offset = 0
    for index in range(len(token_ids)):
        current.append(index)
        text = decode([token_ids[i] for i in current])
        cut = text.find(_REPLACEMENT)
        # A U+FFFD that the full text also has at that place is a real character.
        if cut < 0 or offset + cut >= len(full) or full[offset + cut] == _REPLACEMENT:
            pieces.append(_Word(text, current))
            current = []
            offset += len(text)
    if current:
        pieces.append(_Word(decode([token_ids[i] for i in current]), current))
    return pieces


def _join_at_spaces(pieces: list[_Word], token_ids: Sequence[int], eos: int) -> list[_Word]:
    """A new word starts at a space, a punctuation mark or a special token."""
    words: list[_Word] = []
    for piece in pieces:
        starts_word = (
            not words
            or token_ids[piece.indices[0]] >= eos
            or piece.text.startswith(" ")
            or piece.text.strip() in string.punctuation
        )
        if starts_word:
            words.append(_Word(piece.text, list(piece.indices)))
        else:
            words[-1].text += piece.text
            words[-1].indices += piece.indices
    return words


def _merge_punctuation(words: list[_Word]) -> list[_Word]:
    """Opening marks join the word after them, closing marks the word before them."""
    merged: list[_Word] = []
    carry: _Word | None = None
    for word in words:
        if word.text.startswith(" ") and word.text.strip() in PREPEND_PUNCTUATION:
            carry = (
                word
                if carry is None
                else _Word(carry.text + word.text, carry.indices + word.indices)
            )
            continue
        if carry is not None:
            word = _Word(carry.text + word.text, carry.indices + word.indices)
            carry = None
        if merged and not merged[-1].text.endswith(" ") and word.text in APPEND_PUNCTUATION:
            merged[-1] = _Word(merged[-1].text + word.text, merged[-1].indices + word.indices)
            continue
        merged.append(word)
    if carry is not None:
        merged.append(carry)
    return merged
