"""The Triton encoder-only kernel (`ops/triton_encoder_attention.py`) on offsets as the encoder
CUDA graphs replay them: the step's sequences, padding sequences, then empty slots (GPU); and
its tile table (`ops/encoder_tiles.py`, plain torch) naming every query block of every
sequence once."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from v1.attention.ops.encoder_tiles import query_tiles


def _offsets(lens: list[int], num_slots: int, size: int) -> torch.Tensor:
    from v1.worker.encoder_graphs import graph_offsets

    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return torch.from_numpy(graph_offsets(cu, size, num_slots, max_len=512))


def test_tile_table_names_every_query_block_once() -> None:
    cu = _offsets([1, 64, 65, 300, 512], num_slots=12, size=2048)
    tiles = query_tiles(cu, 2048, 64).numpy()
    lens = np.diff(cu.numpy())
    real = tiles[:, tiles[0] < len(lens)]
    expected = [(s, m) for s, n in enumerate(lens) for m in range(-(-int(n) // 64))]
    assert list(map(tuple, real.T)) == expected
    assert tiles.shape[1] >= len(expected) and (tiles[0, real.shape[1] :] == len(lens)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("head_size", [32, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_graph_offsets_match_sdpa_per_sequence(head_size: int, dtype: torch.dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    triton_encoder_attention = pytest.importorskip("v1.attention.ops.triton_encoder_attention")
    lens, size, heads = [7, 512, 64, 130, 1, 255], 2048, 12
    cu = _offsets(lens, num_slots=16, size=size).cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(size, 3, heads, head_size, device="cuda", dtype=dtype, generator=gen)
    q, k, v = qkv.unbind(1)  # strided views, as the models' fused projection gives them
    out = triton_encoder_attention.encoder_attention(q, k, v, cu, head_size**-0.5)
    bounds = cu.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end == start:
            continue
        rows = slice(start, end)
        ref = F.scaled_dot_product_attention(
            *(x[rows].transpose(0, 1).float() for x in (q, k, v)), scale=head_size**-0.5
        ).transpose(0, 1)
        torch.testing.assert_close(out[rows].float(), ref, atol=2e-2, rtol=2e-2)
