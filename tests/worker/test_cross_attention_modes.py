"""cross_attention="absorbed" through the EngineCore: the same greedy tokens and logprobs (fp32,
1e-4) as per-layer cross K/V for BART, T5 (v1.1 and mT5, whose heads x d_kv differ from d_model)
and Whisper, also under preemption; every block comes back; requests with the same encoder input
share one encoder-states entry; the real whisper-base transcribes the shared clips to the
expected tokens; `auto` keeps per-layer K/V on CPU.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from test_cuda_graphs import emulated_backend  # noqa: F401 (the fixture)

from tests.utils import ASSETS, ONE_TORCH_THREAD
from tests.worker.worker_factories import (
    bart_inputs,
    decoder_request,
    make_core,
    make_tiny_bart_dir,
    runner_of,
)
from v1.core.engine_core import EngineCore
from v1.core.protocol import EngineCoreRequest
from v1.kv_cache import CrossAttentionSpec, EncoderStatesSpec
from v1.sampling_params import SamplingParams

pytestmark = ONE_TORCH_THREAD

WHISPER_BASE = ASSETS / "whisper-base"
AUDIO = ASSETS / "audio"
CLIPS = ["jfk.flac", "librispeech/test_audio_0.flac", "librispeech/test_audio_1.flac"]
LOGPROB_ATOL = 1e-4


def run(core: EngineCore, requests: list[EngineCoreRequest]) -> dict[str, dict[str, list]]:
    """Request id -> generated tokens and their top logprobs; checks nothing failed and every
    KV block came back."""
    results = {r.request_id: {"tokens": [], "logprobs": []} for r in requests}
    for request in requests:
        core.add_request(request)
    for _ in range(10_000):
        if not core.has_work():
            break
        for out in core.step().outputs:
            assert out.error is None, out.error
            results[out.request_id]["tokens"] += out.new_token_ids
            results[out.request_id]["logprobs"] += out.new_logprobs or []
    assert not core.has_work()
    stats = core.get_stats()
    assert stats["num_kv_requests"] == 0 and stats["num_used_blocks"] == 0
    return results


def assert_same_outputs(per_layer: dict[str, Any], absorbed: dict[str, Any]) -> None:
    assert per_layer.keys() == absorbed.keys()
    for req_id, ours in absorbed.items():
        theirs = per_layer[req_id]
        assert ours["tokens"] == theirs["tokens"], req_id
        assert len(ours["logprobs"]) == len(theirs["logprobs"]) == len(ours["tokens"])
        for a, b in zip(ours["logprobs"], theirs["logprobs"], strict=True):
            assert a == pytest.approx(b, abs=LOGPROB_ATOL), req_id


def compare_modes(
    path: str, make_requests: Any, core_factory: Any = make_core, **overrides: Any
) -> tuple[dict[str, Any], dict[str, EngineCore]]:
    """Runs fresh requests through a per-layer and an absorbed core; returns the absorbed
    outputs and both cores after checking they agree."""
    outputs, cores = {}, {}
    for mode in ("per_layer", "absorbed"):
        core = core_factory(path, cross_attention=mode, **overrides)
        groups = [type(g.spec) for g in core.kv_cache_config.groups]
        assert (EncoderStatesSpec in groups) == (mode == "absorbed")
        assert (CrossAttentionSpec in groups) == (mode == "per_layer")
        outputs[mode], cores[mode] = run(core, make_requests()), core
    assert_same_outputs(outputs["per_layer"], outputs["absorbed"])
    return outputs["absorbed"], cores


# ---- BART ----

SMALL_BART = dict(max_model_len=32, max_encoder_input_len=40)
"""Limits that let one maximal request fit the tests' small caches (the engine checks at
start-up); every request here stays under them."""


@pytest.fixture(scope="module")
def bart_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_bart_dir(tmp_path_factory.mktemp("bart"))


def bart_requests() -> list[EngineCoreRequest]:
    inputs = bart_inputs(8)
    inputs[5] = (inputs[1][0], inputs[5][1])  # the same encoder input as request 1
    requests = [decoder_request(i, dec, enc) for i, (enc, dec) in enumerate(inputs)]
    for request in requests:
        request.sampling_params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2)
    return requests


def test_bart_absorbed_matches_per_layer_under_preemption(bart_dir: str) -> None:
    # Blocks of 4 tokens, room for a few requests at once: growing decodes preempt others.
    absorbed, cores = compare_modes(
        bart_dir, bart_requests, block_size=4, num_kv_blocks=24, max_num_seqs=16, **SMALL_BART
    )
    assert all(core.get_stats()["num_preemptions"] > 0 for core in cores.values())
    assert len({tuple(r["tokens"]) for r in absorbed.values()}) > 1, "outputs ignore the input"


def test_a_requests_states_fill_every_pool_tensor_of_their_blocks(bart_dir: str) -> None:
    """The tiny BART has 2 decoder layers: a states block spans both layers' pool tensors,
    twice the positions of one page, so a request's encoder output takes half the block ids
    it would take in the first tensor alone."""
    core = make_core(bart_dir, cross_attention="absorbed", num_kv_blocks=64, block_size=4)
    groups = [g.spec for g in core.kv_cache_config.groups]
    index = next(i for i, spec in enumerate(groups) if isinstance(spec, EncoderStatesSpec))
    states = groups[index]
    assert states.span == len(runner_of(core).model.model.decoder.layers) == 2
    page_rows = states.block_size // states.span
    encoder_ids = list(range(5, 5 + 3 * page_rows + 1))  # 3 pages and one position
    request = decoder_request(0, bart_inputs(1)[0][1], encoder_ids)
    request.sampling_params = SamplingParams(temperature=0.0, max_tokens=2)
    core.add_request(request)
    core.step()
    held = core.scheduler.kv_cache_manager.get_block_ids("r0")[index]
    assert len(held) == -(-len(encoder_ids) // states.block_size) == 2  # not 4 one-page blocks
    while core.has_work():
        core.step()
    assert core.get_stats()["num_used_blocks"] == 0


def test_same_encoder_input_shares_one_states_entry(bart_dir: str) -> None:
    core = make_core(bart_dir, cross_attention="absorbed", num_kv_blocks=64)
    inputs = bart_inputs(3)
    requests = [
        decoder_request(0, inputs[0][1], inputs[0][0]),
        decoder_request(1, inputs[1][1], inputs[0][0]),  # same encoder ids, other prompt
        decoder_request(2, inputs[2][1], inputs[2][0]),
    ]
    for request in requests:
        core.add_request(request)
    core.step()
    manager = core.scheduler.kv_cache_manager
    states = [manager.get_block_ids(r.request_id)[1] for r in requests]
    assert states[0] == states[1] and states[0] and not set(states[0]) & set(states[2])
    # Each stored once: the pool holds 2 entries' blocks, not 3.
    entry_blocks = {b for ids in states for b in ids}
    assert len(entry_blocks) == len(states[0]) + len(states[2])
    assert core.get_stats()["num_encoder_runs"] == 2
    while core.has_work():
        core.step()
    assert core.get_stats()["num_used_blocks"] == 0


# ---- T5 ----


@pytest.fixture(scope="module")
def t5_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The T5 tests' v1.1 and mT5 checkpoints at the default initializer scale (theirs is 5x:
    logits in the thousands, where float32 rounding alone moves logprobs by 1e-3)."""
    from tests.models.test_t5 import VARIANTS, write_checkpoint

    out = {}
    for name in ("flan-t5-v1.1", "mt5"):
        variant = VARIANTS[name]
        variant = replace(variant, overrides={**variant.overrides, "initializer_factor": 1.0})
        path = tmp_path_factory.mktemp(name)
        write_checkpoint(path, variant)
        out[name] = str(path)
    return out


@pytest.mark.parametrize("variant", ["flan-t5-v1.1", "mt5"])
def test_t5_absorbed_matches_per_layer_under_preemption(
    t5_dirs: dict[str, str], variant: str
) -> None:
    from tests.models.test_t5 import ENCODER_INPUTS
    from tests.models.test_t5 import make_core as make_t5_core

    def requests() -> list[EngineCoreRequest]:
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
        out = [decoder_request(i, [0], ids) for i, ids in enumerate(ENCODER_INPUTS)]
        for request in out:  # (the last input repeats the first)
            request.sampling_params = params
        return out

    # 16 blocks of 4 tokens: growing decodes preempt others in both modes.
    absorbed, cores = compare_modes(
        t5_dirs[variant],
        requests,
        make_t5_core,
        num_kv_blocks=16,
        max_model_len=20,
        max_encoder_input_len=40,
    )
    assert all(core.get_stats()["num_preemptions"] > 0 for core in cores.values())
    assert len({tuple(r["tokens"]) for r in absorbed.values()}) > 1, "outputs ignore the input"


# ---- Whisper ----


def whisper_requests(core: EngineCore, waves: list[Any]) -> list[EngineCoreRequest]:
    from tests.models.test_whisper import make_builder

    builder = make_builder(core)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)
    return [
        builder.build(
            f"w{i}", {"multi_modal_data": {"audio": (w, 16_000)}, "language": "en"}, params
        )
        for i, w in enumerate(waves)
    ]


@pytest.mark.skipif(not WHISPER_BASE.is_dir(), reason="needs the whisper-base tokenizer files")
def test_tiny_whisper_absorbed_matches_per_layer(tmp_path: Path) -> None:
    from tests.models.test_whisper import make_core as make_whisper_core
    from tests.models.test_whisper import make_tiny_whisper_dir, make_waves

    path = make_tiny_whisper_dir(tmp_path / "whisper")
    waves = make_waves(3, seed=5)
    waves.append(waves[0].copy())  # the same audio twice
    probe = make_whisper_core(path, num_kv_blocks=256)
    absorbed, cores = compare_modes(
        path, lambda: whisper_requests(probe, waves), make_whisper_core, num_kv_blocks=256
    )
    assert absorbed["w0"]["tokens"] == absorbed["w3"]["tokens"]
    runner = runner_of(cores["absorbed"])
    assert runner.cross_attention == "absorbed" and runner.encoder_states is not None


@pytest.mark.slow
@pytest.mark.skipif(
    not (WHISPER_BASE / "model.safetensors").is_file() or not AUDIO.is_dir(),
    reason="needs whisper-base's weights and the clips",
)
def test_real_whisper_base_absorbed_gives_the_expected_tokens() -> None:
    """The shared clips (and one of them twice: one encoder run, one states entry) give the
    tokens transformers gives (per-layer cross K/V matches them in test_transcription.py)."""
    from v1 import LLM
    from v1.audio import load_audio

    expected = json.loads((AUDIO / "expected_whisper_base.json").read_text())
    llm = LLM(
        str(WHISPER_BASE),
        device="cpu",
        multiprocess=False,
        cross_attention="absorbed",
        max_num_encoder_input_tokens=4 * 1500,
        encoder_cache_size=8 * 1500,
    )
    names = [*CLIPS, CLIPS[0]]
    prompts = [
        {
            "prompt": "",
            "multi_modal_data": {"audio": (load_audio(AUDIO / n), 16_000)},
            "language": "en",
        }
        for n in names
    ]
    outputs = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=None), use_tqdm=False
    )
    for name, out in zip(names, outputs, strict=True):
        assert out.outputs[0].token_ids == expected[name]["token_ids"] + [50257], name
        assert out.outputs[0].text == expected[name]["text"]
    stats = llm.llm_engine.get_stats()
    assert stats["num_encoder_runs"] == len(CLIPS)
    assert stats["num_kv_requests"] == 0 and stats["num_used_blocks"] == 0


def test_auto_keeps_per_layer_on_cpu(bart_dir: str) -> None:
    core = make_core(bart_dir, cross_attention="auto", num_kv_blocks=12, **SMALL_BART)
    assert runner_of(core).cross_attention == "per_layer"
    assert CrossAttentionSpec in [type(g.spec) for g in core.kv_cache_config.groups]


def test_absorbed_needs_an_encoder_decoder_model(tiny_llama_dir: str) -> None:
    from v1.config import make_engine_config

    with pytest.raises(ValueError, match="needs an encoder-decoder model"):
        make_engine_config(tiny_llama_dir, cross_attention="absorbed")
    with pytest.raises(ValueError, match="cross_attention must be one of"):
        make_engine_config(tiny_llama_dir, cross_attention="fused")


def test_auto_rule_picks_absorbed_on_a_gpu_and_per_layer_on_cpu(
    bart_dir: str, tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rule itself, resolved by the config before any model exists (CPU-testable;
    measurements in docs/decisions.md): absorbed on a GPU for a model with cross-attention
    unless the KV cache is fp8 and only the Triton kernel takes fp8 states, per_layer on CPU;
    an explicit mode is kept as given."""
    import v1.config.engine
    from v1.config import make_engine_config

    def mode(path: str, device: str, **kwargs: Any) -> str:
        return make_engine_config(path, device=device, **kwargs).cross_attention_mode

    assert mode(bart_dir, "cuda") == "absorbed"
    assert mode(bart_dir, "cpu") == "per_layer"
    assert mode(tiny_llama_dir, "cuda") == "per_layer"
    fast_fp8 = [False]
    monkeypatch.setattr(v1.config.engine, "_cuda_kernel_takes_fp8_states", lambda _: fast_fp8[0])
    assert mode(bart_dir, "cuda", kv_cache_dtype="fp8") == "per_layer"  # Triton's fp8 states
    fast_fp8[0] = True
    assert mode(bart_dir, "cuda", kv_cache_dtype="fp8") == "absorbed"
    assert mode(bart_dir, "cuda", cross_attention="per_layer") == "per_layer"
    assert mode(bart_dir, "cpu", cross_attention="absorbed") == "absorbed"


# ---- CUDA graphs (replays emulated on CPU, tests/worker/graph_emulation.py) ----


@pytest.mark.usefixtures("emulated_backend")
def test_absorbed_bart_replays_give_the_eager_tokens(bart_dir: str) -> None:
    """The encoder-states group rides the graph buffers like a cross group: its block table
    (its own block size) and encoder lengths are copied per replay."""
    from test_cuda_graphs import run_emulated

    requests = [decoder_request(i, dec, enc) for i, (enc, dec) in enumerate(bart_inputs(9))]
    args = dict(num_kv_blocks=9, max_num_seqs=4, max_num_batched_tokens=12, **SMALL_BART)
    per_layer, _ = run_emulated(bart_dir, requests, graphs=False, **args)
    eager, _ = run_emulated(bart_dir, requests, graphs=False, cross_attention="absorbed", **args)
    replayed, graphs = run_emulated(
        bart_dir, requests, graphs=True, cross_attention="absorbed", **args
    )
    assert replayed == eager == per_layer
    assert graphs.num_eager_steps == 0 and graphs.num_mixed_replays > 0


def test_memory_profile_allocates_the_absorbed_activations(
    bart_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU memory profile runs the model with attention skipped; absorbed layers still
    build their [T, H, d_model] query and context, the mode's largest activations."""
    import v1.attention.cross_attention as cross

    shapes: list[tuple[int, ...]] = []
    real = cross.absorb_query

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = real(*args, **kwargs)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(cross, "absorb_query", recording)
    core = make_core(bart_dir, cross_attention="absorbed", num_kv_blocks=12)
    with torch.inference_mode():
        runner_of(core).state.dummy_run(24)
    assert shapes == [(24, 4, 64)] * 2  # two decoder layers: 24 tokens x 4 heads x d_model
