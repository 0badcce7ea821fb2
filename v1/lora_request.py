"""`LoRARequest`: which LoRA adapter a request runs with (names follow vLLM).

A msgspec Struct so it crosses the process boundary as it is (a field of EngineCoreRequest);
the adapter itself is read by the worker from `lora_path` (v1/lora/).
"""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True):
    """`LoRARequest(name, id, path)`: a PEFT adapter folder served under `lora_name`."""

    lora_name: str
    """The name clients use (the server's `"model"` field)."""
    lora_int_id: int
    """The adapter's identity in the engine (>= 1): requests with equal ids share one loaded
    adapter, its encoder outputs and its cached prefix blocks."""
    lora_path: str
    """Folder with adapter_config.json and adapter_model.safetensors (PEFT's save_pretrained)."""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if not self.lora_path:
            raise ValueError("lora_path must not be empty")
