"""Tensor parallelism on 2 GPUs over NCCL: TP=2 gives the TP=1 greedy tokens (fp32) with CUDA
graphs and pipelined steps, for a decoder-only, an encoder-decoder (both cross-attention
modes) and an encoder-only model. Marked `gpu`; skipped with fewer than 2 CUDA devices."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.distributed.test_tensor_parallel import (
    TEXTS,
    _bart_family_dir,
    generate_tokens,
    token_prompts,
    worker_pids,
)
from tests.utils import make_tiny_llama_dir, make_tiny_model_dir, make_tiny_wordpiece_tokenizer
from v1 import LLM

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]
GPU_ARGS = dict(device="cuda", dtype="float32", num_kv_blocks=256, block_size=16, max_num_seqs=8)


def tp1_and_tp2(path: str, run: Any, **engine_args: Any) -> list[Any]:
    results = []
    for tp in (1, 2):
        with LLM(path, multiprocess=True, tensor_parallel_size=tp, **engine_args) as llm:
            results.append(run(llm))
    assert worker_pids() == []
    return results


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_llama_tp2_gpu(tmp_path: Path, enforce_eager: bool) -> None:
    path = make_tiny_llama_dir(tmp_path, initializer_range=0.2)
    tp1, tp2 = tp1_and_tp2(
        path, generate_tokens(token_prompts(8)), enforce_eager=enforce_eager, **GPU_ARGS
    )
    assert tp2 == tp1


@pytest.mark.parametrize("cross_attention", ["per_layer", "absorbed"])
def test_bart_tp2_gpu(tmp_path: Path, cross_attention: str) -> None:
    path = _bart_family_dir(tmp_path, "bart")
    tp1, tp2 = tp1_and_tp2(
        path,
        generate_tokens(TEXTS),
        cross_attention=cross_attention,
        max_model_len=64,
        **GPU_ARGS,
    )
    assert tp2 == tp1


def test_bert_tp2_gpu(tmp_path: Path) -> None:
    from transformers import BertConfig, BertModel

    make_tiny_wordpiece_tokenizer(tmp_path)
    path = make_tiny_model_dir(
        BertConfig,
        BertModel,
        tmp_path,
        tokenizer_from=tmp_path,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )

    def run(llm: LLM) -> np.ndarray:
        return np.array([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])

    tp1, tp2 = tp1_and_tp2(path, run, device="cuda", dtype="float32", max_num_seqs=4)
    np.testing.assert_allclose(tp2, tp1, atol=1e-5, rtol=0)


def test_ray_tp2_gpu(tmp_path: Path) -> None:
    """Rank 1 as a Ray actor on the other GPU (rank 0's GPU held in the placement group)."""
    ray = pytest.importorskip("ray")
    path = make_tiny_llama_dir(tmp_path, initializer_range=0.2)
    with LLM(path, multiprocess=False, **GPU_ARGS) as llm:
        expected = generate_tokens(token_prompts(8))(llm)
    ray.init(num_gpus=2, num_cpus=2, include_dashboard=False)
    try:
        with LLM(
            path,
            multiprocess=False,
            tensor_parallel_size=2,
            distributed_executor_backend="ray",
            **GPU_ARGS,
        ) as llm:
            assert generate_tokens(token_prompts(8))(llm) == expected
    finally:
        ray.shutdown()
