"""Shared LoRA test set-up: random PEFT adapters saved with PEFT itself, and PEFT's own greedy
outputs (fp32 CPU) as the reference. PEFT is the oracle here, never the runtime."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.utils import TINY_BART_WIDE, make_tiny_bart_dir, make_tiny_llama_dir, make_tiny_t5_dir

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BART_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
T5_TARGETS = ["q", "k", "v", "o", "wi", "wo"]


def make_adapter(
    model: Any,
    path: Path,
    targets: list[str] | str,
    rank: int,
    *,
    seed: int,
    alpha: float = 16.0,
    rslora: bool = False,
    std: float = 0.2,
) -> str:
    """A random LoRA adapter of `model` (a transformers model) saved by PEFT into `path`;
    `targets`: PEFT's target_modules (names, or one regex a whole module name must match)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets,
        init_lora_weights=False,
        use_rslora=rslora,
    )
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    peft_model.save_pretrained(str(path))
    peft_model.unload()  # the base model as it was (save_pretrained wrote the adapter only)
    return str(path)


@torch.inference_mode()
def peft_greedy(
    model_cls: Any, base: str, adapter: str | None, num_tokens: int, **inputs: Any
) -> list[int]:
    """PEFT's greedy tokens (argmax of a full forward each step, no EOS stop): decoder-only
    from `input_ids`, encoder-decoder from encoder inputs and `decoder_input_ids`."""
    from peft import PeftModel

    model = model_cls.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    key = "decoder_input_ids" if "decoder_input_ids" in inputs else "input_ids"
    seq = inputs.pop(key)
    if key == "decoder_input_ids":  # the encoder once (with the adapter), not every step
        inputs = {"encoder_outputs": model.get_encoder()(**inputs)}
    out: list[int] = []
    for _ in range(num_tokens):
        logits = model(**inputs, **{key: torch.tensor([seq])}).logits[0, -1]
        token = int(logits.argmax())
        seq = [*seq, token]
        out.append(token)
    return out


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("lora_llama"))


@pytest.fixture(scope="session")
def llama_adapters(llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Two adapters of ranks 4 and 8 (the second with rslora, attention only)."""
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("llama_adapters")
    model = LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    first = make_adapter(model, root / "a4", LLAMA_TARGETS, 4, seed=1)
    model = LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    second = make_adapter(
        model, root / "b8", ["q_proj", "v_proj", "o_proj", "up_proj"], 8, seed=2, rslora=True
    )
    return [first, second]


@pytest.fixture(scope="session")
def bart_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    # Plain greedy in transformers' defaults too (no forced EOS, no n-gram blocking).
    return make_tiny_bart_dir(tmp_path_factory.mktemp("lora_bart"), base=TINY_BART_WIDE)


@pytest.fixture(scope="session")
def bart_adapters(bart_dir: str, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    from transformers import BartForConditionalGeneration

    root = tmp_path_factory.mktemp("bart_adapters")
    model = BartForConditionalGeneration.from_pretrained(bart_dir, dtype=torch.float32)
    first = make_adapter(model, root / "a4", BART_TARGETS, 4, seed=3)
    model = BartForConditionalGeneration.from_pretrained(bart_dir, dtype=torch.float32)
    second = make_adapter(model, root / "b8", ["k_proj", "v_proj", "fc1"], 8, seed=4)
    return [first, second]


@pytest.fixture(scope="session")
def t5_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_t5_dir(tmp_path_factory.mktemp("lora_t5"), feed_forward_proj="gated-gelu")


WHISPER_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]


@pytest.fixture(scope="session")
def whisper_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.utils import WHISPER_BASE, make_tiny_whisper_dir

    if not WHISPER_BASE.is_dir():
        pytest.skip(f"needs the real whisper-base folder at {WHISPER_BASE}")
    return make_tiny_whisper_dir(tmp_path_factory.mktemp("lora_whisper"))


@pytest.fixture(scope="session")
def whisper_adapters(whisper_dir: str, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Rank 4 on every projection of encoder and decoder (cross-attention included); rank 8
    on the encoder's and the cross-attention's k/v only."""
    from transformers import WhisperForConditionalGeneration

    root = tmp_path_factory.mktemp("whisper_adapters")
    model = WhisperForConditionalGeneration.from_pretrained(whisper_dir, dtype=torch.float32)
    first = make_adapter(model, root / "a4", WHISPER_TARGETS, 4, seed=5, std=0.3)
    model = WhisperForConditionalGeneration.from_pretrained(whisper_dir, dtype=torch.float32)
    second = make_adapter(
        model,
        root / "b8",
        r".*encoder\.layers\.\d+\.self_attn\.(k_proj|v_proj)|.*encoder_attn\.(k_proj|v_proj)",
        8,
        seed=6,
        std=0.3,
    )
    return [first, second]


@pytest.fixture(scope="session")
def t5_adapters(t5_dir: str, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Rank 4 on every T5 projection (gated wi_0 / wi_1 included); rank 8 on q, v, wo."""
    from transformers import T5ForConditionalGeneration

    root = tmp_path_factory.mktemp("t5_adapters")
    model = T5ForConditionalGeneration.from_pretrained(t5_dir, dtype=torch.float32)
    first = make_adapter(model, root / "a4", [*T5_TARGETS, "wi_0", "wi_1"], 4, seed=7)
    model = T5ForConditionalGeneration.from_pretrained(t5_dir, dtype=torch.float32)
    second = make_adapter(model, root / "b8", ["q", "v", "wo"], 8, seed=8)
    return [first, second]
