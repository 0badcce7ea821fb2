"""Multi-LoRA serving: `LoRARequest`, PEFT adapter folders read and checked against the model
(`peft_adapter.py`), where each PEFT target lands in our fused Linears (`targets.py`), the
batched LoRA product (`ops.py`, Triton in `triton_ops.py`) and the worker's device slots
(`layers.py`, `manager.py`). Applied from outside the model code: models only declare their
targets (`lora_target_modules`, `lora_target`, `lora_encoder_modules`).
"""

from v1.lora.manager import LoRALoadError, LoRAModelManager
from v1.lora.peft_adapter import LoRAAdapter, load_adapter
from v1.lora.targets import LoRATargets, lora_targets_for_config
from v1.lora_request import LoRARequest

__all__ = [
    "LoRAAdapter",
    "LoRALoadError",
    "LoRAModelManager",
    "LoRARequest",
    "LoRATargets",
    "load_adapter",
    "lora_targets_for_config",
]
