"""GPU: Whisper's encoder in CUDA graphs (`v1/worker/whisper_encoder_graphs.py`) gives the eager
encoder's states for every window count (power-of-two parts, 3 = 2 + 1; clips shorter than a
window), and
the real whisper-base transcribes the asset clips as eagerly. Marked `gpu`; skipped without
CUDA."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.utils import WHISPER_BASE, make_tiny_whisper_dir
from tests.worker.test_gpu_absorbed import AUDIO, CLIPS  # the asset clips with expected tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def runner_state(llm):
    return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.state


@pytest.mark.parametrize("num_clips", [2, 3, 8])
def test_graphs_match_the_eager_encoder(tmp_path, num_clips) -> None:
    from v1 import LLM
    from v1.attention.backend import AttentionType
    from v1.forward_context import ForwardContext, set_forward_context

    llm = LLM(
        make_tiny_whisper_dir(tmp_path),
        device="cuda",
        dtype="float16",
        multiprocess=False,
        max_num_encoder_input_tokens=8 * 1500,
    )
    try:
        state = runner_state(llm)
        graphs = state.encoder_graphs
        assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8]
        rng = np.random.default_rng(num_clips)
        seconds = [30.0, 7.5, 2.0, 12.25, 30.0, 0.5, 19.0, 4.0][:num_clips]
        clips = [
            torch.from_numpy((0.1 * rng.standard_normal(int(s * 16_000))).astype(np.float32)).cuda()
            for s in seconds
        ]
        got = graphs.encode(clips)
        # The eager reference runs all windows at once: 2+ windows are 3,000+ rows, where its
        # add + LayerNorm takes the Triton kernel a graph captures (one window's 1,500 rows
        # would take torch's, a rounding apart).
        lengths = np.full(num_clips, 1500, dtype=np.int64)
        metadata = state.attn_metadata.uncached(
            lengths, AttentionType.ENCODER, state.encoder_layers
        )
        with torch.inference_mode(), set_forward_context(ForwardContext(metadata)):
            want = state.model.encode(clips)
        torch.testing.assert_close(got, want[: num_clips * 1500], rtol=2e-2, atol=2e-2)
        again = graphs.encode(clips[::-1])  # a replay overwrites the graphs' own outputs only
        torch.testing.assert_close(got, state.encoder_graphs.encode(clips), rtol=0, atol=0)
        assert again.shape == got.shape
    finally:
        llm.shutdown()


def test_no_graphs_in_float32_or_eager(tmp_path) -> None:
    from v1 import LLM

    path = make_tiny_whisper_dir(tmp_path)
    small = dict(max_num_encoder_input_tokens=2 * 1500, kv_cache_memory_bytes=1 << 30)
    for kwargs in (dict(dtype="float32"), dict(dtype="float16", enforce_eager=True)):
        llm = LLM(path, device="cuda", multiprocess=False, **small, **kwargs)
        try:
            assert runner_state(llm).encoder_graphs is None
        finally:
            llm.shutdown()


@pytest.mark.skipif(
    not (WHISPER_BASE / "model.safetensors").is_file() or not AUDIO.is_dir(),
    reason="needs whisper-base's weights and the clips",
)
def test_real_whisper_base_transcribes_as_eagerly() -> None:
    from v1 import LLM
    from v1.audio import load_audio

    audio = [(load_audio(AUDIO / n), 16_000) for n in CLIPS * 3]
    expected = json.loads((AUDIO / "expected_whisper_base.json").read_text())
    texts = {}
    for graphs in (True, False):
        llm = LLM(str(WHISPER_BASE), dtype="float16", multiprocess=False)
        try:
            state = runner_state(llm)
            assert (state.encoder_graphs is not None) is True
            if not graphs:
                state.encoder_graphs = None
            del state  # held past shutdown, it kept this engine's KV cache from the next one
            results = llm.transcribe(audio, language="en", temperature=0.0)
            texts[graphs] = [r.text for r in results]
        finally:
            llm.shutdown()
    assert texts[True] == texts[False]
    want = [expected[n]["text"].strip() for n in CLIPS]
    assert sum(t.strip() != w for t, w in zip(texts[True][:3], want, strict=True)) <= 1
