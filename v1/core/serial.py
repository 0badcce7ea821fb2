"""msgpack (msgspec) encoding of wire messages with numpy arrays carried as extra ZMQ frames.
Must hold: no pickle and no fallback to it; arrays travel without copies on either side
(layout at `MsgpackEncoder`, exact in docs/protocol.md). One encoder/decoder per thread: each
keeps the frames of the message in flight.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

ARRAY_EXT = 1
"""msgpack ext type code of a numpy array stored in an aux frame."""
TENSOR_EXT = 2
"""msgpack ext type code of a torch CPU tensor stored in an aux frame."""

# dtype kinds that are plain bytes (bool, ints, uints, floats, complex): safe to rebuild from a
# buffer. Object, string, datetime and structured arrays are refused.
_ARRAY_KINDS = frozenset("biufc")

Buffer = bytes | bytearray | memoryview
"""One frame: `bytes` from copying receives, `memoryview` (of a zmq.Frame) from copy=False."""


class DecodeError(ValueError):
    """A message that is not a valid encoding of the expected type (malformed, unknown type,
    bad array reference). The receiver logs it and drops the message."""


class MsgpackEncoder:
    """Encodes a message into frames: `[msgpack_bytes, *array_buffers]`.

    An array becomes a msgpack ext value (code 1; code 2 for a torch CPU tensor) whose payload
    is `[dtype, shape, frame_index]`; its bytes travel in frame `frame_index` of the same
    multipart message. With `share_views` (the core's outputs), numpy arrays that are
    contiguous views of one contiguous array (a step's pooled vectors: rows of one host copy)
    share that array's frame: their payload is `[dtype, shape, frame_index, byte_offset]`, so a
    message of n such rows has one aux frame, not n. The whole base array travels, so this
    suits messages that send all of it (not a frontend's windows of a long audio file).

    The array buffers are memoryviews of the arrays themselves (no copy); keep the message alive
    until zmq has sent them (send with copy=False uses them in place)."""

    def __init__(self, share_views: bool = False) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._aux: list[memoryview] | None = None
        self._share_views = share_views
        self._bases: dict[int, tuple[int, int, int, np.ndarray]] = {}
        """id(base array) -> (frame index, base address, base bytes, base), this message's."""

    def encode(self, obj: Any) -> list[Buffer]:
        self._aux = []
        try:
            frames: list[Buffer] = [self._encoder.encode(obj)]
            frames.extend(self._aux)
            return frames
        finally:
            self._aux = None
            self._bases.clear()

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            base = obj.base
            if self._share_views and isinstance(base, np.ndarray) and obj.flags.c_contiguous:
                shared = self._view_ext(obj, base)
                if shared is not None:
                    return shared
            return self._array_ext(ARRAY_EXT, obj, obj.dtype.str)
        if isinstance(obj, np.generic):
            return obj.item()
        torch = sys.modules.get("torch")  # only a process that has torch can hold a tensor
        if torch is not None and isinstance(obj, torch.Tensor):
            if obj.device.type != "cpu":
                raise TypeError(f"only CPU tensors can be sent, got one on {obj.device}")
            dtype = str(obj.dtype).removeprefix("torch.")
            raw = obj.detach().contiguous().view(-1).view(torch.uint8).numpy()
            return self._array_ext(TENSOR_EXT, raw, dtype, shape=tuple(obj.shape))
        raise TypeError(f"cannot encode objects of type {type(obj).__name__}")

    def _view_ext(self, arr: np.ndarray, base: np.ndarray) -> msgspec.msgpack.Ext | None:
        """`arr` as a slice of its base's frame (sent once per message), or None when the base
        is not one plain contiguous block of numbers holding it."""
        while isinstance(base.base, np.ndarray):
            base = base.base
        if arr.dtype.kind not in _ARRAY_KINDS:
            raise TypeError(f"cannot send arrays of dtype {arr.dtype} (only bool and numbers)")
        known = self._bases.get(id(base))
        if known is None:
            if not base.flags.c_contiguous or base.dtype.kind not in _ARRAY_KINDS:
                return None
            assert self._aux is not None, "enc_hook outside encode()"
            self._aux.append(memoryview(base.reshape(-1).view(np.uint8)))
            known = (len(self._aux), base.ctypes.data, base.nbytes, base)
            self._bases[id(base)] = known
        index, address, nbytes, _ = known
        offset = arr.ctypes.data - address
        if not 0 <= offset <= nbytes - arr.nbytes:
            return None
        header = msgspec.msgpack.encode((arr.dtype.str, arr.shape, index, offset))
        return msgspec.msgpack.Ext(ARRAY_EXT, header)

    def _array_ext(
        self, code: int, arr: np.ndarray, dtype: str, shape: tuple[int, ...] | None = None
    ) -> msgspec.msgpack.Ext:
        if arr.dtype.kind not in _ARRAY_KINDS:
            raise TypeError(f"cannot send arrays of dtype {arr.dtype} (only bool and numbers)")
        assert self._aux is not None, "enc_hook outside encode()"
        shape = arr.shape if shape is None else shape
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")  # the only copy: a non-contiguous array
        self._aux.append(memoryview(arr.reshape(-1).view(np.uint8)))
        index = len(self._aux)  # frame 0 is the msgpack payload
        header = msgspec.msgpack.encode((dtype, shape, index))
        return msgspec.msgpack.Ext(code, header)


class MsgpackDecoder:
    """Decodes `[msgpack_bytes, *array_buffers]` into `type`; arrays are `np.frombuffer` views
    of their frames (zero copy: they keep the frame alive and share its memory)."""

    def __init__(self, type: Any = Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(type, ext_hook=self._ext_hook)
        self._header_decoder = msgspec.msgpack.Decoder(list[str | list[int] | int])
        self._aux: Sequence[Buffer] = ()

    def decode(self, frames: Sequence[Any]) -> Any:
        """`frames`: bytes, memoryviews or zmq.Frame objects (from recv_multipart(copy=False))."""
        if not frames:
            raise DecodeError("empty message")
        buffers = [f.buffer if hasattr(f, "buffer") else f for f in frames]
        self._aux = buffers
        try:
            return self._decoder.decode(buffers[0])
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise DecodeError(f"malformed message: {e}") from e
        finally:
            self._aux = ()

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code not in (ARRAY_EXT, TENSOR_EXT):
            raise DecodeError(f"unknown msgpack ext type {code}")
        try:
            header = self._header_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise DecodeError(f"malformed array header: {e}") from e
        dtype_name, shape, index, offset = _checked_header(header, code)
        if not 1 <= index < len(self._aux):
            raise DecodeError(f"array refers to frame {index}; the message has {len(self._aux)}")
        buf = self._aux[index]
        if code == TENSOR_EXT:
            return _tensor_from_buffer(buf, dtype_name, shape)
        try:
            dtype = np.dtype(dtype_name)
        except TypeError as e:
            raise DecodeError(f"unknown array dtype {dtype_name!r}") from e
        if dtype.kind not in _ARRAY_KINDS:
            raise DecodeError(f"array dtype {dtype_name!r} is not bool or a number")
        count = _num_elements(shape)
        nbytes = memoryview(buf).nbytes
        if offset is None:
            if count * dtype.itemsize != nbytes:
                raise DecodeError(
                    f"frame {index} holds {nbytes} bytes; "
                    f"shape {shape} of {dtype_name} needs {count * dtype.itemsize}"
                )
            return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)
        if offset + count * dtype.itemsize > nbytes:
            raise DecodeError(
                f"frame {index} holds {nbytes} bytes; shape {shape} of {dtype_name} at byte "
                f"{offset} needs {offset + count * dtype.itemsize}"
            )
        return np.frombuffer(buf, dtype=dtype, count=count, offset=offset).reshape(shape)


def _checked_header(header: list[Any], code: int) -> tuple[str, list[int], int, int | None]:
    """`[dtype, shape, index]`, or `[dtype, shape, index, byte_offset]` (numpy arrays only: a
    slice of a frame other arrays share)."""
    if len(header) not in (3, 4) or (len(header) == 4 and code != ARRAY_EXT):
        raise DecodeError(f"malformed array header: {header!r}")
    dtype_name, shape, index = header[:3]
    offset = header[3] if len(header) == 4 else None
    if (
        not isinstance(dtype_name, str)
        or not isinstance(shape, list)
        or not all(type(d) is int for d in shape)
        or type(index) is not int
        or (offset is not None and (type(offset) is not int or offset < 0))
    ):
        raise DecodeError(f"malformed array header: {header!r}")
    return dtype_name, shape, index, offset


def _num_elements(shape: list[int]) -> int:
    if any(d < 0 for d in shape):
        raise DecodeError(f"negative array dimension in {shape}")
    count = 1
    for d in shape:
        count *= d
    return count


def _tensor_from_buffer(buf: Buffer, dtype_name: str, shape: list[int]) -> Any:
    import torch

    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise DecodeError(f"unknown tensor dtype {dtype_name!r}")
    nbytes = memoryview(buf).nbytes
    count = _num_elements(shape)
    if count * dtype.itemsize != nbytes:
        raise DecodeError(
            f"tensor of shape {shape} and {dtype_name} needs "
            f"{count * dtype.itemsize} bytes; its frame holds {nbytes}"
        )
    raw = np.frombuffer(buf, dtype=np.uint8)
    with warnings.catch_warnings():
        # A read-only frame gives a read-only tensor; torch warns that it cannot enforce that.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(raw).view(dtype).reshape(shape)
