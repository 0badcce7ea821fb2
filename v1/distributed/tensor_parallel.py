"""The tensor-parallel sharder: splits a model built at full size across the ranks, applied
from outside the model code (gpt-fast style; each layer's class says how it splits).
Must hold: no rank ever holds the full weights (built on meta, loaders read only the rank's
slice), and attention layers keep their rank's heads, so the KV caches hold them too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from v1.attention.layer import Attention
from v1.distributed.parallel_state import TensorParallelGroup
from v1.models.checkpoint_slice import as_tensor
from v1.models.layers.embedding import LMHead, VocabEmbedding
from v1.models.layers.linear import Linear, MergedColumnLinear, QKVLinear, RowLinear

Loader = Callable[..., None]


class _EmptyOnMeta(TorchFunctionMode):
    """`torch.empty` of a non-empty shape goes to the meta device: parameters are allocated
    that way, while computed buffers (RoPE frequencies, sinusoid tables) and norms' ones are
    real and stay where they are built."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func is torch.empty and _numel(args) > 0:
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


def _numel(shape_args: tuple) -> int:
    dims = shape_args
    if len(shape_args) == 1 and isinstance(shape_args[0], (tuple, list, torch.Size)):
        dims = shape_args[0]
    count = 1
    for d in dims:
        count *= int(d)
    return count


@contextmanager
def build_on_meta() -> Iterator[None]:
    """Build the model inside this on the meta device, so no rank allocates the full size."""
    with _EmptyOnMeta():
        yield


def check_divisible(hf_config: Any, model: nn.Module, world_size: int) -> None:
    """ValueError naming the first layer whose heads or features do not split evenly."""
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            heads, kv_heads = module.num_heads, module.num_kv_heads
            if heads % world_size or (kv_heads % world_size and world_size % kv_heads):
                raise ValueError(
                    f"tensor_parallel_size={world_size} does not divide the attention heads of "
                    f"{name} ({heads} query heads, {kv_heads} kv heads)"
                )
        elif isinstance(module, MergedColumnLinear) and not isinstance(module, QKVLinear):
            if any(size % world_size for size in module.output_sizes):
                raise ValueError(
                    f"tensor_parallel_size={world_size} does not divide {name}'s output sizes "
                    f"{module.output_sizes}"
                )
        elif isinstance(module, Linear) and module.shard_dim is not None:
            size = module.output_size if module.shard_dim == 0 else module.input_size
            if size % world_size:
                raise ValueError(
                    f"tensor_parallel_size={world_size} does not divide {name}'s "
                    f"{'output' if module.shard_dim == 0 else 'input'} size {size}"
                )


def shard_model(model: nn.Module, tp: TensorParallelGroup, device: torch.device) -> nn.Module:
    """Resize every parameter to this rank's part (on `device`), with slice-reading loaders;
    parameters that do not split become full-size, real tensors. Returns the model.

    How a layer splits: `shard_dim` of the linears and embeddings; fused q/k/v and k/v by
    heads, GQA kv heads replicated when there are fewer than ranks. Each parameter gets its
    rank's shape on the real device and a `weight_loader` that reads only the rank's slice of
    the checkpoint tensor (a CheckpointSlice when the loader reads lazily)."""
    check_divisible(getattr(model, "config", None), model, tp.world_size)
    replaced: dict[int, nn.Parameter] = {}
    heads: list[LMHead] = []
    for module in model.modules():
        if isinstance(module, LMHead):
            heads.append(module)  # after the embeddings they may be tied to
        elif isinstance(module, QKVLinear):
            _shard_qkv(module, tp, device, replaced)
        elif isinstance(module, MergedColumnLinear):
            _shard_merged(module, tp, device, replaced)
        elif isinstance(module, RowLinear):
            _shard_row(module, tp, device, replaced)
        elif isinstance(module, Linear) and module.shard_dim == 0:
            _shard_merged_parts(module, [module.output_size], tp, device, replaced)
        elif isinstance(module, VocabEmbedding) and module.shard_dim is not None:
            _shard_embedding(module, tp, device, replaced)
        elif isinstance(module, Attention):
            _shard_heads(module, tp)
    for head in heads:
        _shard_lm_head(head, tp, device, replaced)
    _materialize_rest(model, device)
    return model


# ---- parameters ----
def _new_param(
    module: nn.Module,
    name: str,
    shape: tuple[int, ...],
    device: torch.device,
    loader: Loader,
    replaced: dict[int, nn.Parameter],
) -> None:
    old = getattr(module, name)
    param = nn.Parameter(torch.empty(shape, dtype=old.dtype, device=device), requires_grad=False)
    param.weight_loader = loader
    replaced[id(old)] = param
    setattr(module, name, param)


def _copy_into(target: torch.Tensor, loaded: Any) -> None:
    if target.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch: parameter part {tuple(target.shape)} vs checkpoint part "
            f"{tuple(loaded.shape)}"
        )
    with torch.no_grad():
        target.copy_(as_tensor(loaded))


def _check_full(loaded: Any, dim: int, expected: int) -> None:
    if loaded.shape[dim] != expected:
        raise ValueError(
            f"shape mismatch: checkpoint dim {dim} is {loaded.shape[dim]}, expected {expected}"
        )


def _part_ranges(
    module: Linear, full_sizes: list[int], tp: TensorParallelGroup
) -> list[tuple[int, int, int]]:
    """Per fused part: (offset in the local weight, offset of this rank's rows within the
    part's checkpoint tensor, rows). q/k/v split by heads; kv heads fewer than ranks are
    replicated (each rank keeps the kv head its query heads read)."""
    out, local_offset = [], 0
    for i, full in enumerate(full_sizes):
        if isinstance(module, QKVLinear) and i > 0 and module.num_kv_heads < tp.world_size:
            rows = module.head_size
            kv_head = tp.rank * module.num_kv_heads // tp.world_size
            start = kv_head * rows
        else:
            rows = full // tp.world_size
            start = tp.rank * rows
        out.append((local_offset, start, rows))
        local_offset += rows
    return out


def _shard_merged_parts(
    module: Linear,
    full_sizes: list[int],
    tp: TensorParallelGroup,
    device: torch.device,
    replaced: dict[int, nn.Parameter],
) -> None:
    """Column-parallel over fused parts: each part keeps its rank's rows, in part order."""
    parts = _part_ranges(module, full_sizes, tp)
    local_out = sum(rows for _, _, rows in parts)
    full_offsets = [sum(full_sizes[:i]) for i in range(len(full_sizes))]

    def loader(param: nn.Parameter, loaded: Any, shard_id: int | str | None = None) -> None:
        if shard_id is None:  # the fused checkpoint tensor (or a plain column linear)
            _check_full(loaded, 0, sum(full_sizes))
            for (local, start, rows), full_offset in zip(parts, full_offsets, strict=True):
                _copy_into(
                    param.narrow(0, local, rows), loaded.narrow(0, full_offset + start, rows)
                )
            return
        index = {"q": 0, "k": 1, "v": 2}[shard_id] if isinstance(shard_id, str) else shard_id
        local, start, rows = parts[index]
        _check_full(loaded, 0, full_sizes[index])
        _copy_into(param.narrow(0, local, rows), loaded.narrow(0, start, rows))

    _new_param(module, "weight", (local_out, module.input_size), device, loader, replaced)
    if module.bias is not None:
        _new_param(module, "bias", (local_out,), device, loader, replaced)
    module.output_size = local_out
    if isinstance(module, MergedColumnLinear):
        module.output_sizes = [rows for _, _, rows in parts]
    module.tp = tp


def _shard_merged(
    module: MergedColumnLinear,
    tp: TensorParallelGroup,
    device: torch.device,
    replaced: dict[int, nn.Parameter],
) -> None:
    _shard_merged_parts(module, list(module.output_sizes), tp, device, replaced)


def _shard_qkv(
    module: QKVLinear, tp: TensorParallelGroup, device: torch.device, replaced: dict
) -> None:
    _shard_merged_parts(module, list(module.output_sizes), tp, device, replaced)
    module.num_heads //= tp.world_size
    module.num_kv_heads = max(1, module.num_kv_heads // tp.world_size)


def _shard_row(
    module: RowLinear, tp: TensorParallelGroup, device: torch.device, replaced: dict
) -> None:
    cols = module.input_size // tp.world_size
    start = tp.rank * cols

    def weight_loader(param: nn.Parameter, loaded: Any) -> None:
        _check_full(loaded, 1, module.input_size * tp.world_size)
        _copy_into(param, loaded.narrow(1, start, cols))

    def bias_loader(param: nn.Parameter, loaded: Any) -> None:
        # Added once after the all-reduce: rank 0 holds it, the others add zeros.
        if tp.rank == 0:
            _copy_into(param, loaded)
        else:
            _check_full(loaded, 0, param.shape[0])
            with torch.no_grad():
                param.zero_()

    _new_param(module, "weight", (module.output_size, cols), device, weight_loader, replaced)
    if module.bias is not None:
        _new_param(module, "bias", (module.output_size,), device, bias_loader, replaced)
    module.input_size = cols
    module.tp = tp


def _vocab_rows(num_rows: int, tp: TensorParallelGroup) -> tuple[int, int, int]:
    """(rows per rank padded, this rank's first row, rows of it the checkpoint fills)."""
    per_rank = -(-num_rows // tp.world_size)
    start = tp.rank * per_rank
    return per_rank, start, max(0, min(per_rank, num_rows - start))


def _vocab_loader(num_rows: int, tp: TensorParallelGroup) -> Loader:
    per_rank, start, filled = _vocab_rows(num_rows, tp)

    def loader(param: nn.Parameter, loaded: Any) -> None:
        _check_full(loaded, 0, num_rows)
        with torch.no_grad():
            param.zero_()  # padding rows: never selected, logits dropped
        if filled:
            _copy_into(param.narrow(0, 0, filled), loaded.narrow(0, start, filled))

    return loader


def _shard_embedding(
    module: VocabEmbedding, tp: TensorParallelGroup, device: torch.device, replaced: dict
) -> None:
    if module.shard_dim == 1:  # T5's relative bias: [buckets, heads] split by heads
        cols = module.embedding_dim // tp.world_size
        if cols * tp.world_size != module.embedding_dim:
            raise ValueError(
                f"tensor_parallel_size={tp.world_size} does not divide the "
                f"{module.embedding_dim} heads of a relative-position bias table"
            )

        def loader(param: nn.Parameter, loaded: Any) -> None:
            _check_full(loaded, 1, module.embedding_dim)
            _copy_into(param, loaded.narrow(1, tp.rank * cols, cols))

        _new_param(module, "weight", (module.num_embeddings, cols), device, loader, replaced)
        return
    per_rank, start, _ = _vocab_rows(module.num_embeddings, tp)
    loader = _vocab_loader(module.num_embeddings, tp)
    _new_param(module, "weight", (per_rank, module.embedding_dim), device, loader, replaced)
    module.vocab_start = start
    module.tp = tp


def _shard_lm_head(
    head: LMHead, tp: TensorParallelGroup, device: torch.device, replaced: dict
) -> None:
    per_rank, _, _ = _vocab_rows(head.vocab_size, tp)
    if head.tied:
        head.weight = replaced[id(head.weight)]  # the embedding's rows: same split
    else:
        loader = _vocab_loader(head.vocab_size, tp)
        _new_param(head, "weight", (per_rank, head.hidden_size), device, loader, replaced)
    if head.bias is not None:
        _new_param(head, "bias", (per_rank,), device, _vocab_loader(head.vocab_size, tp), replaced)
    head.tp = tp


def _shard_heads(layer: Attention, tp: TensorParallelGroup) -> None:
    layer.num_heads //= tp.world_size
    layer.num_kv_heads = max(1, layer.num_kv_heads // tp.world_size)
    layer.impl = layer.backend.get_impl_cls()(
        layer.num_heads, layer.head_size, layer.scale, layer.num_kv_heads, layer.attn_type
    )


def _materialize_rest(model: nn.Module, device: torch.device) -> None:
    """Parameters and buffers still on meta (replicated ones) become full-size real tensors
    (a parameter shared by several modules stays one)."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not param.is_meta:
                continue
            new = made.get(id(param))
            if new is None:
                new = nn.Parameter(torch.empty_like(param, device=device), requires_grad=False)
                loader = getattr(param, "weight_loader", None)
                if loader is not None:
                    new.weight_loader = loader
                made[id(param)] = new
            setattr(module, name, new)
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf.is_meta:
                raise AssertionError(f"buffer {name} of {type(module).__name__} built on meta")
