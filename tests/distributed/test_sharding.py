"""The sharder without processes: each rank of a TP=2 split reads only its slices of the
safetensors, and the ranks' shards put back together are the whole model (q/k/v by heads with
GQA, fused parts, vocabulary rows padded, row-parallel bias on rank 0 only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig

from tests.utils import make_tiny_llama_dir, make_tiny_model_dir
from v1.distributed.parallel_state import TensorParallelGroup
from v1.models.checkpoint_slice import CheckpointSlice
from v1.worker.model_loader import iterate_weights, load_model_from_weights, weight_files


def load(path: str, tp: TensorParallelGroup | None) -> Any:
    hf_config = AutoConfig.from_pretrained(path)
    weights = iterate_weights(weight_files(path), lazy=tp is not None)
    return load_model_from_weights(hf_config, weights, "cpu", torch.float32, tp=tp)


@pytest.fixture
def count_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Elements read from the checkpoint through CheckpointSlices."""
    read: list[int] = []
    materialize = CheckpointSlice.materialize

    def counting(self: CheckpointSlice) -> torch.Tensor:
        tensor = materialize(self)
        read.append(tensor.numel())
        return tensor

    monkeypatch.setattr(CheckpointSlice, "materialize", counting)
    return read


def test_llama_shards_reassemble_and_read_half(tmp_path: Path, count_reads: list[int]) -> None:
    # An odd vocabulary (above the tokenizer's size), so rank 1's last embedding row is padding.
    path = make_tiny_llama_dir(tmp_path, vocab_size=401, attention_bias=True)
    full = load(path, None)
    full_params = dict(full.named_parameters())
    total = sum(p.numel() for p in full_params.values())
    shards = []
    for rank in (0, 1):
        count_reads.clear()
        shards.append(dict(load(path, TensorParallelGroup(rank, 2)).named_parameters()))
        assert sum(count_reads) < 0.55 * total  # its slices (and the small replicated norms)

    def cat(name: str, dim: int) -> torch.Tensor:
        return torch.cat([shards[0][name], shards[1][name]], dim=dim)

    head_dim, heads, kv_heads = 16, 4, 2
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    q_rows, kv_rows = heads * head_dim // 2, kv_heads * head_dim // 2
    for part, (start, rows) in enumerate(
        [(0, q_rows), (q_rows, kv_rows), (q_rows + kv_rows, kv_rows)]
    ):
        whole = torch.cat([s[qkv][start : start + rows] for s in shards])
        offset = [0, heads * head_dim, (heads + kv_heads) * head_dim][part]
        assert torch.equal(whole, full_params[qkv][offset : offset + 2 * rows])
    o_proj = "model.layers.0.self_attn.o_proj"
    assert torch.equal(cat(f"{o_proj}.weight", 1), full_params[f"{o_proj}.weight"])
    assert torch.equal(shards[0][f"{o_proj}.bias"], full_params[f"{o_proj}.bias"])
    assert not shards[1][f"{o_proj}.bias"].any()  # added once, after the all-reduce
    down = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(cat(down, 1), full_params[down])
    embed = "model.embed_tokens.weight"
    assert full_params[embed].shape == (401, 64)
    assert shards[0][embed].shape == shards[1][embed].shape == (201, 64)
    assert torch.equal(cat(embed, 0)[:401], full_params[embed])
    assert not shards[1][embed][-1].any()
    norm = "model.norm.weight"
    assert torch.equal(shards[1][norm], full_params[norm])


def test_gpt2_fused_c_attn_splits_by_part(tmp_path: Path) -> None:
    """GPT-2 stores q|k|v fused (and transposed, Conv1D): each rank keeps its heads of each."""
    from transformers import GPT2Config, GPT2LMHeadModel

    path = make_tiny_model_dir(
        GPT2Config, GPT2LMHeadModel, tmp_path, n_embd=64, n_layer=1, n_head=4, n_positions=64
    )
    full = dict(load(path, None).named_parameters())
    name = "transformer.h.0.attn.c_attn.weight"
    shards = [dict(load(path, TensorParallelGroup(r, 2)).named_parameters())[name] for r in (0, 1)]
    for part in range(3):
        whole = torch.cat([s[part * 32 : (part + 1) * 32] for s in shards])
        assert torch.equal(whole, full[name][part * 64 : (part + 1) * 64])


def test_parallel_config_backends() -> None:
    from v1.config import ParallelConfig

    assert ParallelConfig().executor_backend == "uni"
    assert ParallelConfig(1, "ray").executor_backend == "uni"  # nothing to distribute
    assert ParallelConfig(2).executor_backend == "mp"
    assert ParallelConfig(4, "ray").executor_backend == "ray"
    with pytest.raises(ValueError, match="'mp' or 'ray'"):
        ParallelConfig(2, "slurm")
    with pytest.raises(ValueError, match=">= 1"):
        ParallelConfig(0)
