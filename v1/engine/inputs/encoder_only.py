"""Encoder-only (pooling) models (BERT, RoBERTa/XLM-R, sentence embedders, cross-encoders).

The text, a text pair (with token_type_ids) or token ids are the input; it runs whole in one
step, so it is held to the model's limit (the sentence-transformers max_seq_length included)
and the per-step token budget; truncate_prompt_tokens keeps the FIRST tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any

import numpy as np

from v1.core.admission import checked_id_lists, checked_ids
from v1.core.protocol import EngineCoreRequest, now
from v1.engine.inputs.base import TokenInputBuilder, check_keys, check_text, opt_list
from v1.pooling_params import PoolingParams, PoolingParamsError

if TYPE_CHECKING:
    from v1.config import ModelConfig
    from v1.model_info import ModelInfo


@dataclass(slots=True)
class TokenizedText:
    """A text (or text pair) prompt as `pretokenize` tokenized it with others, or a token-id
    prompt whose ids it checked with others (or left to `pack` to check)."""

    input_ids: list[int] | np.ndarray
    """A list, or (unchecked token-id prompts only) the caller's 1-D integer array."""
    token_type_ids: list[int] | None
    pair: tuple[str, str] | None
    """The text pair (truncation tokenizes it again); None for one text."""
    checked: bool = True
    """False: the caller's own ids (list or array), unchecked; `pack` checks them with its
    pack's others."""


class UncheckedIdsError(ValueError):
    """An input of a pack holds token ids that are not ids of the vocabulary (`pack`): the
    message is the one that input gets alone; `index` is its place in the pack."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        self.index = index


_TOKEN_IDS_ONLY = {"prompt_token_ids"}
_TEXT_PAIR = {"text", "text_pair"}


def _as_list(ids: Any) -> Any:
    """An integer array's ids as a list (for the one-pass check of many prompts' lists)."""
    return ids.tolist() if type(ids) is np.ndarray and ids.dtype.kind in "iu" else ids


def pack_spans(lens: list[int], max_tokens: int, max_inputs: int) -> list[tuple[int, int]]:
    """Consecutive [start, end) spans of inputs of these lengths, each at most `max_inputs`
    inputs and `max_tokens` tokens (an input longer than that alone)."""
    spans: list[tuple[int, int]] = []
    start, tokens = 0, 0
    for i, n in enumerate(lens):
        if i > start and (tokens + n > max_tokens or i - start >= max_inputs):
            spans.append((start, i))
            start, tokens = i, 0
        tokens += n
    if lens:
        spans.append((start, len(lens)))
    return spans


def _prompt_kinds(prompts: list[Any]) -> tuple[list[int], list[int], list[int]]:
    """Indices of the prompts `pretokenize` handles together, in one pass: (token-id prompts
    with a non-empty list, tuple or 1-D array, non-empty texts, text pairs of two non-empty
    texts)."""
    ids_only: list[int] = []
    texts: list[int] = []
    pairs: list[int] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if p:
                texts.append(i)
        elif isinstance(p, dict):
            keys = p.keys()
            if keys == _TOKEN_IDS_ONLY:
                ids = p["prompt_token_ids"]
                is_list = isinstance(ids, (list, tuple)) and len(ids) > 0
                if is_list or (isinstance(ids, np.ndarray) and ids.ndim == 1 and ids.size):
                    ids_only.append(i)
            elif keys == _TEXT_PAIR and all(isinstance(t, str) and t for t in p.values()):
                pairs.append(i)
    return ids_only, texts, pairs


class EncoderOnlyInputBuilder(TokenInputBuilder):
    accepts_token_type_ids = True

    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: Any,
        info: ModelInfo | None = None,
        *,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        super().__init__(model_config, tokenizer, info)
        pooling = self.info.pooling
        assert pooling is not None
        # sentence-transformers max_seq_length (MiniLM: 256).
        self.max_encoder_len = min(self.max_encoder_len, pooling.max_input_len)
        if max_num_batched_tokens is not None:
            # An encoder-only input runs whole in one step.
            self.max_encoder_len = min(self.max_encoder_len, max_num_batched_tokens)
        self.type_vocab_size: int = getattr(model_config.hf_config, "type_vocab_size", 2)
        self._valid_params: PoolingParams | None = None
        """A private copy of the last params that passed `check_params`: params equal to it
        pass without the checks (the requests of a batch share one params object)."""

    def check_params(self, params: Any) -> None:
        if self._valid_params is not None and params == self._valid_params:
            return
        if not isinstance(params, PoolingParams):
            raise ValueError(
                f"{self.model_config.architecture} is an encoder-only (pooling) model: use "
                f"embed/classify/score with PoolingParams, not {type(params).__name__}"
            )
        if params.task in ("classify", "score") and not self.info.has_classifier:
            raise PoolingParamsError(
                f"task {params.task!r} needs a sequence classification model; "
                f"{self.model_config.architecture} has no classifier head (use task 'embed')",
                param="model",
            )
        self.info.check_pooling_params(params)
        self._valid_params = params.clone()

    def build(
        self,
        request_id: str,
        prompt: Any,
        params: PoolingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> EngineCoreRequest:
        ids, type_ids = self.input_ids(prompt, params.truncate_prompt_tokens)
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=ids,
            pooling_params=params,
            token_type_ids=type_ids,
            arrival_time=now() if arrival_time is None else arrival_time,
            priority=priority,
        )

    def decoder_prompt_len(self, prompt: Any, truncate_prompt_tokens: int | None = None) -> int:
        return 0  # no decoder: the input runs once and is pooled

    def pretokenize(self, prompts: list[Any], *, check_ids: bool = True) -> list[Any]:
        """Texts and text pairs (those `input_ids` would tokenize without an error first) become
        TokenizedText, two tokenizer calls for all: what one call per prompt would give.
        Token-id prompts ({"prompt_token_ids": non-empty list}) have their ids checked in one
        pass for all and become TokenizedText too; if any fails, each keeps its own check
        (which names the culprit). `check_ids=False` (prompts that go to `pack`): token-id
        prompts become TokenizedText of the caller's own lists, unchecked; `pack` checks them
        in the same pass that builds its id array."""
        out = list(prompts)
        ids_only, texts, pairs = _prompt_kinds(prompts)
        if not check_ids:
            for i in ids_only:
                ids = prompts[i]["prompt_token_ids"]
                if type(ids) is not list and type(ids) is not np.ndarray:
                    ids = list(ids)
                out[i] = TokenizedText(ids, None, None, False)
        elif len(ids_only) > 1:
            lists = [_as_list(prompts[i]["prompt_token_ids"]) for i in ids_only]
            checked = checked_id_lists(lists, self.encoder_vocab_size)
            if checked is not None:
                for i, ids in zip(ids_only, checked, strict=True):
                    out[i] = TokenizedText(ids, None, None)
        if len(texts) > 1:
            enc = self.tokenizer([prompts[i] for i in texts], add_special_tokens=True)
            type_ids = enc.get("token_type_ids") or [None] * len(texts)
            for i, ids, types in zip(texts, enc["input_ids"], type_ids, strict=True):
                out[i] = TokenizedText(list(ids), opt_list(types), None)
        if len(pairs) > 1:
            firsts = [prompts[i]["text"] for i in pairs]
            enc = self.tokenizer(firsts, [prompts[i]["text_pair"] for i in pairs])
            type_ids = enc.get("token_type_ids") or [None] * len(pairs)
            for i, ids, types in zip(pairs, enc["input_ids"], type_ids, strict=True):
                pair = (prompts[i]["text"], prompts[i]["text_pair"])
                out[i] = TokenizedText(list(ids), opt_list(types), pair)
        return out

    def input_ids(self, prompt: Any, truncate: int | None) -> tuple[list[int], list[int] | None]:
        """(input ids, token type ids or None) of a text, text pair, token ids or
        TokenizedText."""
        pair: tuple[str, str] | None = None
        if isinstance(prompt, TokenizedText):
            ids, type_ids, pair = prompt.input_ids, prompt.token_type_ids, prompt.pair
            if len(ids) == 0:
                raise ValueError("the input is empty after tokenization")
            if not prompt.checked and (truncate is not None or len(ids) > self.max_encoder_len):
                # Truncation reads the ids themselves: checked first, as a prompt alone is.
                return self.input_ids({"prompt_token_ids": ids}, truncate)
        elif isinstance(prompt, dict) and "text" in prompt:
            check_keys(prompt)
            pair = (check_text(prompt["text"]), check_text(prompt.get("text_pair")))
            enc = self.tokenizer(*pair)
            ids, type_ids = list(enc["input_ids"]), opt_list(enc.get("token_type_ids"))
        elif isinstance(prompt, dict) and "encoder_prompt" in prompt:
            raise ValueError("encoder/decoder prompt pairs need an encoder-decoder model")
        else:
            ids, type_ids = self.singleton(
                prompt, add_special_tokens=True, what="input", vocab_size=self.encoder_vocab_size
            )
        if type_ids is not None:
            limit = self.type_vocab_size
            checked = checked_ids(type_ids, limit)
            if checked is None or len(checked) != len(ids):
                raise ValueError(
                    f"token_type_ids must be one id in [0, {limit}) per input token "
                    f"({len(ids)} tokens, {len(type_ids)} type ids)"
                )
            type_ids = checked
        return self.fit_encoder(ids, type_ids, truncate, pair=pair)

    def pooling_inputs(self, prompts: list[Any], params: list[PoolingParams]) -> list[Any]:
        """The (input ids, segment ids or None) of prompts that go packed (`pack`), prompt i
        with params[i]: `build`'s checks and tokenization without building requests, texts
        tokenized together and token ids left for `pack` to check (`pretokenize(check_ids=
        False)`). A prompt that fails holds its ValueError instead."""
        out: list[Any] = []
        limit = self.max_encoder_len
        valid = None
        for prompt, p in zip(self.pretokenize(prompts, check_ids=False), params, strict=True):
            try:
                if p is not valid:  # a batch shares one params object
                    self.check_params(p)
                    valid = p
                if (
                    type(prompt) is TokenizedText
                    and not prompt.checked
                    and p.truncate_prompt_tokens is None
                    and len(prompt.input_ids) <= limit
                ):
                    out.append((prompt.input_ids, None))  # what input_ids would return
                else:
                    out.append(self.input_ids(prompt, p.truncate_prompt_tokens))
            except ValueError as e:
                out.append(e)
        return out

    def pack(
        self,
        request_id: str,
        inputs: list[tuple[list[int], list[int] | None]],
        params: PoolingParams,
        group_id: str | None = None,
    ) -> EngineCoreRequest:
        """Inputs of equal params (`pooling_inputs`' (ids, segment ids)) as one core request
        `request_id` that runs them apart (EngineCoreRequest.input_lens): their ids as one
        int32 array (one frame on the wire, one row copy in the runner, a vectorized check in
        the core: a list costs each of them per id), their segment ids back to back. The array
        is built in one pass that also checks the ids `pretokenize(check_ids=False)` left
        unchecked: UncheckedIdsError, naming the first input whose ids are not int ids of the
        vocabulary."""
        lens = [len(ids) for ids, _ in inputs]
        parts = [ids for ids, _ in inputs]
        vocab = self.encoder_vocab_size
        if all(type(part) is np.ndarray for part in parts):  # the caller's arrays
            # Each array's own dtype: concatenating would turn bools into ints.
            valid = all(part.dtype.kind in "iu" and part.ndim == 1 for part in parts)
            ids = np.concatenate(parts) if valid else None
            valid = valid and int(ids.min()) >= 0 and int(ids.max()) < vocab
        else:
            # The check a prompt alone gets, for all in one msgspec pass (an int array would
            # take a bool among ints as 0 or 1), then the array from the checked ids.
            checked = checked_id_lists([_as_list(part) for part in parts], vocab)
            valid = checked is not None
            ids = np.fromiter(chain.from_iterable(checked), np.int64, sum(lens)) if valid else None
        if not valid:
            self._name_bad_input(inputs)
        types = None
        if any(t is not None for _, t in inputs):
            types = list(
                chain.from_iterable(
                    t if t is not None else [0] * n for (_, t), n in zip(inputs, lens, strict=True)
                )
            )
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=ids.astype(np.int32),
            pooling_params=params,
            token_type_ids=types,
            input_lens=lens,
            arrival_time=now(),
            group_id=group_id,
            streamed=False,
        )

    def _name_bad_input(self, inputs: list[tuple[list[int], list[int] | None]]) -> None:
        """Raises UncheckedIdsError for the first input whose ids fail the check a prompt alone
        gets (a pack failed `pack`'s one-pass check)."""
        for index, (ids, _) in enumerate(inputs):
            try:
                self.input_ids({"prompt_token_ids": ids}, None)
            except ValueError as e:
                raise UncheckedIdsError(str(e), index) from e
        raise AssertionError("a pack failed its check but each of its inputs passes alone")
