"""GPU: a generation step waits for the device exactly once (the event of the sampled tokens'
copy to the host), with and without CUDA graphs, for a decoder-only and an encoder-decoder
model; with pipelined steps the launch of a step never waits (the read is one step behind).

torch's sync debug mode warns on every synchronizing call it knows of (it does not flag event
waits, which we count on `HostCopy.get`); after a warm-up, a step must raise no such warning.
Marked `gpu`; skipped without CUDA.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.utils import (
    TINY_BART_WIDE,
    make_tiny_bart_dir,
    make_tiny_llama_dir,
)
from v1.worker.sampled_output import HostCopy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


SYNC_WARNING = "called a synchronizing CUDA operation"
"""torch's warning for each synchronizing call (not its one-off 'prototype feature' notice)."""


def syncs_per_step(
    path: str, prompts: list[list[int]], enforce_eager: bool, async_scheduling: bool = False
) -> list[int]:
    """Generates with every step's execute_model under sync debug mode 'warn'; returns the
    number of synchronizing calls of each step that scheduled tokens."""
    from v1 import LLM, SamplingParams

    llm = LLM(
        path,
        device="cuda",
        dtype="float16",
        multiprocess=False,
        enforce_eager=enforce_eager,
        async_scheduling=async_scheduling,
        num_kv_blocks=64,
        block_size=16,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        num_scheduler_steps=1,  # one decode step per execute_model (auto bursts 8 on CUDA)
    )
    counts: list[int] = []
    try:
        runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
        execute = runner.execute_model_async if async_scheduling else runner.execute_model

        waits = [0]
        host_get = HostCopy.get

        def counted_get(self):
            waits[0] += 1
            return host_get(self)

        def counted(so):
            waits[0] = 0
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    out = execute(so)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            if so.total_num_scheduled_tokens:
                counts.append((sum(SYNC_WARNING in str(w.message) for w in caught), waits[0]))
            return out

        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        # Warm-up outside the count: the first launch of each kernel variant (e.g. the long
        # query block of prefill chunks) JIT-compiles it, which is not the step path.
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        HostCopy.get = counted_get
        if async_scheduling:
            runner.execute_model_async = counted
        else:
            runner.execute_model = counted
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    finally:
        HostCopy.get = host_get
        llm.shutdown()
    return counts


PROMPTS = [[1] + [(7 * i + 3 * j) % 200 + 4 for j in range(3 + 9 * i)] for i in range(6)]


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda_graphs"])
def test_decoder_only_step_syncs_once(tmp_path, enforce_eager):
    counts = syncs_per_step(make_tiny_llama_dir(tmp_path), PROMPTS, enforce_eager)
    assert len(counts) > 12 and set(counts) == {(0, 1)}, counts


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda_graphs"])
def test_encoder_decoder_step_syncs_once(tmp_path, enforce_eager):
    path = make_tiny_bart_dir(tmp_path, bart_tokenizer=False, base=TINY_BART_WIDE)
    prompts = [p + [2] for p in PROMPTS]
    counts = syncs_per_step(path, prompts, enforce_eager)
    assert len(counts) > 12 and set(counts) == {(0, 1)}, counts


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda_graphs"])
def test_pipelined_generation_launch_never_syncs(tmp_path, enforce_eager):
    counts = syncs_per_step(make_tiny_llama_dir(tmp_path), PROMPTS, enforce_eager, True)
    assert len(counts) > 12 and set(counts) == {(0, 0)}, counts
