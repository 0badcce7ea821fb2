"""A checkpoint tensor not read yet: tensor-parallel ranks read only their slices of it.
Must hold: code written for plain tensors keeps working (anything but `narrow`, `t` and
`materialize` reads the whole tensor first; see `CheckpointSlice`).
"""

from __future__ import annotations

from typing import Any

import torch

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class CheckpointSlice:
    """A rectangular part of one safetensors tensor (the whole of it at first).

    `iterate_weights(..., lazy=True)` yields these instead of tensors. `narrow` and `t` stay
    lazy; `materialize` reads the selected part from safetensors (`safe_open(...).get_slice`).
    Anything else (a model's `load_weights` reshaping, comparing, casting) reads the whole
    tensor first: attributes fall through to the materialized tensor and torch functions
    materialize these arguments."""

    def __init__(
        self,
        source: Any,
        full_shape: tuple[int, ...],
        dtype_name: str,
        bounds: tuple[tuple[int, int], ...] | None = None,
        transposed: bool = False,
    ) -> None:
        self._source = source  # a safetensors PySafeSlice (valid after its file is closed)
        self._full_shape = tuple(full_shape)
        self._dtype_name = dtype_name
        self._bounds = bounds or tuple((0, n) for n in self._full_shape)
        """(start, stop) per dimension of the stored (untransposed) tensor."""
        self._transposed = transposed
        """2-D only: the view is the stored tensor's transpose (GPT-2's Conv1D weights)."""

    @classmethod
    def of(cls, source: Any) -> CheckpointSlice:
        return cls(source, tuple(source.get_shape()), source.get_dtype())

    @property
    def shape(self) -> torch.Size:
        dims = [stop - start for start, stop in self._bounds]
        return torch.Size(dims[::-1] if self._transposed else dims)

    @property
    def dtype(self) -> torch.dtype:
        return _SAFETENSORS_DTYPES[self._dtype_name]

    @property
    def ndim(self) -> int:
        return len(self._bounds)

    def dim(self) -> int:
        return self.ndim

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def t(self) -> CheckpointSlice:
        if self.ndim != 2:
            raise ValueError(f"t() needs a 2-D tensor, got shape {tuple(self.shape)}")
        return CheckpointSlice(
            self._source, self._full_shape, self._dtype_name, self._bounds, not self._transposed
        )

    def narrow(self, dim: int, start: int, length: int) -> CheckpointSlice:
        dim = dim % self.ndim
        stored_dim = (self.ndim - 1 - dim) if self._transposed else dim
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(
                f"narrow({dim}, {start}, {length}) is out of range for shape {tuple(self.shape)}"
            )
        bounds = list(self._bounds)
        lo = bounds[stored_dim][0]
        bounds[stored_dim] = (lo + start, lo + start + length)
        return CheckpointSlice(
            self._source, self._full_shape, self._dtype_name, tuple(bounds), self._transposed
        )

    def materialize(self) -> torch.Tensor:
        """Reads exactly the selected part."""
        if not self._bounds:
            tensor = self._source[:]
        else:
            tensor = self._source[tuple(slice(start, stop) for start, stop in self._bounds)]
        return tensor.t() if self._transposed else tensor

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        values = _materialized(kwargs.values())
        return func(*_materialized(args), **dict(zip(kwargs, values, strict=True)))

    def __repr__(self) -> str:
        return f"CheckpointSlice(shape={tuple(self.shape)}, dtype={self._dtype_name})"


def _materialized(values: Any) -> list[Any]:
    return [v.materialize() if isinstance(v, CheckpointSlice) else v for v in values]


def as_tensor(loaded: Any) -> torch.Tensor:
    """A plain tensor from a tensor or a CheckpointSlice."""
    return loaded.materialize() if isinstance(loaded, CheckpointSlice) else loaded
