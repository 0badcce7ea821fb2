"""kv_cache_dtype="fp8" through the engine: self-attention K/V, cross K/V and encoder states
live in float8_e4m3 with float32 scales beside them in the same pool blocks; the real
whisper-base still transcribes the shared clips to the expected tokens in both cross-attention
modes, and every block comes back.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.utils import ASSETS, ONE_TORCH_THREAD
from tests.worker.worker_factories import (
    bart_inputs,
    decoder_request,
    drain,
    make_core,
    make_tiny_bart_dir,
    runner_of,
)
from v1.attention.cross_attention import EncoderDecoderAttention
from v1.kv_cache.spec import FullAttentionSpec
from v1.quantization.fp8_rows import FP8_DTYPE

pytestmark = ONE_TORCH_THREAD

WHISPER_BASE = ASSETS / "whisper-base"
AUDIO = ASSETS / "audio"
CLIPS = ["jfk.flac", "librispeech/test_audio_0.flac", "librispeech/test_audio_1.flac"]


@pytest.fixture(scope="module")
def bart_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_bart_dir(tmp_path_factory.mktemp("bart"))


@pytest.mark.parametrize("cross_attention", ["per_layer", "absorbed"])
def test_fp8_pools_hold_values_and_scales(bart_dir: str, cross_attention: str) -> None:
    core = make_core(bart_dir, kv_cache_dtype="fp8", cross_attention=cross_attention, block_size=4)
    config = core.kv_cache_config
    full = config.groups[0].spec
    assert isinstance(full, FullAttentionSpec) and full.dtype == "float8_e4m3fn"
    # 4 tokens x 4 heads x (16 one-byte values + a 4-byte scale), for K and V.
    assert full.page_size_bytes == 2 * 4 * 4 * (16 + 4)
    runner = runner_of(core)
    for layer in runner.attn_layers.values():
        if layer.attn_type.has_kv_cache and not getattr(layer, "absorbed", False):
            assert layer.kv_cache.dtype == FP8_DTYPE
            assert layer.kv_scales.shape == layer.kv_cache.shape[:-1]
            assert layer.kv_scales.dtype == torch.float32
    if cross_attention == "absorbed":
        states = runner.encoder_states
        assert states.values.dtype == FP8_DTYPE and states.scales.shape == states.values.shape[:-1]
        cross = [m for m in runner.attn_layers.values() if isinstance(m, EncoderDecoderAttention)]
        assert all(m.encoder_states_scales is states.scales for m in cross)
    requests = [decoder_request(i, dec, enc) for i, (enc, dec) in enumerate(bart_inputs(6))]
    tokens = drain(core, requests)  # (drain checks every block came back)
    assert all(tokens.values())


@pytest.mark.slow
@pytest.mark.skipif(
    not (WHISPER_BASE / "model.safetensors").is_file() or not AUDIO.is_dir(),
    reason="needs whisper-base's weights and the clips",
)
@pytest.mark.parametrize("cross_attention", ["per_layer", "absorbed"])
def test_real_whisper_base_with_fp8_caches_gives_the_expected_tokens(
    cross_attention: str,
) -> None:
    from v1 import LLM, SamplingParams
    from v1.audio import load_audio

    expected = json.loads((AUDIO / "expected_whisper_base.json").read_text())
    with LLM(
        str(WHISPER_BASE),
        device="cpu",
        multiprocess=False,
        kv_cache_dtype="fp8",
        cross_attention=cross_attention,
        max_num_encoder_input_tokens=3 * 1500,
    ) as llm:
        prompts = [
            {
                "prompt": "",
                "multi_modal_data": {"audio": (load_audio(AUDIO / n), 16_000)},
                "language": "en",
            }
            for n in CLIPS
        ]
        params = SamplingParams(temperature=0.0, max_tokens=None)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for name, out in zip(CLIPS, outputs, strict=True):
            assert out.outputs[0].token_ids == expected[name]["token_ids"] + [50257], name
        stats = llm.llm_engine.get_stats()
        assert stats["num_kv_requests"] == 0 and stats["num_used_blocks"] == 0


def test_kv_cache_dtype_is_validated() -> None:
    from v1.config import CacheConfig

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="int8")
    assert CacheConfig(kv_cache_dtype="fp8_e4m3").fp8_kv_cache
