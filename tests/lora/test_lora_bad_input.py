"""Bad adapters and bad uses of LoRA are ValueErrors at the edge, and the engine keeps serving:
a good request after each bad one runs. One adapter slot (max_loras=1) still serves a batch of
two adapters (the scheduler runs them in turn) with PEFT's outputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.lora.conftest import LLAMA_TARGETS, make_adapter, peft_greedy
from tests.utils import make_tiny_llama_dir
from v1 import LLM, LoRARequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = {"prompt_token_ids": [1, 5, 9, 13]}


def _bad_adapters(llama_dir: str, good: str, root: Path) -> list[tuple[str, str]]:
    """(folder, words of the error) for each kind of bad adapter."""
    from transformers import LlamaForCausalLM

    malformed = root / "malformed"
    shutil.copytree(good, malformed)
    (malformed / "adapter_config.json").write_text("{not json")
    no_weights = root / "no_weights"
    shutil.copytree(good, no_weights)
    (no_weights / "adapter_model.safetensors").unlink()
    corrupt = root / "corrupt"
    shutil.copytree(good, corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 20)
    dora = root / "dora"
    shutil.copytree(good, dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    model = LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    rank16 = make_adapter(model, root / "rank16", ["q_proj"], 16, seed=11)
    other_dir = make_tiny_llama_dir(root / "other_base", hidden_size=32, intermediate_size=64)
    other = LlamaForCausalLM.from_pretrained(other_dir, dtype=torch.float32)
    other_base = make_adapter(other, root / "other_adapter", LLAMA_TARGETS, 4, seed=12)
    lm_head = make_adapter(
        LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.float32),
        root / "lm_head",
        ["lm_head"],
        4,
        seed=13,
    )
    return [
        (str(root / "nowhere"), "does not exist"),
        (str(root), "has no adapter_config.json"),
        (str(malformed), "malformed adapter_config.json"),
        (str(no_weights), "has no adapter_model.safetensors"),
        (str(corrupt), "malformed adapter_model.safetensors"),
        (str(dora), "use_dora"),
        (rank16, "max_lora_rank=8"),
        (other_base, "another base model"),
        (lm_head, "not a LoRA A/B weight"),
    ]


def test_bad_adapters_are_value_errors_and_the_engine_keeps_serving(
    llama_dir: str, llama_adapters: list[str], tmp_path: Path
) -> None:
    from transformers import LlamaForCausalLM

    bad = _bad_adapters(llama_dir, llama_adapters[0], tmp_path)
    good = LoRARequest("good", 1, llama_adapters[0])
    want = peft_greedy(LlamaForCausalLM, llama_dir, good.lora_path, 4, input_ids=[1, 5, 9, 13])
    with LLM(
        llama_dir,
        multiprocess=False,
        num_kv_blocks=64,
        block_size=4,
        max_model_len=64,
        enable_lora=True,
        max_loras=1,
        max_lora_rank=8,
    ) as llm:
        for i, (path, words) in enumerate(bad):
            with pytest.raises(ValueError, match=words):
                llm.generate(PROMPT, GREEDY, lora_request=LoRARequest(f"bad{i}", 10 + i, path))
            (out,) = llm.generate(PROMPT, GREEDY, lora_request=good)
            assert out.outputs[0].token_ids == want
        with pytest.raises(ValueError, match="already adapter"):
            llm.generate(PROMPT, GREEDY, lora_request=LoRARequest("x", 1, llama_adapters[1]))
        # One slot, two adapters in one call: they run in turn, each with its own weights.
        second = LoRARequest("second", 2, llama_adapters[1])
        outs = llm.generate([PROMPT] * 3, GREEDY, lora_request=[good, second, good])
        want2 = peft_greedy(
            LlamaForCausalLM, llama_dir, second.lora_path, 4, input_ids=[1, 5, 9, 13]
        )
        assert [o.outputs[0].token_ids for o in outs] == [want, want2, want]


def test_lora_request_without_enable_lora_is_refused(
    llama_dir: str, llama_adapters: list[str]
) -> None:
    with LLM(
        llama_dir, multiprocess=False, num_kv_blocks=64, block_size=4, max_model_len=64
    ) as llm:
        with pytest.raises(ValueError, match="LoRA is not enabled"):
            llm.generate(PROMPT, GREEDY, lora_request=LoRARequest("a", 1, llama_adapters[0]))
        (out,) = llm.generate(PROMPT, GREEDY)
        assert len(out.outputs[0].token_ids) == 4


def test_lora_config_edges() -> None:
    from v1.config import LoRAConfig

    with pytest.raises(ValueError, match="max_loras"):
        LoRAConfig(max_loras=0)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoRAConfig(max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/x")
