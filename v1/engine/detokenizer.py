"""Incremental detokenization of one request's output tokens, and stop strings.

The fast path steps a `tokenizers.decoders.DecodeStream` (primed with the end of the prompt so
leading spaces come out as in a full decode); the fallback keeps vLLM's prefix/read offsets over
token strings. Stop strings are searched only in the tail the new text can complete.
"""

from __future__ import annotations

from typing import Any

from v1.sampling_params import SamplingParams

# Prompt tokens used as left context: enough for decoders whose output depends on neighbours.
_PRIME_MIN_TOKENS = 4
_PRIME_MAX_TOKENS = 24
_SLOW_PREFIX_OFFSET = 5
_REPLACEMENT_CHAR = "\ufffd"
_INVALID_PREFIX_ERR = "Invalid prefix encountered"


class IncrementalDetokenizer:
    """Accumulates output token ids and (unless detokenize=False) their text.

    Subclasses implement `_decode_next(token_id) -> str`: the text that token adds, "" while it
    ends an incomplete character. This base class itself keeps no text (detokenize=False).
    """

    decodes_text = False
    """Whether `_decode_next` yields text; without text no stop string can match."""

    def __init__(self, params: SamplingParams | None) -> None:
        self.token_ids: list[int] = []
        self.output_text = ""
        params = params or SamplingParams()
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        # Text a stop string may still retract is held back from streamed outputs.
        self.stop_buffer_length = (
            max(len(s) for s in self.stop) - 1
            if self.stop and not self.include_stop_str_in_output
            else 0
        )
        self._last_output_text_offset = 0

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Adds tokens; returns the stop string that ends the request, or None.

        `stop_terminated`: the core ended the request on the last token (EOS or a stop token id);
        that token stays in `token_ids` but its text is left out unless
        include_stop_str_in_output, as in vLLM.
        """
        if not new_token_ids:
            return None
        if len(new_token_ids) > 1 and self.stop and self.decodes_text:
            # One at a time (a decode burst brings several): a stop string ends the request at
            # the token that completes it, and later tokens are dropped, as one per step.
            last = len(new_token_ids) - 1
            for i, token in enumerate(new_token_ids):
                stop_str = self.update([token], stop_terminated and i == last)
                if stop_str is not None:
                    return stop_str
            return None
        self.token_ids.extend(new_token_ids)
        if not self.decodes_text:
            return None
        to_decode = new_token_ids
        if stop_terminated and not self.include_stop_str_in_output:
            to_decode = new_token_ids[:-1]
        old_len = len(self.output_text)
        self.output_text += "".join(self._decode_next(t) for t in to_decode)
        if not self.stop or len(self.token_ids) <= self.min_tokens:
            return None
        return self._check_stop_strings(len(self.output_text) - old_len)

    def _check_stop_strings(self, num_new_chars: int) -> str | None:
        """Finds the earliest stop string that ends inside the new text and truncates there."""
        if num_new_chars == 0:
            return None
        text = self.output_text
        best: tuple[int, str] | None = None
        for stop_str in self.stop:
            # A match must end inside the new chars: search only the tail that allows it.
            start = max(0, len(text) - num_new_chars - len(stop_str) + 1)
            index = text.find(stop_str, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop_str)
        if best is None:
            return None
        index, stop_str = best
        end = index + len(stop_str) if self.include_stop_str_in_output else index
        self.output_text = text[:end]
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to report now: all of it (delta=False) or what is new since the previous
        call; while running, the last chars that could start a stop string are held back."""
        buffer_length = 0 if finished else self.stop_buffer_length
        length = max(len(self.output_text) - buffer_length, 0)
        if not delta:
            return self.output_text[:length]
        last = self._last_output_text_offset
        if last < length:
            self._last_output_text_offset = length
            return self.output_text[last:length]
        return ""

    def _decode_next(self, token_id: int) -> str:
        return ""


class FastIncrementalDetokenizer(IncrementalDetokenizer):
    """Steps the fast tokenizer's `DecodeStream`."""

    decodes_text = True

    def __init__(
        self,
        tokenizer: Any,
        params: SamplingParams | None,
        prompt_token_ids: list[int],
        *,
        final_only: bool = False,
    ) -> None:
        from tokenizers.decoders import DecodeStream

        super().__init__(params)
        self._backend = tokenizer.backend_tokenizer
        self._new_stream = lambda ids: DecodeStream(
            ids=ids, skip_special_tokens=self.skip_special_tokens
        )
        self._vocab_size = self._backend.get_vocab_size(with_added_tokens=True)
        self._prime = self._prime_ids(tokenizer, prompt_token_ids)
        self._stream = self._new_stream(self._prime)
        # Nobody reads the text before the request ends and no stop string needs it: decode
        # once at the end instead of stepping the stream per token (the per-step host cost of
        # a large batch). `_pending` holds the ids not yet decoded.
        self._deferred = final_only and not self.stop
        self._pending: list[int] = []

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        if not self._deferred:
            return super().update(new_token_ids, stop_terminated)
        self.token_ids.extend(new_token_ids)
        to_decode = new_token_ids
        if stop_terminated and not self.include_stop_str_in_output:
            to_decode = new_token_ids[:-1]
        self._pending.extend(to_decode)
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        if self._pending:
            self._flush_pending()
        return super().get_next_output_text(finished, delta)

    def _flush_pending(self) -> None:
        """The pending ids' text in one decode of prime + output (what the stream would have
        given), or through the stream where one decode cannot tell (an unfinished character
        at the end, or a decoder that rewrites the prime's text)."""
        ids, self._pending = self._pending, []
        if not self.output_text:
            known = [t for t in ids if 0 <= t < self._vocab_size]
            skip = self.skip_special_tokens
            head = self._backend.decode(self._prime, skip_special_tokens=skip)
            full = self._backend.decode(self._prime + known, skip_special_tokens=skip)
            if full.startswith(head) and not full.endswith(_REPLACEMENT_CHAR):
                self.output_text = full[len(head) :]
                return
        self.output_text += "".join(self._decode_next(t) for t in ids)

    def _prime_ids(self, tokenizer: Any, prompt_token_ids: list[int]) -> list[int]:
        """A prompt suffix that decodes to whole characters (as vLLM picks it)."""
        ids = [t for t in prompt_token_ids if 0 <= t < self._vocab_size]
        if len(ids) <= _PRIME_MIN_TOKENS:
            return ids
        for n in range(_PRIME_MIN_TOKENS, min(len(ids), _PRIME_MAX_TOKENS) + 1):
            suffix = ids[-n:]
            text = self._backend.decode(suffix, skip_special_tokens=self.skip_special_tokens)
            if _REPLACEMENT_CHAR not in text:
                return suffix
        return []

    def _decode_next(self, token_id: int) -> str:
        if not 0 <= token_id < self._vocab_size:
            return ""  # an id past the tokenizer (padded model vocab) has no text
        try:
            text = self._stream.step(self._backend, token_id)
        except Exception as e:  # the tokenizers binding raises a bare Exception
            if not str(e).startswith(_INVALID_PREFIX_ERR):
                raise
            # Non-monotonic decoders can break the stream's prefix; restart it at this token.
            self._stream = self._new_stream([])
            text = self._stream.step(self._backend, token_id)
        return text or ""


class SlowIncrementalDetokenizer(IncrementalDetokenizer):
    """vLLM's `detokenize_incrementally`: decode tokens[prefix:] and keep what lies past
    tokens[prefix:read], so decoders that look at neighbours (spaces, "##") stay right."""

    decodes_text = True

    def __init__(
        self,
        tokenizer: Any,
        params: SamplingParams | None,
        prompt_token_ids: list[int],
    ) -> None:
        super().__init__(params)
        self._tokenizer = tokenizer
        self._vocab_size = len(tokenizer)
        self.spaces_between_special_tokens = (
            params or SamplingParams()
        ).spaces_between_special_tokens
        self._added_vocab = set() if tokenizer.is_fast else set(tokenizer.get_added_vocab())
        prompt_ids = prompt_token_ids[-_SLOW_PREFIX_OFFSET - 2 :]
        self._tokens = self._to_tokens(prompt_ids)
        self._read_offset = len(self._tokens)
        self._prefix_offset = max(self._read_offset - _SLOW_PREFIX_OFFSET, 0)

    def _to_tokens(self, ids: list[int]) -> list[str]:
        ids = [t for t in ids if 0 <= t < self._vocab_size]
        tokens = self._tokenizer.convert_ids_to_tokens(
            ids, skip_special_tokens=self.skip_special_tokens
        )
        return [t for t in tokens if t]  # ids without a token (holes in the vocab) add nothing

    def _to_string(self, tokens: list[str]) -> str:
        if not self._added_vocab:
            return self._tokenizer.convert_tokens_to_string(tokens)
        # Slow tokenizers: added tokens are joined as they are, not through the model's decoder.
        parts: list[str] = []
        run: list[str] = []
        for token in tokens:
            if token in self._added_vocab:
                if run:
                    parts.append(self._tokenizer.convert_tokens_to_string(run))
                    run = []
                parts.append(token)
            else:
                run.append(token)
        if run:
            parts.append(self._tokenizer.convert_tokens_to_string(run))
        return (" " if self.spaces_between_special_tokens else "").join(parts)

    def _decode_next(self, token_id: int) -> str:
        self._tokens.extend(self._to_tokens([token_id]))
        prefix_text = self._to_string(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._to_string(self._tokens[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""  # nothing yet, or an unfinished multi-byte character
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        return new_text[len(prefix_text) :]


def make_detokenizer(
    tokenizer: Any,
    params: SamplingParams | None,
    prompt_token_ids: list[int],
    *,
    fast: bool | None = None,
    final_only: bool = False,
) -> IncrementalDetokenizer:
    """The detokenizer for one request: a no-text one when detokenize=False (or no tokenizer),
    else the DecodeStream one for fast tokenizers (`fast=False` forces the fallback).
    `final_only`: the text is read once, when the request ends (it is decoded then)."""
    if tokenizer is None or (params is not None and not params.detokenize):
        return IncrementalDetokenizer(params)
    if fast is None:
        fast = getattr(tokenizer, "backend_tokenizer", None) is not None
    if fast:
        return FastIncrementalDetokenizer(
            tokenizer, params, prompt_token_ids, final_only=final_only
        )
    return SlowIncrementalDetokenizer(tokenizer, params, prompt_token_ids)
