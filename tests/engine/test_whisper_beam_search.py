"""Whisper beam search: the real whisper-base with beam_size=5 on the shared clips gives the
tokens of transformers' generate(num_beams=5); best_of sampling keeps the most likely sample."""

from __future__ import annotations

import pytest
import torch

from tests.utils import ASSETS, ONE_TORCH_THREAD, WHISPER_BASE, needs_assets
from v1 import LLM, SamplingParams
from v1.audio import load_audio

AUDIO = ASSETS / "audio"
CLIPS = ["librispeech/test_audio_0.flac", "librispeech/test_audio_1.flac"]
"""Two short clips (4.7 s each): a batch of beam requests; JFK's 11 s only made it slower."""
SR = 16_000
pytestmark = [needs_assets(WHISPER_BASE, AUDIO), ONE_TORCH_THREAD]


def hf_beam_tokens(waves: list) -> list[list[int]]:
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    processor = WhisperProcessor.from_pretrained(str(WHISPER_BASE))
    model = WhisperForConditionalGeneration.from_pretrained(
        str(WHISPER_BASE), torch_dtype=torch.float32
    ).eval()
    out = []
    for wave in waves:
        features = processor(wave, sampling_rate=SR, return_tensors="pt").input_features
        with torch.no_grad():
            ids = model.generate(features, num_beams=5, language="en", task="transcribe")
        # Text tokens only (the forced prompt and EOS are special tokens, ids >= EOS).
        out.append([t for t in ids[0].tolist() if t < processor.tokenizer.eos_token_id])
    return out


@pytest.mark.slow
def test_beam_size_5_matches_transformers_num_beams_5() -> None:
    waves = [load_audio(AUDIO / name) for name in CLIPS]
    expected = hf_beam_tokens(waves)
    with LLM(str(WHISPER_BASE), device="cpu", multiprocess=False, dtype="float32") as llm:
        results = llm.transcribe(
            [(w, SR) for w in waves], language="en", beam_size=5, temperature=0.0
        )
        stats = llm.llm_engine.get_stats()
        # One encoder run per clip: every beam of every step read one cross cache.
        assert stats["num_encoder_runs"] == len(CLIPS)
        assert stats["num_kv_requests"] == 0 and stats["num_used_blocks"] == 0
        for result, want in zip(results, expected, strict=True):
            (segment,) = result.segments
            assert segment.tokens == want
            assert -1.0 < segment.avg_logprob < 0.0

        # best_of at a temperature above 0: five seeded samples, the most likely one kept
        # (openai-whisper's ranking: sum of logprobs / length).
        params = SamplingParams(temperature=0.6, seed=7, max_tokens=40)
        (hot,) = llm.transcribe(
            (waves[1], SR), sampling_params=params, language="en", best_of=5, temperature=0.6
        )
        tokenizer = llm.get_tokenizer()
        forced = ["<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"]
        prompt = {
            "prompt_token_ids": tokenizer.convert_tokens_to_ids(forced),
            "multi_modal_data": {"audio": (waves[1], SR)},
        }
        (samples,) = llm.generate(prompt, params.clone(n=5, logprobs=0), use_tqdm=False)

        def rank(c) -> float:
            lps = [entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs, strict=True)]
            return sum(lps) / len(lps)

        assert len({tuple(c.token_ids) for c in samples.outputs}) > 1  # they differ
        best = max(samples.outputs, key=rank)
        eos = tokenizer.eos_token_id
        assert hot.segments[0].tokens == [t for t in best.token_ids if t < eos]
