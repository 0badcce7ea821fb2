"""`LoRAModelManager`: the worker's adapters. It attaches a `LoRALinear` to each of the
model's Linears, keeps up to max_loras adapters in device slots (the least recently used one
without running requests gives its slot up) and up to max_cpu_loras read on the host.

An adapter the worker cannot read (its folder deleted or corrupted after the frontend checked
it) raises `LoRALoadError` for the requests that use it, which the runner fails alone. Its id
stays failed in this engine: rows of the failed requests already ran (with the base weights)
into caches keyed by that id, so no later request may reuse them; the fixed folder is served
again under a new lora_int_id (the server's /v1/load_lora_adapter gives every load a new id).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from v1.config import LoRAConfig
from v1.lora.layers import LoRAIndices, LoRALinear
from v1.lora.peft_adapter import LoRAAdapter, load_adapter
from v1.lora.targets import LoRATargets
from v1.lora_request import LoRARequest


class LoRALoadError(ValueError):
    """The worker could not read a request's adapter; the message names the adapter."""


class LoRAModelManager:
    def __init__(
        self,
        model: nn.Module,
        lora_config: LoRAConfig,
        max_decoder_rows: int,
        max_encoder_rows: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.config = lora_config
        self.targets = LoRATargets(model)
        self.indices = LoRAIndices(max_decoder_rows, max_encoder_rows, device)
        self.layers: dict[str, LoRALinear] = {}
        for name, target in self.targets.targets.items():
            layer = LoRALinear(
                target,
                lora_config.max_loras,
                lora_config.max_lora_rank,
                self.indices,
                dtype,
                device,
            )
            self.targets.linears[name].lora = layer
            self.layers[name] = layer
        self.slot_ids: list[int] = [0] * lora_config.max_loras
        """Adapter id in each device slot (0: empty)."""
        self.num_users: dict[int, int] = {}
        """Adapter id -> requests in the batch using it (its slot stays while > 0)."""
        self.slot_order: OrderedDict[int, None] = OrderedDict()
        """Slots, least recently used first."""
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        """Adapters read on the host, least recently used first (max_cpu_loras)."""
        self.failed: dict[int, str] = {}
        """Adapter id -> why the worker could not read it (stays failed, see above)."""

    def slot_of(self, lora_int_id: int) -> int | None:
        return self.slot_ids.index(lora_int_id) if lora_int_id in self.slot_ids else None

    def acquire(self, request: LoRARequest) -> int:
        """The device slot of a request's adapter (read and written there if it is not),
        counted as used until `release`. LoRALoadError (nothing changed) when the adapter
        cannot be read."""
        lora_id = request.lora_int_id
        slot = self.slot_of(lora_id)
        if slot is None:
            adapter = self._host_adapter(request)  # the only step that can fail: first
            slot = self._free_slot()
            for name, layer in self.layers.items():
                subs = adapter.weights.get(name)
                if subs:
                    layer.set_slot(slot, subs)
                elif self.slot_ids[slot]:
                    layer.clear_slot(slot)
            self.slot_ids[slot] = lora_id
        self.num_users[lora_id] = self.num_users.get(lora_id, 0) + 1
        self.slot_order.pop(slot, None)
        self.slot_order[slot] = None
        return slot

    def release(self, lora_int_id: int) -> None:
        self.num_users[lora_int_id] -= 1

    def _free_slot(self) -> int:
        if 0 in self.slot_ids:
            return self.slot_ids.index(0)
        for slot in self.slot_order:  # least recently used first
            if self.num_users.get(self.slot_ids[slot], 0) == 0:
                return slot
        raise AssertionError(
            f"all {len(self.slot_ids)} LoRA slots are used by running requests (the scheduler "
            "admits at most max_loras distinct adapters)"
        )

    def _host_adapter(self, request: LoRARequest) -> LoRAAdapter:
        lora_id = request.lora_int_id
        if lora_id in self.failed:
            raise LoRALoadError(self.failed[lora_id])
        adapter = self.host.pop(lora_id, None)
        if adapter is None:
            try:
                adapter = load_adapter(request, self.targets, self.config.max_lora_rank)
            except Exception as e:  # noqa: BLE001 - any read failure fails its requests alone
                message = (
                    f"LoRA adapter {request.lora_name!r} (lora_int_id {lora_id}) could not be "
                    f"read by the worker: {e}. Its requests fail; serve the fixed folder under "
                    "a new lora_int_id"
                )
                self.failed[lora_id] = message
                raise LoRALoadError(message) from e
        self.host[request.lora_int_id] = adapter
        while len(self.host) > self.config.num_cpu_loras:
            self.host.popitem(last=False)
        return adapter
