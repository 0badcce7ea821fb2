"""Whisper's input path on the host: 16 kHz float32 audio reaches the EngineCore without a copy
or a resampling pass, and each clip is hashed once (BLAKE3 of its buffer, read in place), through
the input processor, `LLM.generate` (n > 1 included) and `LLM.transcribe`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from blake3 import blake3
from msgspec.structs import replace

from tests.utils import WHISPER_BASE, count_clip_hashes, forbid_resampling, make_tiny_whisper_dir
from v1 import LLM
from v1.core.protocol import EngineCoreRequest
from v1.sampling_params import SamplingParams

SR = 16_000
pytestmark = pytest.mark.skipif(
    not WHISPER_BASE.is_dir(), reason=f"needs the real whisper-base folder at {WHISPER_BASE}"
)


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many small ops; the suite shares the cores
    llm = LLM(
        make_tiny_whisper_dir(tmp_path_factory.mktemp("tiny_whisper")),
        device="cpu",
        multiprocess=False,
        max_num_encoder_input_tokens=4 * 1500,
        encoder_cache_size=8 * 1500,
    )
    yield llm
    llm.shutdown()
    torch.set_num_threads(num_threads)


@pytest.fixture
def sha_calls(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    forbid_resampling(monkeypatch)
    return count_clip_hashes(monkeypatch)


@pytest.fixture
def core_requests(tiny_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[EngineCoreRequest]:
    """Every EngineCoreRequest the frontend hands to the (in-process) core."""
    client = tiny_llm.llm_engine.engine_core
    sent: list[EngineCoreRequest] = []
    add = client.add_request

    def recording_add(request: EngineCoreRequest) -> None:
        sent.append(request)
        add(request)

    monkeypatch.setattr(client, "add_request", recording_add)
    return sent


def waves(seconds: list[float], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(0.1 * rng.standard_normal(round(s * SR))).astype(np.float32) for s in seconds]


def reference_hash(samples: np.ndarray) -> str:
    return blake3(samples.tobytes()).hexdigest()


def encoder_runs(llm: LLM) -> int:
    return llm.llm_engine.get_stats()["num_encoder_runs"]


def test_input_processor_uses_16k_audio_in_place_and_hashes_it_once(
    tiny_llm: LLM, sha_calls: list[Any]
) -> None:
    processor = tiny_llm.llm_engine.input_processor
    clips = waves([30.0, 4.5, 0.5])
    params = SamplingParams(temperature=0.0, max_tokens=4)
    requests = [
        processor.process(f"r{i}", {"prompt": "", "multi_modal_data": {"audio": (c, SR)}}, params)
        for i, c in enumerate(clips)
    ]
    assert len(sha_calls) == len(clips)
    for request, clip, arg in zip(requests, clips, sha_calls, strict=True):
        enc = request.encoder_input
        assert np.shares_memory(enc.audio, clip) and enc.audio.shape == clip.shape
        assert enc.content_hash == reference_hash(clip)
        assert isinstance(arg, memoryview) and np.shares_memory(np.asarray(arg), clip)


def test_n_children_share_one_decode_and_one_hash(tiny_llm: LLM, sha_calls: list[Any]) -> None:
    processor = tiny_llm.llm_engine.input_processor
    (clip,) = waves([3.0], seed=1)
    prompt = {"prompt": "hi", "multi_modal_data": {"audio": (clip, SR)}, "language": "fr"}
    params = SamplingParams(temperature=1.0, max_tokens=4, n=4, seed=7)
    children = processor.process_all("p", prompt, params)
    assert len(sha_calls) == 1
    assert [c.request_id for c in children] == ["0_p", "1_p", "2_p", "3_p"]
    assert all(c.encoder_input is children[0].encoder_input for c in children)
    assert np.shares_memory(children[0].encoder_input.audio, clip)
    assert children[0].encoder_input.content_hash == reference_hash(clip)
    # Each child is what processing it on its own gives (seed + index, filled defaults).
    for i, child in enumerate(children):
        alone = processor.process(
            child.request_id, prompt, params.clone(n=1, seed=7 + i), arrival_time=child.arrival_time
        )
        assert alone.encoder_input.content_hash == child.encoder_input.content_hash
        assert child.group_id == "p"  # the children share their parent's fair share
        assert replace(alone, encoder_input=None, group_id="p") == replace(
            child, encoder_input=None
        )


def test_generate_sends_16k_audio_without_copies_one_hash_per_clip(
    tiny_llm: LLM, sha_calls: list[Any], core_requests: list[EngineCoreRequest]
) -> None:
    clips = waves([6.0, 2.0], seed=2)
    prompts = [{"prompt": "", "multi_modal_data": {"audio": (c, SR)}} for c in clips]
    before = encoder_runs(tiny_llm)
    outputs = tiny_llm.generate(
        prompts, SamplingParams(temperature=1.0, max_tokens=3, n=2, seed=0), use_tqdm=False
    )
    assert [len(o.outputs) for o in outputs] == [2, 2]
    assert len(sha_calls) == 2 and len(core_requests) == 4
    for k, request in enumerate(core_requests):
        clip = clips[k // 2]
        assert np.shares_memory(request.encoder_input.audio, clip)
        assert request.encoder_input.content_hash == reference_hash(clip)
    assert encoder_runs(tiny_llm) - before == 2


def test_transcribe_hashes_each_window_once_and_copies_nothing(
    tiny_llm: LLM, sha_calls: list[Any], core_requests: list[EngineCoreRequest]
) -> None:
    """45 s, language detected: a detection request and one request per window, one hash each."""
    (audio,) = waves([45.0], seed=3)
    before = encoder_runs(tiny_llm)
    (result,) = tiny_llm.transcribe(
        (audio, SR), sampling_params=SamplingParams(temperature=0.0, max_tokens=4), temperature=0.0
    )
    assert result.duration == 45.0
    detect, *windows = sorted(core_requests, key=lambda r: not r.request_id.endswith("-language"))
    # Seek-based windows (the second starts where the first's last complete segment ended):
    # one hash per window, shared by the detection request and the first window.
    assert detect.request_id.endswith("-language") and len(windows) >= 2
    assert len(sha_calls) == len(windows)
    assert detect.encoder_input.content_hash == windows[0].encoder_input.content_hash
    for request in (detect, *windows):
        window = request.encoder_input.audio
        assert np.shares_memory(window, audio)  # a view of the caller's array, no copy
        assert request.encoder_input.content_hash == reference_hash(np.asarray(window))
    np.testing.assert_array_equal(windows[0].encoder_input.audio, audio[: 30 * SR])
    assert encoder_runs(tiny_llm) - before == len(windows)


def test_word_timestamps_need_alignment_heads_inside_the_decoder(tiny_llm: LLM) -> None:
    """The tiny model has whisper-base's generation config, whose alignment heads name decoder
    layers 3-5 of a 2-layer decoder: refused at the edge, before any work."""
    audio = {"audio": (waves([1.0])[0], 16_000)}
    with pytest.raises(ValueError, match=r"alignment_heads \[\[3, 1\].*outside the decoder"):
        tiny_llm.generate(
            {"prompt": "", "multi_modal_data": audio},
            SamplingParams(max_tokens=2, word_timestamps=True),
            use_tqdm=False,
        )
    with pytest.raises(ValueError, match="alignment_heads"):
        tiny_llm.transcribe((waves([1.0])[0], 16_000), word_timestamps=True, use_tqdm=False)
    assert tiny_llm.llm_engine.get_stats()["num_requests"] == 0


def test_whisper_builder_is_the_engines_and_knows_its_decoder_prompt_length(
    tiny_llm: LLM,
) -> None:
    from v1.engine.inputs.whisper import WhisperInputBuilder

    builder = tiny_llm.llm_engine.input_processor.builder
    assert isinstance(builder, WhisperInputBuilder) and not builder.prompt_is_decoder_prompt
    (clip,) = waves([1.0], seed=3)
    prompt = {"prompt": "hi there", "multi_modal_data": {"audio": (clip, SR)}, "language": "fr"}
    built = tiny_llm.llm_engine.input_processor.process("r", prompt, SamplingParams(max_tokens=2))
    assert builder.decoder_prompt_len(prompt) == len(built.prompt_token_ids)
    timed = builder.build("t", prompt, SamplingParams(max_tokens=2, whisper_timestamps=True))
    assert len(timed.prompt_token_ids) == len(built.prompt_token_ids) - 1  # no <|notimestamps|>
    assert tiny_llm.llm_engine.input_processor.builder is builder
