"""LoRA on the audio endpoints: /v1/audio/transcriptions and /v1/audio/translations with
`model=<adapter name>` run that Whisper adapter (the text equals offline `LLM.transcribe` with
the LoRARequest, and differs from the base model's), and an adapter whose folder is corrupted
after it was loaded fails only its own request (400 on `model`, an OpenAI error body naming
the adapter), while a
base and an adapter request sent with it succeed.

The tiny random Whisper has its (tied) output embedding scaled up, so every token is sampled
with probability ~1: temperature 1.0 (one temperature, no fallback schedule) is deterministic
and the server and offline runs are comparable."""

from __future__ import annotations

import io
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from tests.entrypoints.openai.conftest import RemoteServer
from tests.lora.conftest import WHISPER_TARGETS, make_adapter
from v1 import LLM, LoRARequest

SR = 16_000
MAX_MODEL_LEN = 32


@pytest.fixture(scope="module")
def peaked_whisper(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[str]]:
    from transformers import WhisperForConditionalGeneration

    from tests.utils import WHISPER_BASE, make_tiny_whisper_dir

    if not WHISPER_BASE.is_dir():
        pytest.skip(f"needs the real whisper-base folder at {WHISPER_BASE}")
    root = tmp_path_factory.mktemp("peaked_whisper")
    path = make_tiny_whisper_dir(root / "model")
    model = WhisperForConditionalGeneration.from_pretrained(path)
    with torch.no_grad():
        model.model.decoder.embed_tokens.weight.mul_(40.0)
    model.save_pretrained(path)
    adapters = [
        make_adapter(
            WhisperForConditionalGeneration.from_pretrained(path),
            root / name,
            WHISPER_TARGETS,
            4,
            seed=seed,
            std=0.3,
        )
        for name, seed in (("a4", 5), ("b4", 6))
    ]
    return path, adapters


def _flac(seed: int) -> bytes:
    wave = np.random.default_rng(seed).standard_normal(SR * 3).astype(np.float32) * 0.1
    buf = io.BytesIO()
    sf.write(buf, wave, SR, format="FLAC")
    return buf.getvalue()


def test_audio_endpoints_serve_adapters(
    peaked_whisper: tuple[str, list[str]], tmp_path: Path
) -> None:
    path, (a4, b4) = peaked_whisper
    audio = _flac(1)
    audio_path = tmp_path / "clip.flac"
    audio_path.write_bytes(audio)
    options = dict(language="en", temperature=1.0, use_tqdm=False)
    with LLM(
        path,
        multiprocess=False,
        block_size=16,
        num_kv_blocks=512,
        max_model_len=MAX_MODEL_LEN,
        enable_lora=True,
        max_lora_rank=8,
    ) as llm:
        lora = LoRARequest("a4", 1, a4)
        want = {
            ("transcribe", "a4"): llm.transcribe(str(audio_path), lora_request=lora, **options),
            ("translate", "a4"): llm.transcribe(
                str(audio_path), lora_request=lora, task="translate", **options
            ),
            ("transcribe", None): llm.transcribe(str(audio_path), **options),
        }
    want = {k: v[0].text for k, v in want.items()}
    assert want[("transcribe", "a4")] != want[("transcribe", None)]

    broken = str(shutil.copytree(b4, tmp_path / "broken"))
    args = [
        "--enable-lora",
        "--max-loras", "2",
        "--max-lora-rank", "8",
        "--lora-modules", f"a4={a4}",
        "--num-kv-blocks", "512",
        "--block-size", "16",
        "--max-model-len", str(MAX_MODEL_LEN),
    ]  # fmt: skip
    server = RemoteServer("lora-audio", path, args, tmp_path).wait_ready()
    try:
        client = server.openai()
        assert "a4" in [m.id for m in client.models.list().data]

        def transcribe(model: str) -> str:
            return client.audio.transcriptions.create(
                model=model, file=("clip.flac", audio), language="en", temperature=1.0
            ).text

        assert transcribe("a4") == want[("transcribe", "a4")]
        assert transcribe(path) == want[("transcribe", None)]
        translated = client.audio.translations.create(
            model="a4", file=("clip.flac", audio), temperature=1.0
        ).text
        assert translated == want[("translate", "a4")]

        # Loaded (the frontend checked it), then corrupted before the worker reads it.
        http = server.http()
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": broken})
        assert r.status_code == 200, r.text
        weights = Path(broken) / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])

        def post(model: str) -> tuple[int, dict]:
            files = {"file": ("clip.flac", audio, "audio/flac")}
            data = {"model": model, "language": "en", "temperature": "1.0"}
            with server.http() as c:
                resp = c.post("/v1/audio/transcriptions", files=files, data=data, timeout=120)
            return resp.status_code, resp.json()

        with ThreadPoolExecutor(3) as pool:
            bad, base, good = pool.map(post, ["broken", path, "a4"])
        assert bad[0] == 400, bad
        assert bad[1]["error"]["param"] == "model"
        assert "LoRA adapter 'broken'" in bad[1]["error"]["message"]
        # Temperature 1.0 samples: the first token may vary with the batch, so the requests
        # that share a batch with the failed one are checked for success (their exact texts
        # are compared above, alone).
        assert base[0] == 200 and base[1]["text"], base
        assert good[0] == 200 and good[1]["text"], good
        assert transcribe("a4") == want[("transcribe", "a4")]  # still serving
        metrics = http.get("/metrics").text
        (used,) = re.findall(r"^v1_kv_cache_used_blocks(?:\{[^}]*\})? (\S+)$", metrics, re.M)
        assert float(used) == 0.0  # no block leaked by the failed request
    finally:
        server.stop()
