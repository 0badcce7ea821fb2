"""GPU: a step's Whisper audio reaches the device as ONE pinned, non-blocking host-to-device copy
(not one pageable copy per clip), intact, with no synchronizing call on the way.

Wraps `EncoderDecoderState._encoder_kwargs` (the step's audio transfer) of a tiny Whisper on
CUDA: torch's sync debug mode "error" turns any synchronizing call into an exception, and the
profiler lists the step's memcpy activities. Marked `gpu`; skipped without CUDA.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from tests.utils import WHISPER_BASE, make_tiny_whisper_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not WHISPER_BASE.is_dir(), reason=f"needs {WHISPER_BASE}"),
]
SR = 16_000


def test_step_audio_is_one_pinned_non_blocking_copy(tmp_path) -> None:
    from v1 import LLM, SamplingParams

    llm = LLM(
        make_tiny_whisper_dir(tmp_path),
        device="cuda",
        dtype="float32",
        multiprocess=False,
        max_num_encoder_input_tokens=4 * 1500,
        encoder_cache_size=8 * 1500,
    )
    steps: list[tuple[list[str], list[np.ndarray], list[torch.Tensor]]] = []
    try:
        state = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.state
        encoder_kwargs = state._encoder_kwargs

        def checked(inputs: list[Any]) -> dict[str, Any]:
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                torch.cuda.set_sync_debug_mode("error")
                try:
                    kwargs = encoder_kwargs(inputs)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                torch.cuda.synchronize()
            copies = [e.name for e in prof.events() if e.name.startswith("Memcpy")]
            host = [np.asarray(e.audio) for e in inputs]
            steps.append((copies, host, [a.cpu() for a in kwargs["audio"]]))
            return kwargs

        rng = np.random.default_rng(0)
        clips = [(0.1 * rng.standard_normal(int(s * SR))).astype(np.float32) for s in (30, 7, 2)]
        prompts = [{"prompt": "", "multi_modal_data": {"audio": (c, SR)}} for c in clips]
        params = SamplingParams(temperature=0.0, max_tokens=3)
        llm.generate(prompts, params, use_tqdm=False)  # warm-up: allocators, kernels
        state._encoder_kwargs = checked
        other = [c[::-1].copy() for c in clips]  # new content hashes: the encoder runs again
        outputs = llm.generate(
            [{"prompt": "", "multi_modal_data": {"audio": (c, SR)}} for c in other],
            params,
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    assert all(len(o.outputs[0].token_ids) == 3 for o in outputs)
    assert steps, "no encoder step ran"
    assert sum(len(host) for _, host, _ in steps) == len(other)
    for copies, host, on_device in steps:
        assert copies == ["Memcpy HtoD (Pinned -> Device)"], copies
        for sent, arrived in zip(host, on_device, strict=True):
            assert torch.equal(arrived, torch.from_numpy(sent))
