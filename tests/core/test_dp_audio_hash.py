"""Data-parallel Whisper: the frontend sends audio without its content hash and each engine core
hashes the audio it takes (the same BLAKE3 digest `AudioClip` computes), so the one frontend
thread no longer hashes every clip (issue 34). Tokens stay those of one in-process core; a
clip's requests, and equal audio, still meet their encoder output in one core."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from blake3 import blake3

from tests.core.fakes import make_engine_core
from tests.utils import WHISPER_BASE, count_clip_hashes, make_tiny_whisper_dir, needs_assets
from v1 import LLM, SamplingParams
from v1.core.dp_client import CoreLoadBalancer, audio_fingerprint, routing_key
from v1.core.encoder_inputs import with_content_hash
from v1.core.protocol import EncoderInput, EngineCoreRequest, FinishReason

pytestmark = [needs_assets(WHISPER_BASE), pytest.mark.timeout(300)]

SR = 16_000


def clips(seconds: list[float], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(0.1 * rng.standard_normal(round(s * SR))).astype(np.float32) for s in seconds]


def audio_request(req_id: str, audio: np.ndarray, content_hash: str = "") -> EngineCoreRequest:
    enc = EncoderInput(num_encoder_tokens=1500, content_hash=content_hash, audio=audio)
    return EngineCoreRequest(request_id=req_id, prompt_token_ids=[1], encoder_input=enc)


# ---- the pieces ----
def test_the_core_hashes_unhashed_audio_as_an_audio_clip_does():
    (audio,) = clips([3.0])
    enc = with_content_hash(EncoderInput(num_encoder_tokens=1500, content_hash="", audio=audio))
    assert enc.content_hash == blake3(audio.tobytes()).hexdigest()
    given = EncoderInput(num_encoder_tokens=1500, content_hash="h", audio=audio)
    assert with_content_hash(given).content_hash == "h"  # a hash sent along is kept
    with pytest.raises(ValueError, match="needs a content_hash"):
        with_content_hash(EncoderInput(num_encoder_tokens=3, content_hash="", token_ids=[1, 2]))


def test_a_core_fails_an_unhashed_token_input_alone_and_keeps_running():
    core = make_engine_core("encoder_decoder", num_kv_blocks=129, block_size=4)
    bad = EngineCoreRequest(
        request_id="bad",
        prompt_token_ids=[1],
        encoder_input=EncoderInput(num_encoder_tokens=3, content_hash="", token_ids=[1, 2, 3]),
    )
    core.add_request(bad)
    (out,) = core.step().outputs
    assert out.request_id == "bad" and out.finish_reason is FinishReason.ERROR
    assert "content_hash" in out.error and not core.has_work()


def test_unhashed_audio_is_routed_by_its_fingerprint():
    a, b = clips([30.0, 30.0], seed=1)
    assert routing_key(audio_request("x", a)) == audio_fingerprint(a) == audio_fingerprint(a.copy())
    assert audio_fingerprint(a) != audio_fingerprint(b)
    assert audio_fingerprint(a[:1000]) != audio_fingerprint(a[:1001])  # the length counts
    assert routing_key(audio_request("x", a, "h")) == "h"
    lb = CoreLoadBalancer(2)
    assert lb.assign(audio_request("r0", a)) == 0
    assert lb.assign(audio_request("r1", b)) == 1
    # Equal audio in another array (the same file loaded again) follows its first copy.
    assert lb.assign(audio_request("r2", a.copy())) == 0
    assert lb.assign(audio_request("r3", b.copy())) == 1


# ---- through LLM ----
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_whisper_dir(tmp_path_factory.mktemp("tiny_whisper") / "m")


@pytest.fixture(scope="module")
def dp_llm(model_dir: str) -> Iterator[LLM]:
    with LLM(model_dir, device="cpu", data_parallel_size=2) as llm:
        yield llm


@pytest.fixture(scope="module")
def one_core(model_dir: str) -> Iterator[LLM]:
    with LLM(model_dir, device="cpu", multiprocess=False) as llm:
        yield llm


def tokens(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_two_cores_hash_the_audio_and_match_one_core(
    dp_llm: LLM, one_core: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    waves = clips([4.0, 2.5, 7.0, 1.0], seed=2)
    prompts = [{"prompt": "", "multi_modal_data": {"audio": (w, SR)}} for w in waves]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    expected = tokens(one_core.generate(prompts, params, use_tqdm=False))
    sent: list[EngineCoreRequest] = []
    client = dp_llm.llm_engine.engine_core
    add = client.add_request
    monkeypatch.setattr(client, "add_request", lambda r: (sent.append(r), add(r))[1])
    hashes = count_clip_hashes(monkeypatch)
    assert tokens(dp_llm.generate(prompts, params, use_tqdm=False)) == expected
    assert hashes == []  # the frontend hashed nothing
    assert [r.encoder_input.content_hash for r in sent] == [""] * len(waves)
    stats = dp_llm.llm_engine.get_stats()["data_parallel"]
    assert all(s["num_encoder_runs"] > 0 for s in stats)  # both cores took audio
    # The transcription path too (plans, windows, results), texts equal to one core's.
    sp = SamplingParams(temperature=0.0, max_tokens=5)
    kwargs = dict(language="en", temperature=0.0, use_tqdm=False)
    got = dp_llm.transcribe([(w, SR) for w in waves], sp, **kwargs)
    assert hashes == []
    want = one_core.transcribe([(w, SR) for w in waves], sp, **kwargs)
    assert [r.text for r in got] == [r.text for r in want]


def test_a_window_beam_search_names_the_audio_the_core_hashed(
    dp_llm: LLM, one_core: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beam steps after the first send only the audio's hash: the frontend computes it once
    per search (the digest the core computed for the first step)."""
    (wave,) = clips([3.0], seed=3)
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    kwargs = dict(language="en", temperature=0.0, beam_size=2, use_tqdm=False)
    (want,) = one_core.transcribe((wave, SR), sp, **kwargs)
    hashes = count_clip_hashes(monkeypatch)
    (got,) = dp_llm.transcribe((wave, SR), sp, **kwargs)
    assert got.text == want.text
    assert len(hashes) == 1


def test_the_asyncio_engine_of_the_server_leaves_hashing_to_its_cores(
    model_dir: str, one_core: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`v1 serve --data-parallel-size 2` runs this AsyncLLM: concurrent audio requests, the
    frontend hashing nothing, the tokens of one core."""
    import asyncio

    from v1.config import make_engine_config
    from v1.engine.async_llm import AsyncLLM

    waves = clips([2.0, 5.0, 3.5], seed=4)
    prompts = [{"prompt": "", "multi_modal_data": {"audio": (w, SR)}} for w in waves]
    params = SamplingParams(temperature=0.0, max_tokens=5)
    expected = tokens(one_core.generate(prompts, params, use_tqdm=False))
    hashes = count_clip_hashes(monkeypatch)
    llm = AsyncLLM.from_engine_config(
        make_engine_config(model_dir, device="cpu", data_parallel_size=2)
    )

    async def one(i: int) -> list[int]:
        last = None
        async for out in llm.generate(prompts[i], params, f"a{i}"):
            last = out
        assert last is not None and last.finished
        return list(last.outputs[0].token_ids)

    async def main() -> list[list[int]]:
        return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))

    try:
        assert asyncio.run(main()) == expected
    finally:
        llm.shutdown()
    assert hashes == []
