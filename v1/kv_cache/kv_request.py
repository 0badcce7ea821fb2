"""What the KV cache reads of a request: `KVRequest`, a structural type.

`v1.core.request.Request` satisfies it; the KV cache never imports the core (it sits a floor
below). The cache writes only `block_hashes` (chained hashes of full blocks) and `num_kv_slots`.
"""

from __future__ import annotations

from typing import Protocol


class KVRequest(Protocol):
    request_id: str
    all_token_ids: list[int]
    """Prompt then output tokens (the prompt list itself for a pooling request)."""
    num_computed_tokens: int
    block_hashes: list[bytes]
    """Chained hashes of the full blocks of all_token_ids (filled by the KV cache)."""
    num_kv_slots: int
    """Decoder tokens its full-attention tables hold slots for (kept by the KV cache)."""

    @property
    def num_tokens(self) -> int: ...

    @property
    def is_pooling(self) -> bool: ...

    @property
    def encoder_hash(self) -> str | None: ...

    @property
    def num_encoder_tokens(self) -> int: ...

    @property
    def lora_int_id(self) -> int:
        """The LoRA adapter the request runs with (0: none): part of its first block's key."""
        ...
