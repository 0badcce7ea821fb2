"""Multi-LoRA Whisper: adapters on the encoder, the decoder and the cross-attention projections;
one batch mixes the base model and two adapters over the same audio, every request equal to
PEFT's greedy tokens, and each adapter gets its own encoder run (the encoder cache and the
cross-attention cache are keyed by adapter)."""

from __future__ import annotations

import numpy as np
import torch

from tests.lora.conftest import peft_greedy
from v1 import LLM, LoRARequest, SamplingParams

SR = 16_000
NUM_TOKENS = 6


def test_whisper_mixed_batch_matches_peft(whisper_dir: str, whisper_adapters: list[str]) -> None:
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    wave = np.random.default_rng(0).standard_normal(SR * 3).astype(np.float32) * 0.1
    prompt = {"prompt": "", "multi_modal_data": {"audio": (wave, SR)}}
    loras = [LoRARequest("a4", 1, whisper_adapters[0]), LoRARequest("b8", 2, whisper_adapters[1])]
    per_prompt = [None, loras[0], loras[1], loras[0]]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    with LLM(
        whisper_dir,
        multiprocess=False,
        block_size=16,
        num_kv_blocks=1024,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    ) as llm:
        outs = llm.generate([prompt] * 4, params, lora_request=per_prompt)
        stats = llm.llm_engine.engine_core.engine_core.get_stats()
    # One encoder run per adapter (and one for the base): never shared across adapters.
    assert stats["num_encoder_runs"] == 3
    features = WhisperFeatureExtractor.from_pretrained(whisper_dir)(
        wave, sampling_rate=SR, return_tensors="pt"
    ).input_features.to(torch.float32)
    got = [o.outputs[0].token_ids for o in outs]
    for out, lora, tokens in zip(outs, per_prompt, got, strict=True):
        want = peft_greedy(
            WhisperForConditionalGeneration,
            whisper_dir,
            None if lora is None else lora.lora_path,
            NUM_TOKENS,
            input_features=features,
            decoder_input_ids=list(out.prompt_token_ids),
        )
        assert list(tokens) == want, lora
    assert got[0] != got[1] and got[0] != got[2] and got[1] != got[2]
    assert got[1] == got[3]


def test_transcribe_with_adapter_equals_the_merged_model(
    whisper_dir: str, whisper_adapters: list[str], tmp_path
) -> None:
    """`LLM.transcribe(lora_request=...)` (the long-form driver's windows) gives the text of
    the model with the adapter merged into its weights by PEFT (`merge_and_unload`)."""
    import shutil
    from pathlib import Path

    from peft import PeftModel
    from transformers import WhisperForConditionalGeneration

    merged_dir = tmp_path / "merged"
    base = WhisperForConditionalGeneration.from_pretrained(whisper_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, whisper_adapters[0]).merge_and_unload()
    merged.save_pretrained(str(merged_dir))
    for item in Path(whisper_dir).iterdir():
        if item.suffix != ".safetensors" and not (merged_dir / item.name).exists():
            shutil.copy(item, merged_dir / item.name)
    wave = np.random.default_rng(1).standard_normal(SR * 3).astype(np.float32) * 0.1
    options = dict(
        language="en",
        temperature=0.0,
        sampling_params=SamplingParams(max_tokens=8),
        use_tqdm=False,
    )
    lora = LoRARequest("a4", 1, whisper_adapters[0])
    kwargs = dict(multiprocess=False, block_size=16, num_kv_blocks=512)
    with LLM(whisper_dir, enable_lora=True, max_lora_rank=8, **kwargs) as llm:
        (with_adapter,) = llm.transcribe((wave, SR), lora_request=lora, **options)
        (plain,) = llm.transcribe((wave, SR), **options)
    with LLM(str(merged_dir), **kwargs) as llm:
        (want,) = llm.transcribe((wave, SR), **options)
    assert with_adapter.text == want.text
    assert with_adapter.text != plain.text
