"""Whether a request may ever enter the core, checked once (the scheduler's admitter decides
which enter each step): the start-up capacity check refuses a configuration where one maximal
request could never run, naming the knob; `check_request` turns a request that could never run,
or whose numbers do not fit the step tensors, into that request's error. No torch.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
import numpy as np

from v1.config import EngineConfig, pooling_row_tokens
from v1.core.protocol import EngineCoreRequest
from v1.kv_cache.capacity import max_tokens_that_fit, num_blocks_needed, num_usable_blocks
from v1.kv_cache.spec import KVCacheConfig

if TYPE_CHECKING:
    from v1.model_info import ModelInfo

_INT32_MAX = 2**31 - 1


def check_engine_capacity(
    config: EngineConfig, info: ModelInfo, kv_cache_config: KVCacheConfig
) -> None:
    """Raises ValueError when one request of the longest allowed size cannot run: its KV blocks
    (self-attention for max_model_len, plus cross-attention for the longest encoder input) must
    fit the pool, its prompt must fit one step when prefill is not chunked, and its encoder input
    must fit the per-step encoder budget and the encoder cache."""
    mc, sc = config.model_config, config.scheduler_config
    max_model_len = mc.effective_max_model_len
    max_encoder_len = mc.max_encoder_len if info.has_cross_attention else 0
    if kv_cache_config.groups:
        needed = num_blocks_needed(kv_cache_config, max_model_len, max_encoder_len)
        usable = num_usable_blocks(kv_cache_config)
        if needed > usable:
            cross = f" plus {max_encoder_len} encoder positions" if max_encoder_len else ""
            fits = max_tokens_that_fit(kv_cache_config, max_encoder_len)
            hint = (
                f"; or set max_model_len <= {fits}"
                if fits > 0
                else " (not even the cross-attention blocks of one encoder input fit)"
            )
            raise ValueError(
                f"the KV cache is too small for one request of max_model_len={max_model_len} "
                f"tokens{cross}: it needs {needed} blocks of {kv_cache_config.block_size} tokens "
                f"but the cache has {usable} (num_kv_blocks={kv_cache_config.num_blocks}, one is "
                f"reserved). Raise num_kv_blocks (or kv_cache_memory_bytes / "
                f"gpu_memory_utilization){hint}"
            )
    unchunked = info.generates and not sc.enable_chunked_prefill
    if unchunked and sc.max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"with enable_chunked_prefill=False a prompt runs whole in one step, but "
            f"max_num_batched_tokens={sc.max_num_batched_tokens} is below "
            f"max_model_len={max_model_len}: raise max_num_batched_tokens, lower "
            f"max_model_len or enable chunked prefill"
        )
    if max_encoder_len:
        for name, value in (
            ("max_num_encoder_input_tokens", config.encoder_budget),
            ("encoder_cache_size", config.encoder_cache_size),
        ):
            if value < max_encoder_len:
                raise ValueError(
                    f"{name}={value} is below the model's longest encoder input "
                    f"({max_encoder_len} positions): such inputs could never run; raise {name}"
                )


def check_request(
    request: EngineCoreRequest, config: EngineConfig, info: ModelInfo, max_model_len: int
) -> None:
    """Raises ValueError for a request the core must not queue: empty, too long for the model
    or the step budgets (so it could never run), or with a number its step tensors cannot
    hold."""
    ids = request.prompt_token_ids
    if not isinstance(ids, (list, np.ndarray)):  # the wire types it loosely (arrays)
        raise ValueError(f"prompt_token_ids must be a list of ints, got {type(ids).__name__}")
    if len(ids) == 0:
        raise ValueError("the prompt is empty")
    _check_numbers(request, config, info)
    params = request.sampling_params
    # The alignment pass reads whole heads; under tensor parallelism each rank has some.
    tp = config.parallel_config.tensor_parallel_size
    if params is not None and params.word_timestamps and tp > 1:
        raise ValueError(
            "word_timestamps is not supported with tensor_parallel_size > 1 (the alignment "
            "heads are split across ranks)"
        )
    num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids or ())
    mc, sc = config.model_config, config.scheduler_config
    if request.output_token_ids:
        if request.pooling_params is not None:
            raise ValueError("output_token_ids belong to generation requests")
        max_tokens = request.sampling_params.max_tokens if request.sampling_params else None
        if max_tokens is not None and len(request.output_token_ids) >= max_tokens:
            raise ValueError("output_token_ids already reach max_tokens")
    if request.pooling_params is None and num_tokens >= max_model_len:
        raise ValueError(
            f"prompt of {num_tokens} tokens leaves no room to generate "
            f"within max_model_len={max_model_len}"
        )
    enc = request.encoder_input
    if enc is not None:
        num_encoder_tokens = enc.num_encoder_tokens
        for limit, what in (
            (mc.max_encoder_len, "the model's"),
            (config.encoder_budget, "the per-step encoder budget"),
            (config.encoder_cache_size, "the encoder cache"),
        ):
            if num_encoder_tokens > limit:
                raise ValueError(
                    f"encoder input of {num_encoder_tokens} positions exceeds {what} ({limit})"
                )
    if request.pooling_params is not None and num_tokens > sc.max_num_batched_tokens:
        raise ValueError(
            f"input of {num_tokens} tokens exceeds "
            f"max_num_batched_tokens={sc.max_num_batched_tokens}"
        )
    if request.input_lens is not None:
        _check_packed(request, config)
    # Anything shorter than max_model_len fits the KV cache and the step budget on its own:
    # check_engine_capacity refused every configuration where it would not.


def _check_packed(request: EngineCoreRequest, config: EngineConfig) -> None:
    """A request packing several pooling inputs (EngineCoreRequest.input_lens): lengths that
    add up to its prompt, a task with one vector per input, and a size its runner row and the
    step's input count hold."""
    params, lens = request.pooling_params, request.input_lens
    if params is None:
        raise ValueError("input_lens packs pooling inputs; this request generates")
    if params.task == "encode":
        raise ValueError(
            "packed inputs (input_lens) need a task with one vector per input: embed, "
            "classify or score, not encode"
        )
    checked = checked_ids(lens, _INT32_MAX)
    if not checked or min(checked) < 1:
        raise ValueError("input_lens must be a non-empty list of positive input lengths")
    num_tokens = len(request.prompt_token_ids)
    if sum(checked) != num_tokens:
        raise ValueError(
            f"input_lens add up to {sum(checked)} tokens, but the prompt has {num_tokens}"
        )
    max_inputs = config.scheduler_config.max_num_seqs
    if len(checked) > max_inputs:
        raise ValueError(f"{len(checked)} packed inputs exceed max_num_seqs={max_inputs}")
    row = pooling_row_tokens(config)
    if num_tokens > row:
        raise ValueError(f"packed inputs of {num_tokens} tokens exceed {row} tokens a request")


def _check_numbers(request: EngineCoreRequest, config: EngineConfig, info: ModelInfo) -> None:
    """Every id and number inside the range its step tensor holds (the frontend checks these
    too; a request from another frontend, or changed after its checks, fails alone here)."""
    mc = config.model_config
    ids = request.prompt_token_ids
    if isinstance(ids, np.ndarray):
        _check_id_array(ids, request, info.prompt_vocab_size)
    else:
        _check_ids(ids, info.prompt_vocab_size, "prompt_token_ids")
    if info.generates and request.output_token_ids:
        _check_ids(request.output_token_ids, mc.vocab_size, "output_token_ids")
    if not info.generates and request.token_type_ids is not None:
        limit = getattr(mc.hf_config, "type_vocab_size", 2)
        if len(request.token_type_ids) != len(request.prompt_token_ids):
            raise ValueError("token_type_ids must have one id per input token")
        _check_ids(request.token_type_ids, limit, "token_type_ids")
    enc = request.encoder_input
    if enc is not None:
        if not 0 < enc.num_encoder_tokens <= _INT32_MAX:
            raise ValueError(f"num_encoder_tokens must be > 0, got {enc.num_encoder_tokens}")
        if enc.token_ids is not None:
            _check_ids(enc.token_ids, mc.encoder_vocab_size, "encoder token_ids")
    if request.eos_token_id is not None and not _in_range(request.eos_token_id, mc.vocab_size):
        raise ValueError(f"eos_token_id {request.eos_token_id!r} is outside the vocabulary")
    if isinstance(request.priority, bool) or not isinstance(request.priority, int):
        raise ValueError(f"priority must be an integer, got {request.priority!r}")
    if not -(2**63) <= request.priority < 2**63:
        raise ValueError(f"priority must fit in 64 bits, got {request.priority}")
    params = request.sampling_params
    if params is not None:
        params.validate()
        params.validate_for_model(mc.vocab_size)
    elif request.pooling_params is not None:
        request.pooling_params.__post_init__()  # the same checks as on construction


def _check_id_array(ids: np.ndarray, request: EngineCoreRequest, limit: int) -> None:
    """An array of prompt ids (packed pooling inputs only): 1-D integers in [0, limit)."""
    if request.input_lens is None:
        raise ValueError("prompt_token_ids may be an array only for packed inputs (input_lens)")
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ValueError(f"prompt_token_ids must be 1-D integers, got {ids.dtype} {ids.shape}")
    if int(ids.min()) < 0 or int(ids.max()) >= limit:
        raise ValueError(f"prompt_token_ids hold ids outside [0, {limit})")


def _in_range(value: object, limit: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < limit


def checked_ids(ids: Any, limit: int) -> list[int] | None:
    """A new list of `ids` (a list or tuple) if every one is an int in [0, limit) (no bools;
    numpy integer scalars, as `list(array)` gives, become ints), else None: the caller looks
    for the culprit to name it. One pass at C speed (msgspec), where a type pass, min and
    max took 4x longer per request."""
    try:
        return msgspec.convert((ids,), _ids_type(limit)).ids
    except msgspec.ValidationError:
        plain = _numpy_ints_as_ints(ids)
        return None if plain is None else checked_ids(plain, limit)


def checked_id_lists(lists: list[Any], limit: int) -> list[list[int]] | None:
    """`checked_ids` of many lists in one msgspec pass (a chunk of prompts): new lists, or
    None when any list fails (the caller checks each alone to name the culprit)."""
    try:
        return msgspec.convert((lists,), _id_lists_type(limit)).ids
    except msgspec.ValidationError:
        plain = [_numpy_ints_as_ints(ids) for ids in lists]
        if all(p is None for p in plain):
            return None
        return checked_id_lists(
            [ids if p is None else p for ids, p in zip(lists, plain, strict=True)], limit
        )


def _numpy_ints_as_ints(ids: Any) -> list[Any] | None:
    """`ids` with its numpy integer scalars as ints, or None if it holds none (msgspec takes
    only Python ints; the slow path of a check that failed)."""
    if not isinstance(ids, (list, tuple)) or not any(isinstance(t, np.integer) for t in ids):
        return None
    return [int(t) if isinstance(t, np.integer) else t for t in ids]


@functools.lru_cache(maxsize=16)
def _id_lists_type(limit: int) -> Any:
    return msgspec.defstruct(
        "CheckedIdLists",
        [("ids", list[list[Annotated[int, msgspec.Meta(ge=0, lt=limit)]]])],
        array_like=True,
    )


@functools.lru_cache(maxsize=16)
def _ids_type(limit: int) -> Any:
    """A one-field array-like Struct around the checked list: msgspec finds a Struct's
    compiled type by identity, where a bare `list[Annotated[...]]` is hashed through
    typing's Python-level __hash__ on every call (~1.3 us of a 5 us check of 136 ids)."""
    return msgspec.defstruct(
        "CheckedIds", [("ids", list[Annotated[int, msgspec.Meta(ge=0, lt=limit)]])], array_like=True
    )


def _check_ids(ids: list[int], limit: int, what: str) -> None:
    if checked_ids(ids, limit) is not None:
        return
    for t in ids:
        if not _in_range(t, limit):
            raise ValueError(f"{what} holds {t!r}, not a token id in [0, {limit})")
