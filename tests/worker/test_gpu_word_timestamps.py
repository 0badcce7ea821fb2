"""GPU: word timestamps with CUDA graphs and pipelined steps. The decoder steps replay graphs;
the alignment pass runs eagerly after a request's last token, while the next step is already
launched; the token times still match transformers' (CPU, fp32) within 0.1 s.

Marked `gpu`; skipped without CUDA. fp32 with IEEE dots so greedy ties cannot flip.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.engine.test_word_timestamps import (
    AUDIO,
    CLIPS,
    NUM_COMPARED,
    SR,
    assert_token_times_match,
    transformers_token_times,
)
from tests.utils import WHISPER_BASE, needs_assets
from v1 import LLM, SamplingParams
from v1.audio import load_audio

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    needs_assets(WHISPER_BASE, AUDIO),
]


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda_graphs", "eager"])
def test_word_timestamps_with_cuda_graphs(enforce_eager: bool) -> None:
    clips = [load_audio(AUDIO / name) for name in CLIPS[:NUM_COMPARED]]
    reference = transformers_token_times(clips)
    llm = LLM(
        str(WHISPER_BASE),
        device="cuda",
        dtype="float32",
        multiprocess=False,
        enforce_eager=enforce_eager,
    )
    try:
        runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
        assert (runner.cuda_graphs is None) == enforce_eager
        prompts = [{"prompt": "", "multi_modal_data": {"audio": (a, SR)}} for a in clips]
        # The shorter request ends while the other keeps decoding: its alignment pass runs
        # between graph replays of the other's steps.
        params = SamplingParams(temperature=0.0, max_tokens=None, word_timestamps=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert_token_times_match(outputs, reference, llm.get_tokenizer().eos_token_id)
        if not enforce_eager:
            assert runner.cuda_graphs.num_replays > 0
        results = llm.transcribe(
            [(np.concatenate(clips), SR)], language="en", word_timestamps=True, use_tqdm=False
        )
        words = results[0].words
        assert words and "".join(w.word for w in words) == results[0].text
        assert llm.llm_engine.get_stats()["num_kv_requests"] == 0
    finally:
        llm.shutdown()
