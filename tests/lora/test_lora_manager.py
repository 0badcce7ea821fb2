"""The worker's adapter slots: an adapter stays in its device slot while requests use it, the
least recently used free slot is reused, smaller ranks and untargeted sub-projections are zero,
and at most max_cpu_loras adapters stay read on the host."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from v1.config import LoRAConfig
from v1.lora import LoRAModelManager, LoRARequest
from v1.models.llama import LlamaForCausalLM


def test_slots_are_reused_least_recently_used_first(
    llama_dir: str, llama_adapters: list[str]
) -> None:
    model = LlamaForCausalLM(AutoConfig.from_pretrained(llama_dir))
    config = LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    manager = LoRAModelManager(model, config, 16, 16, torch.device("cpu"), torch.float32)
    a = LoRARequest("a", 1, llama_adapters[0])
    b = LoRARequest("b", 2, llama_adapters[1])
    c = LoRARequest("c", 3, llama_adapters[0])
    assert manager.acquire(a) == 0 and manager.acquire(b) == 1
    assert manager.acquire(a) == 0  # already in its slot
    qkv = manager.layers["model.layers.0.self_attn.qkv_proj"]
    # b (rank 8, q and v only): k's columns and rows are zero in its slot.
    q_size = model.model.layers[0].self_attn.qkv_proj.q_size
    kv_size = model.model.layers[0].self_attn.qkv_proj.kv_size
    assert qkv.lora_a[1, :8].abs().sum() > 0 and qkv.lora_a[1, 8:16].abs().sum() == 0
    assert qkv.lora_b[1, q_size : q_size + kv_size].abs().sum() == 0
    # a (rank 4): only the first 4 rank rows of each sub-projection are set.
    assert qkv.lora_a[0, 4:8].abs().sum() == 0 and qkv.lora_a[0, 8:12].abs().sum() > 0
    with pytest.raises(AssertionError, match="all 2 LoRA slots"):
        manager.acquire(c)  # both slots in use (the scheduler never lets this happen)
    manager.release(1)
    manager.release(1)
    assert manager.acquire(c) == 0  # the slot no running request uses (b still has one)
    assert manager.slot_ids == [3, 2]
    assert list(manager.host) == [2, 3]  # max_cpu_loras=2: a dropped from the host
