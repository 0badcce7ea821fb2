"""Shared layers against transformers: RoPE variants, activations, norms, fused linears."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from v1.models.layers.activation import SiluAndMul, get_act_fn
from v1.models.layers.linear import MergedColumnLinear, QKVLinear
from v1.models.layers.norm import RMSNorm
from v1.models.layers.rotary import get_rope
from v1.models.utils import load_weights_into

from .hf_reference import tiny_config

HEAD = 16  # tiny_config: hidden 64 / 4 heads

ROPES: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "longrope": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + i / 8 for i in range(HEAD // 2)],
        "long_factor": [2.0 + i for i in range(HEAD // 2)],
        "original_max_position_embeddings": 64,
    },
    # transformers recomputes per batch length; at the longest length both agree.
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
}


def hf_rotate(cfg: Any, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    """transformers' rotation of q [T, H, D], k [T, Hkv, D] at `positions` (one sequence)."""
    rope = LlamaRotaryEmbedding(cfg)
    cos, sin = rope(q, positions[None])
    q_out, k_out = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return q_out[0].transpose(0, 1), k_out[0].transpose(0, 1)


@pytest.mark.parametrize("name", list(ROPES))
def test_rope_matches_transformers(name: str) -> None:
    cfg = tiny_config("llama", rope_parameters=ROPES[name], max_position_embeddings=128)
    num_tokens = 256 if name == "dynamic" else 40  # dynamic: the extended length max*factor
    positions = torch.arange(num_tokens)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(num_tokens, 4, HEAD, generator=gen)
    k = torch.randn(num_tokens, 2, HEAD, generator=gen)
    ref_q, ref_k = hf_rotate(cfg, positions, q, k)
    rope = get_rope(cfg, HEAD)
    # Packed out of order: each token carries its own position.
    perm = torch.randperm(num_tokens, generator=gen)
    out_q, out_k = rope(positions[perm], q[perm].flatten(1), k[perm].flatten(1))
    torch.testing.assert_close(out_q.view(-1, 4, HEAD), ref_q[perm], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_k.view(-1, 2, HEAD), ref_k[perm], atol=1e-5, rtol=1e-5)
    if name in ("yarn", "longrope"):
        assert rope.attention_scaling > 1.0


def test_longrope_switches_to_long_factors_past_the_original_length() -> None:
    params = ROPES["longrope"]
    cfg = tiny_config("llama", rope_parameters=params, max_position_embeddings=128)
    rope = get_rope(cfg, HEAD)
    cos, _ = rope.cos_sin(torch.tensor([63, 64]), torch.float32)  # [2, HEAD]
    exponents = torch.arange(0, HEAD, 2).float() / HEAD
    for row, position, factors in ((0, 63, "short_factor"), (1, 64, "long_factor")):
        inv_freq = 1.0 / (torch.tensor(params[factors]) * params["rope_theta"] ** exponents)
        expected = torch.cos(position * inv_freq) * rope.attention_scaling
        torch.testing.assert_close(cos[row, : HEAD // 2], expected)


def test_unknown_rope_type_is_refused() -> None:
    cfg = tiny_config("llama")
    cfg.rope_parameters = {"rope_type": "spiral", "rope_theta": 1.0}
    with pytest.raises(ValueError, match="unsupported rope_type 'spiral'"):
        get_rope(cfg, HEAD)


@pytest.mark.parametrize("name", ["gelu", "gelu_new", "gelu_pytorch_tanh", "quick_gelu", "silu"])
def test_activations_match_transformers(name: str) -> None:
    x = torch.linspace(-6, 6, 1001)
    torch.testing.assert_close(get_act_fn(name)(x), ACT2FN[name](x), atol=1e-6, rtol=1e-5)


def test_silu_and_mul_and_unknown_activation() -> None:
    gate, up = torch.randn(3, 5), torch.randn(3, 5)
    torch.testing.assert_close(
        SiluAndMul()(torch.cat([gate, up], -1)), torch.nn.functional.silu(gate) * up
    )
    with pytest.raises(ValueError, match="unsupported activation"):
        get_act_fn("swiglu9000")


def test_rmsnorm_fused_residual() -> None:
    norm = RMSNorm(8, eps=1e-6)
    norm.weight.data = torch.linspace(0.5, 2.0, 8)
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    out, new_residual = norm(x, residual)
    total = x + residual
    expected = norm.weight * total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(new_residual, total)
    torch.testing.assert_close(out, expected)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = QKVLinear(4, head_size=2, num_heads=2, num_kv_heads=1, bias=True)
        self.gate_up_proj = MergedColumnLinear(4, [3, 3])


PACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def test_packed_shards_land_on_their_rows() -> None:
    block = _Block()
    q, k, v = torch.full((4, 4), 1.0), torch.full((2, 4), 2.0), torch.full((2, 4), 3.0)
    gate, up = torch.full((3, 4), 4.0), torch.full((3, 4), 5.0)
    weights = [
        ("v_proj.weight", v),
        ("q_proj.weight", q),
        ("k_proj.weight", k),
        ("up_proj.weight", up),
        ("gate_proj.weight", gate),
        ("q_proj.bias", torch.arange(4.0)),
        ("k_proj.bias", torch.arange(2.0)),
        ("v_proj.bias", torch.arange(2.0)),
    ]
    loaded = load_weights_into(block, weights, PACKED)
    assert loaded == {n for n, _ in block.named_parameters()}
    torch.testing.assert_close(block.qkv_proj.weight, torch.cat([q, k, v]))
    torch.testing.assert_close(block.qkv_proj.bias, torch.tensor([0.0, 1, 2, 3, 0, 1, 0, 1]))
    torch.testing.assert_close(block.gate_up_proj.weight, torch.cat([gate, up]))


def test_wrong_shard_shape_is_refused() -> None:
    with pytest.raises(ValueError, match=r"k_proj\.weight.*\(2, 4\).*\(3, 4\)"):
        load_weights_into(_Block(), [("k_proj.weight", torch.zeros(3, 4))], PACKED)
