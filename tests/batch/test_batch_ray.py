"""`v1.batch` over Ray Data on a local Ray cluster (2 CPUs, one session for the module): 20
audio clips through a tiny Whisper and 200 texts through MiniLM give what the single-process
`LLM` gives. Skips only where Ray (with Ray Data) is not installed."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from tests.utils import (  # noqa: E402
    ASSETS,
    make_tiny_whisper_dir,  # noqa: E402
    needs_assets,
)
from v1.batch import BatchJob, run_batch  # noqa: E402
from v1.batch.writer import read_shard  # noqa: E402
from v1.entrypoints.llm import LLM  # noqa: E402
from v1.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.timeout(600)

AUDIO = ASSETS / "audio"
CLIPS = [
    AUDIO / "jfk.flac",
    AUDIO / "librispeech" / "test_audio_0.flac",
    AUDIO / "librispeech" / "test_audio_1.flac",
    AUDIO / "hotwords.mp3",
    AUDIO / "stereo_diarization.wav",
]
MINILM = ASSETS / "all-MiniLM-L6-v2"


@pytest.fixture(scope="module", autouse=True)
def ray_session() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


def read_output(folder: str) -> list[dict]:
    parts = sorted(p for p in os.listdir(folder) if p.startswith("part-"))
    return [row for p in parts for row in read_shard(os.path.join(folder, p))]


@needs_assets(*CLIPS)
def test_ray_transcribes_20_clips_like_llm(tmp_path: Path):
    model = make_tiny_whisper_dir(tmp_path / "tiny_whisper")
    folder = tmp_path / "clips"
    (folder / "more").mkdir(parents=True)
    for i in range(20):
        clip = CLIPS[i % len(CLIPS)]
        sub = "more/" if i % 2 else ""
        shutil.copy(clip, folder / f"{sub}clip{i:02d}{clip.suffix}")
    job = BatchJob(
        input=str(folder),
        output=str(tmp_path / "out"),
        task="transcribe",
        model=model,
        engine_kwargs={"device": "cpu"},
        # One temperature: no sampled fallback, so both runs are greedy throughout.
        options={"language": "en", "temperature": 0.0, "max_tokens": 12},
        shard_size=8,
        batch_size=5,
        ray_address="auto",
    )
    report = run_batch(job, use_tqdm=False)
    assert report.num_rows == 20 and len(report.written) == 3
    rows = read_output(job.output)

    paths = sorted(str(p) for p in folder.rglob("*.*"))
    with LLM(model, device="cpu", multiprocess=False) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=12)
        expected = llm.transcribe(paths, params, language="en", temperature=0.0, use_tqdm=False)
    assert [r["id"] for r in rows] == [os.path.relpath(p, folder) for p in paths]
    assert [r["text"] for r in rows] == [e.text for e in expected]
    assert [r["duration"] for r in rows] == pytest.approx([e.duration for e in expected])
    assert len({r["text"] for r in rows}) > 1  # the outputs depend on the audio


@needs_assets(MINILM)
def test_ray_embeds_200_texts_like_llm(tmp_path: Path):
    texts = [
        f"sentence {i} about {['cats', 'the sea', 'music', 'trains'][i % 4]}" for i in range(200)
    ]
    inp = tmp_path / "texts.jsonl"
    inp.write_text("".join(f'{{"id": "t{i}", "text": "{t}"}}\n' for i, t in enumerate(texts)))
    job = BatchJob(
        input=str(inp),
        output=str(tmp_path / "out"),
        task="embed",
        model=str(MINILM),
        engine_kwargs={"device": "cpu"},
        shard_size=64,
        batch_size=50,
        ray_address="auto",
        output_format="parquet",
    )
    report = run_batch(job, use_tqdm=False)
    assert report.num_shards == 4 and len(report.written) == 4
    rows = read_output(job.output)
    with LLM(str(MINILM), device="cpu", multiprocess=False) as llm:
        expected = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
    assert [r["id"] for r in rows] == [f"t{i}" for i in range(200)]
    got = np.asarray([r["embedding"] for r in rows], dtype=np.float32)
    np.testing.assert_allclose(got, np.asarray(expected, dtype=np.float32), atol=1e-5)
    # A second run finds every shard written and starts no engine.
    again = run_batch(job, use_tqdm=False)
    assert again.written == [] and again.num_skipped == 4


@pytest.mark.gpu
@needs_assets(MINILM)
def test_ray_runs_one_engine_per_gpu_actor(tmp_path: Path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if ray.cluster_resources().get("GPU", 0) < 1:
        pytest.skip("the Ray session sees no GPU")
    texts = [f"text {i} on a GPU actor" for i in range(64)]
    inp = tmp_path / "texts.jsonl"
    inp.write_text("".join(f'{{"text": "{t}"}}\n' for t in texts))
    job = BatchJob(
        input=str(inp),
        output=str(tmp_path / "out"),
        task="embed",
        model=str(MINILM),
        engine_kwargs={"dtype": "float32"},  # device auto: the actors take a GPU each
        shard_size=32,
        ray_address="auto",
    )
    # The reference first: its engine frees the GPU before the actors take it.
    with LLM(str(MINILM), device="cuda", dtype="float32") as llm:
        expected = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
    assert len(run_batch(job, use_tqdm=False).written) == 2
    got = np.asarray([r["embedding"] for r in read_output(job.output)], dtype=np.float32)
    np.testing.assert_allclose(got, np.asarray(expected, dtype=np.float32), atol=1e-4)
