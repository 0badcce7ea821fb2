"""One Whisper path, counted through the public API: a transcription decodes its audio once
(`load_audio`) and checks its language and task once, whether it comes through `LLM.transcribe`,
`AsyncLLM.transcribe` or the server's /v1/audio/transcriptions (json, verbose_json, stream,
and audio in several chunks); `LLM` and `AsyncLLM` build one Whisper input builder and one
transcriber each, which every call (and the server) reuses. What the text says is for the
real-weight tests (test_transcription.py, the server's test_server_transcriptions.py).
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf
import torch

from tests.utils import ASSETS, ONE_TORCH_THREAD, WHISPER_BASE, make_tiny_whisper_dir, needs_assets
from v1 import LLM
from v1.audio import decode as audio_decode
from v1.engine.inputs.whisper import WhisperInputBuilder
from v1.sampling_params import SamplingParams

AUDIO = ASSETS / "audio"
SHORT = AUDIO / "librispeech" / "test_audio_0.flac"
SR = 16_000
ENGINE_ARGS = dict(
    device="cpu", max_num_encoder_input_tokens=6 * 1500, encoder_cache_size=12 * 1500
)
pytestmark = [needs_assets(WHISPER_BASE, SHORT), ONE_TORCH_THREAD]


@dataclass
class Counts:
    load_audio: int = 0
    builders: int = 0
    language_checks: int = 0
    task_checks: int = 0

    def snapshot(self) -> Counts:
        return Counts(**vars(self))

    def since(self, before: Counts) -> dict[str, int]:
        return {name: value - getattr(before, name) for name, value in vars(self).items()}


@pytest.fixture(scope="module")
def counts() -> Iterator[Counts]:
    """Counts every `load_audio` call (under each name v1 imported it by), every
    WhisperInputBuilder built and every language and task check, for the whole module."""
    # Imported first, so that their names are patched here and restored afterwards.
    import v1.engine.transcription
    import v1.entrypoints.openai.api_server  # noqa: F401

    counted = Counts()
    original_load = audio_decode.load_audio

    def load_audio(*args: Any, **kwargs: Any) -> np.ndarray:
        counted.load_audio += 1
        return original_load(*args, **kwargs)

    def counting(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            setattr(counted, name, getattr(counted, name) + 1)
            return method(self, *args, **kwargs)

        return wrapper

    with pytest.MonkeyPatch.context() as mp:
        for module in list(sys.modules.values()):
            name = getattr(module, "__name__", "")
            if name.startswith("v1") and getattr(module, "load_audio", None) is original_load:
                mp.setattr(module, "load_audio", load_audio)
        mp.setattr(
            WhisperInputBuilder, "__init__", counting("builders", WhisperInputBuilder.__init__)
        )
        mp.setattr(
            WhisperInputBuilder,
            "check_language",
            counting("language_checks", WhisperInputBuilder.check_language),
        )
        mp.setattr(
            WhisperInputBuilder,
            "check_task",
            counting("task_checks", WhisperInputBuilder.check_task),
        )
        yield counted


@pytest.fixture(scope="module")
def quick_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Whisper whose decoder says EOS wherever Whisper's rules allow it: every
    window is a token or two, also on the server, whose requests cap no tokens."""
    from transformers import WhisperForConditionalGeneration

    path = make_tiny_whisper_dir(tmp_path_factory.mktemp("quick_whisper"))
    model = WhisperForConditionalGeneration.from_pretrained(path)
    eos = model.generation_config.eos_token_id
    decoder = model.model.decoder
    direction = torch.randn(decoder.config.d_model, generator=torch.Generator().manual_seed(0))
    direction /= direction.norm()
    with torch.no_grad():
        # The last hidden state is 5 u whatever the input; EOS's (tied) row is 20 u.
        decoder.embed_tokens.weight[eos] = 20 * direction
        decoder.layer_norm.weight.zero_()
        decoder.layer_norm.bias.copy_(5 * direction)
    model.save_pretrained(path)
    return path


def noise(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal(int(seconds * SR))).astype(np.float32)


def flac_bytes(samples: np.ndarray) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, SR, format="FLAC")
    return buf.getvalue()


def words(text: str) -> str:
    return " ".join(re.sub(r"[^a-z ]", " ", text.lower()).split())


# ---- LLM ----


def test_llm_transcription_decodes_its_audio_once_and_reuses_one_transcriber(
    counts: Counts, quick_dir: str
) -> None:
    before = counts.snapshot()
    llm = LLM(quick_dir, multiprocess=False, **ENGINE_ARGS)
    try:
        assert counts.since(before)["builders"] == 1  # the engine's, built with the LLM
        transcriber = llm.transcriber
        assert transcriber is not None and transcriber.builder is (
            llm.llm_engine.input_processor.whisper_builder
        )
        params = SamplingParams(temperature=0.0, max_tokens=4)
        calls = {
            # Language detection, then one window: two requests over one waveform.
            "detect": dict(audio=(noise(3, seed=1), SR)),
            # 65 s with timestamps: seek windows, one after another.
            "long": dict(audio=(noise(65, seed=2), SR), language="en", timestamps=True),
            # Two inputs: one decode each, the options checked once for both.
            "batch": dict(audio=[(noise(2, seed=3), SR), (noise(4, seed=4), SR)], task="translate"),
        }
        for name, call in calls.items():
            before = counts.snapshot()
            audio = call.pop("audio")
            results = llm.transcribe(audio, params, temperature=0.0, use_tqdm=False, **call)
            inputs = len(audio) if isinstance(audio, list) else 1
            assert len(results) == inputs
            assert counts.since(before) == {
                "load_audio": inputs,
                "builders": 0,
                "language_checks": 1,
                "task_checks": 1,
            }, name
        assert llm.transcriber is transcriber
        # generate() with audio goes through the same builder.
        before = counts.snapshot()
        prompt = {"prompt": "", "multi_modal_data": {"audio": (noise(1, seed=5), SR)}}
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
        assert counts.since(before)["builders"] == 0
    finally:
        llm.shutdown()


# ---- AsyncLLM and the server ----


@pytest.fixture(scope="module")
def async_llm(counts: Counts, quick_dir: str) -> Iterator[tuple[Any, int]]:
    """An AsyncLLM (its EngineCore in a process of its own), and the builders its construction
    built."""
    from v1.engine.async_llm import AsyncLLM

    before = counts.snapshot()
    llm = AsyncLLM(quick_dir, **ENGINE_ARGS)
    try:
        yield llm, counts.since(before)["builders"]
    finally:
        llm.shutdown()


def test_async_llm_transcription_decodes_its_audio_once(
    counts: Counts, async_llm: tuple[Any, int]
) -> None:
    llm, built = async_llm
    assert built == 1
    transcriber = llm.transcriber
    assert transcriber.builder is llm.input_processor.whisper_builder
    clip = SHORT.read_bytes()

    async def run() -> list[Any]:
        results = []
        calls = [dict(audio=clip), dict(audio=[clip, (noise(35, seed=6), SR)], language="fr")]
        for k, call in enumerate(calls):  # detected, then given; short, then long-form
            before = counts.snapshot()
            audio = call.pop("audio")
            # One temperature: no fallback retries (this model's text is all unlikely).
            results += await llm.transcribe(audio, request_id=f"a{k}", temperature=0.0, **call)
            assert counts.since(before) == {
                "load_audio": len(audio) if isinstance(audio, list) else 1,
                "builders": 0,
                "language_checks": 1,
                "task_checks": 1,
            }
        return results

    detected, given, long = asyncio.run(run())
    assert given.language == long.language == "fr" and detected.language
    assert long.duration == pytest.approx(35.0)
    assert llm.transcriber is transcriber


def test_server_transcription_decodes_its_upload_once_in_every_format(
    counts: Counts, async_llm: tuple[Any, int]
) -> None:
    """The app over the AsyncLLM, in this process: json (a 40 s upload in two 30 s chunks),
    verbose_json (language detected) and a stream each decode the upload once and check
    language and task once; the server builds no builder of its own."""
    from v1.entrypoints.openai.api_server import build_app
    from v1.entrypoints.openai.serving_engine import ServerSettings

    llm, _ = async_llm
    short, rate = sf.read(str(SHORT), dtype="float32")
    assert rate == SR
    two_chunks = np.zeros(40 * SR, dtype=np.float32)
    for start in (1, 31):
        two_chunks[start * SR : start * SR + short.shape[0]] = short
    before = counts.snapshot()
    app = build_app(
        llm,
        ServerSettings(
            served_model_names=("whisper-1",), model_path=str(WHISPER_BASE), audio_chunk_seconds=30
        ),
    )
    assert counts.since(before)["builders"] == 0
    requests = {
        "json": ({"language": "en"}, flac_bytes(two_chunks)),
        "verbose_json": ({"response_format": "verbose_json"}, SHORT.read_bytes()),
        "stream": ({"language": "english", "stream": "true"}, SHORT.read_bytes()),
    }

    async def run() -> dict[str, tuple[dict[str, int], httpx.Response]]:
        transport = httpx.ASGITransport(app=app)
        responses = {}
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            for name, (fields, data) in requests.items():
                before = counts.snapshot()
                response = await client.post(
                    "/v1/audio/transcriptions",
                    files={"file": ("a.flac", data)},
                    # temperature 1: the last of the fallback steps, so no retries.
                    data={"model": "whisper-1", "temperature": "1", **fields},
                    timeout=120,
                )
                responses[name] = (counts.since(before), response)
        return responses

    once = {"load_audio": 1, "builders": 0, "language_checks": 1, "task_checks": 1}
    for name, (counted, response) in asyncio.run(run()).items():
        assert response.status_code == 200, (name, response.text)
        assert counted == once, name
        if name == "json":
            assert response.json()["usage"]["seconds"] == 40
        elif name == "verbose_json":
            assert response.json()["duration"] == pytest.approx(short.shape[0] / SR, abs=0.01)
        else:
            events = [
                json.loads(line.removeprefix("data: "))
                for line in response.text.splitlines()
                if line.startswith("data: ")
            ]
            *deltas, done = events
            assert done["type"] == "transcript.text.done"
            assert all(e["type"] == "transcript.text.delta" for e in deltas)
            assert words("".join(e["delta"] for e in deltas)) == words(done["text"])
