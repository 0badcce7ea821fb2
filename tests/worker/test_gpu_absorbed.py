"""GPU end to end for absorbed cross-attention and fp8: the Triton kernel over the paged encoder
states (eager and under CUDA graphs), fp8 caches through the Triton write and attention kernels,
and fp8 weights through torch._scaled_mm.

Marked `gpu`; skipped without CUDA. Exactness runs in fp32 with IEEE dots, so greedy ties cannot
flip; fp8 runs compare against the real whisper-base's expected tokens.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.utils import ASSETS
from tests.worker.worker_factories import bart_inputs, make_tiny_bart_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
WHISPER_BASE = ASSETS / "whisper-base"
AUDIO = ASSETS / "audio"
CLIPS = ["jfk.flac", "librispeech/test_audio_0.flac", "librispeech/test_audio_1.flac"]


def bart_outputs(path: str, **kwargs) -> tuple[list[list[int]], list[list[float]], dict]:
    from v1 import LLM, SamplingParams

    llm = LLM(path, device="cuda", multiprocess=False, **kwargs)
    try:
        prompts = [
            {
                "encoder_prompt": {"prompt_token_ids": enc},
                "decoder_prompt": {"prompt_token_ids": dec},
            }
            for enc, dec in bart_inputs(12)
        ]
        outs = llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=16, logprobs=0), use_tqdm=False
        )
        stats = llm.llm_engine.get_stats()
        assert stats["num_kv_requests"] == 0 and stats["num_used_blocks"] == 0
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        logprobs = [
            [
                lp[t].logprob
                for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)
            ]
            for o in outs
        ]
        runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
        info = {"backend": runner.backend_name, "cross_attention": runner.cross_attention}
        if runner.cuda_graphs is not None:
            info["graph_replays"] = runner.cuda_graphs.num_replays
        return tokens, logprobs, info
    finally:
        llm.shutdown()


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda_graphs"])
def test_absorbed_kernel_matches_per_layer_on_gpu(tmp_path, enforce_eager):
    path = make_tiny_bart_dir(tmp_path)
    args = dict(dtype="float32", enforce_eager=enforce_eager, num_kv_blocks=64, max_num_seqs=6)
    per_layer = bart_outputs(path, cross_attention="per_layer", **args)
    absorbed = bart_outputs(path, cross_attention="absorbed", **args)
    assert absorbed[2]["backend"] == "triton" and absorbed[2]["cross_attention"] == "absorbed"
    if not enforce_eager:
        assert absorbed[2]["graph_replays"] > 0
    assert absorbed[0] == per_layer[0]
    for ours, theirs in zip(absorbed[1], per_layer[1], strict=True):
        assert ours == pytest.approx(theirs, abs=1e-4)


def test_auto_picks_absorbed_on_a_gpu_unless_the_kv_cache_is_fp8_in_fp32(tmp_path):
    """fp8 KV cache: absorbed where the CUDA kernel takes fp8 states (a 16-bit model, sm_89+),
    per_layer for an fp32 model (only the slower Triton kernel takes those)."""
    path = make_tiny_bart_dir(tmp_path)
    _, _, info = bart_outputs(path, num_kv_blocks=2000, max_num_seqs=8, cross_attention="auto")
    assert info["cross_attention"] == "absorbed"
    fp8 = dict(num_kv_blocks=2000, max_num_seqs=8, cross_attention="auto", kv_cache_dtype="fp8")
    _, _, info = bart_outputs(path, dtype="float32", **fp8)
    assert info["cross_attention"] == "per_layer"
    _, _, info = bart_outputs(path, dtype="float16", **fp8)
    sm89 = torch.cuda.get_device_capability() >= (8, 9)
    assert info["cross_attention"] == ("absorbed" if sm89 else "per_layer")


def whisper_tokens(**kwargs) -> list[list[int]]:
    from v1 import LLM, SamplingParams
    from v1.audio import load_audio

    llm = LLM(str(WHISPER_BASE), device="cuda", multiprocess=False, **kwargs)
    try:
        prompts = [
            {
                "prompt": "",
                "multi_modal_data": {"audio": (load_audio(AUDIO / n), 16_000)},
                "language": "en",
            }
            for n in CLIPS
        ]
        outs = llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=None), use_tqdm=False
        )
        assert llm.llm_engine.get_stats()["num_used_blocks"] == 0
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


@pytest.mark.skipif(
    not (WHISPER_BASE / "model.safetensors").is_file() or not AUDIO.is_dir(),
    reason="needs whisper-base's weights and the clips",
)
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(dtype="float32", cross_attention="absorbed"),
        dict(dtype="float32", cross_attention="absorbed", kv_cache_dtype="fp8"),
        dict(dtype="float32", cross_attention="per_layer", kv_cache_dtype="fp8"),
        dict(dtype="bfloat16", cross_attention="absorbed", kv_cache_dtype="fp8"),
    ],
    ids=["absorbed-fp32", "absorbed-fp8kv", "per_layer-fp8kv", "absorbed-bf16-fp8kv"],
)
def test_real_whisper_base_on_gpu(kwargs):
    expected = json.loads((AUDIO / "expected_whisper_base.json").read_text())
    got = whisper_tokens(**kwargs)
    want = [expected[n]["token_ids"] + [50257] for n in CLIPS]
    if kwargs["dtype"] == "float32":
        assert got == want
    else:  # bf16 compute and fp8 caches: at most one clip's transcript moves
        assert sum(g != w for g, w in zip(got, want, strict=True)) <= 1


@pytest.mark.skipif(
    not (WHISPER_BASE / "model.safetensors").is_file() or not AUDIO.is_dir(),
    reason="needs whisper-base's weights and the clips",
)
def test_real_whisper_base_fp8_weights_on_gpu():
    """torch._scaled_mm (sm89+) or the reference GEMM: the CPU test's bar (one word at most)."""
    expected = json.loads((AUDIO / "expected_whisper_base.json").read_text())
    got = whisper_tokens(dtype="bfloat16", quantization="fp8", cross_attention="absorbed")
    want = [expected[n]["token_ids"] + [50257] for n in CLIPS]
    assert sum(g != w for g, w in zip(got, want, strict=True)) <= 1
