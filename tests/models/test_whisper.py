"""Whisper model and runner state: the real checkpoint loads strictly; tiny random Whisper models
(multilingual and English-only layouts) run through the EngineCore and must match transformers'
greedy tokens and raw logprobs, also under preemption; no-speech probabilities and encoder runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.utils import (
    ONE_TORCH_THREAD,
    WHISPER_BASE,
    WHISPER_WINDOW,
    make_tiny_whisper_dir,
    needs_assets,
)
from v1.config import make_engine_config
from v1.core.engine_core import EngineCore
from v1.core.protocol import EngineCoreRequest
from v1.engine.inputs.whisper import WhisperInputBuilder
from v1.executor.uniproc import UniProcExecutor
from v1.sampling_params import SamplingParams
from v1.tokenizer import get_tokenizer

pytestmark = [needs_assets(WHISPER_BASE), ONE_TORCH_THREAD]
WINDOW = WHISPER_WINDOW
"""Encoder positions of one window."""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_whisper_dir(tmp_path_factory.mktemp("tiny_whisper"))


@pytest.fixture(scope="module")
def tiny_en_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_whisper_dir(tmp_path_factory.mktemp("tiny_whisper_en"), layout="english_only")


@pytest.fixture(scope="module")
def tiny_v3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_whisper_dir(tmp_path_factory.mktemp("tiny_whisper_v3"), layout="large_v3")


def make_core(path: str, **overrides: Any) -> EngineCore:
    args = dict(
        device="cpu",
        num_kv_blocks=2048,
        max_num_encoder_input_tokens=4 * WINDOW,
        encoder_cache_size=8 * WINDOW,
    )
    return EngineCore(make_engine_config(path, **{**args, **overrides}), UniProcExecutor)


def make_builder(core: EngineCore) -> WhisperInputBuilder:
    model_config = core.config.model_config
    return WhisperInputBuilder(model_config, get_tokenizer(model_config))


def make_waves(n: int, seed: int = 0) -> list[np.ndarray]:
    """Distinct noisy waveforms of different lengths (0.5 s to 20 s)."""
    rng = np.random.default_rng(seed)
    lengths = rng.uniform(0.5, 20.0, size=n)
    return [(0.1 * rng.standard_normal(int(16_000 * s))).astype(np.float32) for s in lengths]


def run_all(core: EngineCore, requests: list[EngineCoreRequest]) -> dict[str, dict[str, Any]]:
    """Runs the requests to completion: req_id -> tokens, logprobs, extras, error."""
    results: dict[str, dict[str, Any]] = {
        r.request_id: {"tokens": [], "logprobs": [], "extras": {}, "error": None} for r in requests
    }
    for request in requests:
        core.add_request(request)
    while core.has_work():
        for out in core.step().outputs:
            res = results[out.request_id]
            res["tokens"] += out.new_token_ids
            res["logprobs"] += out.new_logprobs or []
            res["extras"].update(out.extras or {})
            res["error"] = res["error"] or out.error
    stats = core.get_stats()
    assert stats["num_kv_requests"] == 0 and stats["num_used_blocks"] == 0
    return results


def hf_generate(
    path: str, waves: list[np.ndarray], prompt: list[int], max_new_tokens: int, timestamps: bool
) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy tokens (after the prompt, up to EOS) and raw logprobs [steps, vocab]
    per waveform: one batched pass of GenerationMixin.generate with Whisper's logits processors
    (begin-suppress, suppress, timestamp rules when `timestamps`), as Whisper's generate() sets
    them up. Whisper's own generate() re-decodes a window after a closed timestamp segment,
    which random weights produce even under <|notimestamps|>."""
    from transformers import LogitsProcessorList, WhisperFeatureExtractor
    from transformers import WhisperForConditionalGeneration as HFWhisper
    from transformers.generation.logits_process import (
        SuppressTokensAtBeginLogitsProcessor,
        SuppressTokensLogitsProcessor,
        WhisperTimeStampLogitsProcessor,
    )
    from transformers.models.whisper.generation_whisper import WhisperGenerationMixin

    model = HFWhisper.from_pretrained(path, dtype=torch.float32).eval()
    gc = model.generation_config
    processors = [
        SuppressTokensAtBeginLogitsProcessor(gc.begin_suppress_tokens, len(prompt)),
        SuppressTokensLogitsProcessor(gc.suppress_tokens),
    ]
    if timestamps:
        processors.append(WhisperTimeStampLogitsProcessor(gc, begin_index=len(prompt)))
    features = WhisperFeatureExtractor.from_pretrained(path)(
        waves, sampling_rate=16_000, return_tensors="pt"
    ).input_features
    with torch.inference_mode():
        out = super(WhisperGenerationMixin, model).generate(
            input_features=features,
            decoder_input_ids=torch.tensor([prompt] * len(waves)),
            logits_processor=LogitsProcessorList(processors),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            suppress_tokens=None,
            begin_suppress_tokens=None,
            return_dict_in_generate=True,
            output_logits=True,
        )
    raw = torch.stack(out.logits, dim=1).float().log_softmax(-1)  # [B, steps, vocab]
    results = []
    for i in range(len(waves)):
        tokens = until_eos(out.sequences[i, len(prompt) :].tolist(), gc.eos_token_id)
        results.append((tokens, raw[i, : len(tokens)]))
    return results


def until_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


# ---- the real checkpoint ----


def test_real_checkpoint_loads_every_parameter_and_reads_its_configs() -> None:
    from transformers import AutoConfig

    from v1.worker.model_loader import iterate_weights, load_model_from_weights

    hf_config = AutoConfig.from_pretrained(str(WHISPER_BASE))
    model = load_model_from_weights(
        hf_config, iterate_weights(str(WHISPER_BASE)), "cpu", torch.float32
    )
    loaded = model.load_weights(iterate_weights(str(WHISPER_BASE)))
    assert loaded == {name for name, _ in model.named_parameters()}
    assert model.proj_out.weight is model.model.decoder.embed_tokens.weight
    # The fused k rows of the q/k/v and k/v projections hold Whisper's absent k bias: zeros.
    d = hf_config.d_model
    assert not model.model.encoder.layers[0].self_attn.qkv_proj.bias[d : 2 * d].any()
    assert not model.model.decoder.layers[0].encoder_attn.kv_proj.bias[:d].any()
    # Its special tokens are read by ModelInfo (tests/test_model_info.py).
    assert model.mel.n_mels == 80


# ---- tiny models against transformers ----


@pytest.mark.parametrize("layout", ["multilingual", "english_only", "large_v3"])
def test_greedy_tokens_and_logprobs_match_transformers_under_preemption(
    layout: str, request: pytest.FixtureRequest
) -> None:
    fixture = {"multilingual": "tiny_dir", "english_only": "tiny_en_dir", "large_v3": "tiny_v3_dir"}
    path = request.getfixturevalue(fixture[layout])
    english_only = layout == "english_only"
    waves = make_waves(4, seed=1)
    max_tokens = 24
    # Room for two requests' cross blocks (94 each) and their prompts, not for their growth.
    core = make_core(path, num_kv_blocks=192, max_num_seqs=4)
    builder = make_builder(core)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=3)
    prompt = {"prompt": "", "language": None if english_only else "en"}
    requests = [
        builder.build(f"r{i}", {**prompt, "multi_modal_data": {"audio": (w, 16_000)}}, params)
        for i, w in enumerate(waves)
    ]
    expected_prompt = {
        "multilingual": [50258, 50259, 50359, 50363],
        "english_only": [50257, 50362],
        "large_v3": [50258, 50259, 50360, 50364],
    }[layout]
    assert requests[0].prompt_token_ids == expected_prompt
    results = run_all(core, requests)
    assert core.get_stats()["num_preemptions"] > 0

    hf = hf_generate(path, waves, expected_prompt, max_tokens, timestamps=False)
    for i, (theirs, raw) in enumerate(hf):
        ours = results[f"r{i}"]
        assert ours["error"] is None
        assert ours["tokens"] == theirs
        for step, (token, logprobs) in enumerate(zip(theirs, ours["logprobs"], strict=True)):
            assert logprobs[0] == pytest.approx(raw[step, token].item(), abs=1e-4)
    assert len({tuple(r["tokens"]) for r in results.values()}) > 1, "outputs ignore the audio"


@pytest.mark.parametrize("sampler", ["general", "fixed_shape"])
def test_timestamp_tokens_match_transformers(
    tiny_dir: str, sampler: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fixed-shape sampler (CUDA graphs on a GPU) runs eagerly on CPU when forced on.
    monkeypatch.setenv("V1_SAMPLER_GRAPHS", "1" if sampler == "fixed_shape" else "0")
    waves = make_waves(3, seed=2)
    core = make_core(tiny_dir)
    graphs = core.executor.worker.model_runner.state.sampler_graphs
    assert (graphs is not None) == (sampler == "fixed_shape")
    builder = make_builder(core)
    params = SamplingParams(temperature=0.0, max_tokens=20, whisper_timestamps=True)
    requests = [
        builder.build(f"t{i}", {"multi_modal_data": {"audio": (w, 16_000)}}, params)
        for i, w in enumerate(waves)
    ]
    prompt = [50258, 50259, 50359]  # no <|notimestamps|>
    assert requests[0].prompt_token_ids == prompt
    results = run_all(core, requests)
    for i, (theirs, _) in enumerate(hf_generate(tiny_dir, waves, prompt, 20, timestamps=True)):
        assert results[f"t{i}"]["tokens"] == theirs
        assert 50364 <= theirs[0] <= 50364 + 50, "the first output is an early timestamp"
    assert graphs is None or graphs.num_replays > 0


def test_no_speech_prob_is_the_nospeech_probability_at_startoftranscript(tiny_dir: str) -> None:
    """Also with a <|startofprev|> prompt (SOT not first) and a prompt split over prefill
    chunks (the probability is reported with the first sampled token)."""
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    (wave,) = make_waves(1, seed=3)
    core = make_core(tiny_dir, max_num_batched_tokens=4, enable_chunked_prefill=True)
    builder = make_builder(core)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    audio = {"audio": (wave, 16_000)}
    plain = builder.build("plain", {"multi_modal_data": audio, "language": "en"}, params)
    prompted = builder.build(
        "prompted", {"prompt": "the quick brown fox", "multi_modal_data": audio}, params
    )
    assert prompted.prompt_token_ids[0] == 50361 and len(prompted.prompt_token_ids) > 8
    results = run_all(core, [plain, prompted])

    model = WhisperForConditionalGeneration.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    features = WhisperFeatureExtractor.from_pretrained(tiny_dir)(
        [wave], sampling_rate=16_000, return_tensors="pt"
    ).input_features
    for request in (plain, prompted):
        ids = torch.tensor([request.prompt_token_ids])
        with torch.inference_mode():
            logits = model(input_features=features, decoder_input_ids=ids).logits[0]
        sot = request.prompt_token_ids.index(50258)
        expected = logits[sot].softmax(-1)[50362].item()
        assert results[request.request_id]["extras"]["no_speech_prob"] == pytest.approx(
            expected, rel=1e-4
        )


def test_encoder_runs_once_per_distinct_audio(tiny_dir: str) -> None:
    core = make_core(tiny_dir)
    builder = make_builder(core)
    waves = make_waves(2, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=5)
    audios = [waves[0], waves[0].copy(), waves[1]]
    requests = [
        builder.build(f"e{i}", {"multi_modal_data": {"audio": (w, 16_000)}}, params)
        for i, w in enumerate(audios)
    ]
    assert requests[0].encoder_input.content_hash == requests[1].encoder_input.content_hash
    results = run_all(core, requests)
    assert core.get_stats()["num_encoder_runs"] == 2
    assert results["e0"]["tokens"] == results["e1"]["tokens"]
    # The cached output serves a later request for the same audio without another run.
    run_all(
        core, [builder.build("again", {"multi_modal_data": {"audio": (audios[2], 16_000)}}, params)]
    )
    assert core.get_stats()["num_encoder_runs"] == 2
