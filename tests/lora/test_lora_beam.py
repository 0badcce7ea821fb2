"""LoRA with beam search: every beam of a request runs with the request's adapter. LLM.beam_search
with a mix of adapters and the base model equals PEFT's generate(num_beams=N) with each adapter
(fp32 CPU, sequences and scores) for Llama, BART and T5; Whisper's transcribe(beam_size=N) with
an adapter equals the transcription of the model PEFT merged the adapter into."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.lora.conftest import LLAMA_TARGETS, make_adapter
from tests.utils import ONE_TORCH_THREAD, make_tiny_llama_dir
from v1 import LLM, BeamSearchParams, LoRARequest, SamplingParams

pytestmark = ONE_TORCH_THREAD

MAX_TOKENS = 8
ENGINE = dict(multiprocess=False, num_kv_blocks=256, block_size=4, max_model_len=64)
LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8)


@torch.inference_mode()
def peft_beams(
    model_cls: Any, base: str, adapter: str | None, input_ids: list[int], **kwargs: Any
) -> tuple[list[list[int]], list[float]]:
    """PEFT's generate(num_beams=...) with `adapter` (None: the base model): the generated
    tokens of each returned beam (padded as transformers pads them) and sequences_scores."""
    from peft import PeftModel

    model = model_cls.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    ids = torch.tensor([input_ids])
    out = model.generate(
        input_ids=ids,
        do_sample=False,
        max_new_tokens=MAX_TOKENS,
        return_dict_in_generate=True,
        output_scores=True,
        **kwargs,
    )
    start = 1 if model.config.is_encoder_decoder else ids.shape[1]
    return [row[start:] for row in out.sequences.tolist()], out.sequences_scores.tolist()


def _padded(sequences: list[list[int]], like: list[list[int]], config: Any) -> list[list[int]]:
    """Our beams padded as transformers pads its rows (pad_token_id, else the first EOS)."""
    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    fill = config.pad_token_id or eos
    width = max(len(row) for row in like)
    return [s + [fill] * (width - len(s)) for s in sequences]


def _check_against_peft(
    model_cls: Any, base: str, prompts: list[Any], loras: list[LoRARequest | None], ids: Any
) -> None:
    from transformers import GenerationConfig

    params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, num_return_sequences=2)
    with LLM(base, **ENGINE, **LORA) as llm:
        outputs = llm.beam_search(prompts, params, lora_request=loras)
    generation = GenerationConfig.from_pretrained(base)
    results = []
    for prompt_ids, lora, output in zip(ids, loras, outputs, strict=True):
        path = None if lora is None else lora.lora_path
        want, scores = peft_beams(
            model_cls, base, path, prompt_ids, num_beams=3, num_return_sequences=2
        )
        got = _padded([s.token_ids for s in output.sequences], want, generation)
        assert got == want, lora
        assert [s.score for s in output.sequences] == pytest.approx(scores, abs=2e-4), lora
        results.append(got)
    assert results[0] != results[2]  # the same prompt under an adapter and the base differ


@pytest.fixture(scope="module")
def beam_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[str]]:
    """A Llama with spread-out logits (no near-ties between beams) and two adapters."""
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("beam_llama")
    path = make_tiny_llama_dir(root / "model", initializer_range=0.2)
    first = make_adapter(
        LlamaForCausalLM.from_pretrained(path), root / "a4", LLAMA_TARGETS, 4, seed=21
    )
    second = make_adapter(
        LlamaForCausalLM.from_pretrained(path),
        root / "b8",
        ["q_proj", "v_proj", "down_proj"],
        8,
        seed=22,
    )
    return path, [first, second]


def test_llama_beam_search_with_adapters_matches_peft(beam_llama: tuple[str, list[str]]) -> None:
    from transformers import LlamaForCausalLM

    path, adapters = beam_llama
    loras = [LoRARequest("a4", 1, adapters[0]), LoRARequest("b8", 2, adapters[1]), None]
    ids = [[1, 5, 9, 13, 17], [1, 40, 41, 42], [1, 5, 9, 13, 17]]
    prompts = [{"prompt_token_ids": p} for p in ids]
    _check_against_peft(LlamaForCausalLM, path, prompts, loras, ids)


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_encoder_decoder_beam_search_with_adapters_matches_peft(
    family: str, request: pytest.FixtureRequest
) -> None:
    """Every beam reads the one encoder run of its adapter (the base's is another)."""
    from transformers import AutoTokenizer, BartForConditionalGeneration, T5ForConditionalGeneration

    base = request.getfixturevalue(f"{family}_dir")
    adapters = request.getfixturevalue(f"{family}_adapters")
    model_cls = BartForConditionalGeneration if family == "bart" else T5ForConditionalGeneration
    tokenizer = AutoTokenizer.from_pretrained(base)
    texts = ["hello world", "the quick fox", "hello world"]
    loras = [LoRARequest("a4", 1, adapters[0]), LoRARequest("b8", 2, adapters[1]), None]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    _check_against_peft(model_cls, base, texts, loras, ids)


def test_whisper_transcribe_beam_size_with_adapter_equals_merged_model(
    whisper_dir: str, whisper_adapters: list[str], tmp_path: Path
) -> None:
    """transcribe(beam_size=3, lora_request=...): each beam of each window runs the adapter;
    the text equals the same beam search on the model PEFT merged the adapter into."""
    from peft import PeftModel
    from transformers import WhisperForConditionalGeneration

    merged_dir = tmp_path / "merged"
    model = WhisperForConditionalGeneration.from_pretrained(whisper_dir, dtype=torch.float32)
    PeftModel.from_pretrained(model, whisper_adapters[0]).merge_and_unload().save_pretrained(
        str(merged_dir)
    )
    for item in Path(whisper_dir).iterdir():
        if item.suffix != ".safetensors" and not (merged_dir / item.name).exists():
            shutil.copy(item, merged_dir / item.name)
    wave = np.random.default_rng(2).standard_normal(16_000 * 3).astype(np.float32) * 0.1
    options = dict(
        language="en",
        beam_size=3,
        sampling_params=SamplingParams(max_tokens=8),
        use_tqdm=False,
    )
    lora = LoRARequest("a4", 1, whisper_adapters[0])
    kwargs = dict(multiprocess=False, block_size=16, num_kv_blocks=512)
    with LLM(whisper_dir, enable_lora=True, max_lora_rank=8, **kwargs) as llm:
        (with_adapter,) = llm.transcribe((wave, 16_000), lora_request=lora, **options)
        (plain,) = llm.transcribe((wave, 16_000), **options)
    with LLM(str(merged_dir), **kwargs) as llm:
        (want,) = llm.transcribe((wave, 16_000), **options)
    assert with_adapter.text == want.text
    assert with_adapter.text != plain.text
