"""Multi-LoRA serving's config (`LoRAConfig`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving: PEFT adapters chosen per request (v1/lora/)."""

    enable_lora: bool = False
    """Serve LoRA adapters (requests name one with `lora_request`)."""
    max_loras: int = 1
    """Adapters one step may run together: the slots on the device (and the most distinct
    adapters among running requests)."""
    max_lora_rank: int = 16
    """Highest adapter rank accepted (the slots' rank; smaller ranks are zero-padded)."""
    max_cpu_loras: int | None = None
    """Adapters kept read in host memory (least recently used ones dropped); None: max_loras."""

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )

    @property
    def num_cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
