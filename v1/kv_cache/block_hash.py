"""Chained content hashes of full KV blocks, the keys of the prefix cache.

A block's hash covers its parent's hash, its token ids and extra keys, so equal hashes mean equal
prefixes. The encoding is canonical bytes (struct-packed, type-tagged), never pickle.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from v1.kv_cache.kv_request import KVRequest

_INT = struct.Struct("<q")


def _encode_key(key: object, out: list[bytes]) -> None:
    """Append a type-tagged, length-prefixed encoding of `key` (so no two keys collide)."""
    if key is None:
        out.append(b"n")
    elif isinstance(key, bool):
        out.append(b"t" if key else b"f")
    elif isinstance(key, int):
        data = str(key).encode()
        out += [b"i", _INT.pack(len(data)), data]
    elif isinstance(key, float):
        out += [b"d", struct.pack("<d", key)]
    elif isinstance(key, str):
        data = key.encode()
        out += [b"s", _INT.pack(len(data)), data]
    elif isinstance(key, bytes):
        out += [b"b", _INT.pack(len(key)), key]
    elif isinstance(key, (tuple, list)):
        out += [b"l", _INT.pack(len(key))]
        for item in key:
            _encode_key(item, out)
    else:
        raise TypeError(f"unsupported extra key type {type(key).__name__}: {key!r}")


def hash_block_tokens(
    parent_hash: bytes | None,
    token_ids: Sequence[int],
    extra_keys: tuple | None = None,
) -> bytes:
    """sha256 of (parent hash, token ids, extra keys); `parent_hash` None for the first block."""
    parts: list[bytes] = []
    if parent_hash is None:
        parts.append(b"root")
    else:
        parts += [b"parent", _INT.pack(len(parent_hash)), parent_hash]
    parts += [b"tokens", _INT.pack(len(token_ids)), struct.pack(f"<{len(token_ids)}q", *token_ids)]
    if extra_keys is not None:
        parts.append(b"extra")
        _encode_key(extra_keys, parts)
    return hashlib.sha256(b"".join(parts)).digest()


def block_extra_keys(request: KVRequest, block_index: int) -> tuple | None:
    """Extra keys of one block: the first block of an encoder-decoder request carries the
    encoder input's hash, so equal decoder prompts over different encoder inputs never share KV,
    and the first block of a LoRA request its adapter id, so two adapters never share a prefix
    (every later block inherits both through the chain)."""
    if block_index != 0:
        return None
    keys: tuple = ()
    if request.encoder_hash is not None:
        keys = ("encoder", request.encoder_hash)
    if request.lora_int_id:
        keys = (*keys, "lora", request.lora_int_id)
    return keys or None


def request_block_hashes(request: KVRequest, block_size: int) -> list[bytes]:
    """Extend `request.block_hashes` with the hashes of newly full blocks of all_token_ids.

    Returns only the hashes added by this call.
    """
    hashes = request.block_hashes
    token_ids = request.all_token_ids
    num_full_blocks = len(token_ids) // block_size
    start = len(hashes)
    parent = hashes[-1] if hashes else None
    for i in range(start, num_full_blocks):
        block_tokens = token_ids[i * block_size : (i + 1) * block_size]
        parent = hash_block_tokens(parent, block_tokens, block_extra_keys(request, i))
        hashes.append(parent)
    return hashes[start:]


_BLOCK_INDEX = struct.Struct("<I")


@functools.lru_cache(maxsize=1 << 14)
def _encoder_states_root(content_hash: str) -> bytes:
    parts: list[bytes] = [b"encoder-states"]
    _encode_key(content_hash, parts)
    return hashlib.sha256(b"".join(parts)).digest()


def encoder_states_block_hashes(content_hash: str, num_blocks: int) -> list[bytes]:
    """Prefix-cache keys of the first `num_blocks` blocks of the cross-attention K/V or encoder
    states of one encoder input (its content hash): equal keys mean equal rows. One sha256 per
    input (memoized: beam steps and n>1 children look the entry up again), then the block
    index appended: 36-byte keys, never equal to a token block's 32-byte hash."""
    return list(iter_encoder_states_block_hashes(content_hash, num_blocks))


def iter_encoder_states_block_hashes(content_hash: str, num_blocks: int) -> Iterator[bytes]:
    """`encoder_states_block_hashes`, one key at a time: a lookup that misses on its first
    block (a new input, the common case) makes one key, not `num_blocks`."""
    root = _encoder_states_root(content_hash)
    pack = _BLOCK_INDEX.pack
    return (root + pack(i) for i in range(num_blocks))
