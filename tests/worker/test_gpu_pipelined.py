"""GPU: encoder-only steps launch without a host sync (so pipelined scheduling overlaps the
device), and pipelined embeddings equal transformers'.

Marked `gpu`; skipped without CUDA.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertModel

from tests.utils import make_tiny_model_dir, make_tiny_wordpiece_tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def tiny_bert(tmp_path) -> str:
    make_tiny_wordpiece_tokenizer(tmp_path)
    return make_tiny_model_dir(
        BertConfig,
        BertModel,
        tmp_path,
        tokenizer_from=tmp_path,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
    )


def test_encoder_only_launch_has_no_host_sync_and_matches_transformers(tmp_path):
    from v1 import LLM, PoolingParams

    path = tiny_bert(tmp_path)
    rng = np.random.default_rng(0)
    prompts = [
        {"prompt_token_ids": [2, *rng.integers(5, 60, size=int(n)).tolist(), 3]}
        for n in rng.integers(1, 100, size=64)
    ]
    llm = LLM(path, device="cuda", dtype="float32", multiprocess=False, max_num_batched_tokens=512)
    try:
        core = llm.llm_engine.engine_core.engine_core
        assert core._batch_queue is not None, "pipelined scheduling is the CUDA default"
        runner = core.executor.worker.model_runner
        launch = runner.execute_model_async
        launches = []

        def checked(so):
            torch.cuda.set_sync_debug_mode("error")  # any host sync raises
            try:
                deferred = launch(so)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            launches.append(so.total_num_scheduled_tokens)
            return deferred

        runner.execute_model_async = checked
        outs = llm.embed(prompts, PoolingParams(normalize=False), use_tqdm=False)
        assert len(launches) > 3
    finally:
        llm.shutdown()
    model = BertModel.from_pretrained(path, add_pooling_layer=False).cuda().eval()
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt["prompt_token_ids"]], device="cuda")
        with torch.no_grad():
            cls = model(input_ids=ids).last_hidden_state[0, 0]  # default pooling: CLS
        np.testing.assert_allclose(out.outputs.embedding, cls.cpu().numpy(), atol=2e-4)
