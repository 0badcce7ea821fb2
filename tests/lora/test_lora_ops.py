"""The batched LoRA product against its plain-torch oracle: the CPU grouped path, the masked
(graph-safe) path and, on CUDA, the Triton BGMV kernels; fused layers' block-diagonal B."""

from __future__ import annotations

import pytest
import torch

from v1.lora.ops import add_lora_grouped, add_lora_masked, lora_delta_reference

SHAPES = [(1, 32, 48, 8), (7, 64, 96, 16), (33, 1280, 3840, 48)]
"""(tokens, in, out, rank): decode, a small mixed batch, a Whisper-turbo-sized fused QKV."""


def _case(num_tokens: int, k: int, n: int, r: int, device: str, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(num_tokens + k)
    x = torch.randn(num_tokens, k, generator=gen).to(device, dtype)
    a = (torch.randn(3, r, k, generator=gen) * 0.1).to(device, dtype)
    b = (torch.randn(3, n, r, generator=gen) * 0.1).to(device, dtype)
    idx = torch.randint(-1, 3, (num_tokens,), generator=gen).to(device)
    base = torch.randn(num_tokens, n, generator=gen).to(device, dtype)
    return x, a, b, idx, base


@pytest.mark.parametrize("shape", SHAPES[:2])
@pytest.mark.parametrize("path", [add_lora_grouped, add_lora_masked])
def test_cpu_paths_equal_the_reference(shape: tuple, path) -> None:
    x, a, b, idx, base = _case(*shape, "cpu", torch.float32)
    want = base + lora_delta_reference(x, a, b, idx)
    got = path(base.clone(), x, a, b, idx)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    untouched = idx < 0
    assert torch.equal(got[untouched], base[untouched])  # base-model tokens get nothing


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_bgmv_equals_the_reference(shape: tuple, dtype: torch.dtype) -> None:
    from v1.lora.triton_ops import bgmv_add_lora

    x, a, b, idx, base = _case(*shape, "cuda", dtype)
    want = base.float() + lora_delta_reference(x, a, b, idx)
    got = bgmv_add_lora(base.clone(), x, a, b, idx)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_fused_layer_slot_is_block_diagonal() -> None:
    """A QKV slot: q and v adapted (ranks 2 and 3 under max rank 4), k not: the fused product
    equals the per-projection products side by side, zeros for k."""
    import numpy as np

    from v1.lora.layers import LoRAIndices, LoRALinear
    from v1.lora.targets import LoRATarget

    target = LoRATarget("qkv", 8, (6, 4, 4), encoder_side=False)
    indices = LoRAIndices(4, 4, torch.device("cpu"))
    layer = LoRALinear(target, 2, 4, indices, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    aq, bq = torch.randn(2, 8, generator=gen), torch.randn(6, 2, generator=gen)
    av, bv = torch.randn(3, 8, generator=gen), torch.randn(4, 3, generator=gen)
    layer.set_slot(1, {0: (aq, bq), 2: (av, bv)})
    indices.set(False, np.array([1, -1, 1]))
    x = torch.randn(3, 8, generator=gen)
    out = layer.apply(x, torch.zeros(3, 14))
    want = torch.cat([x @ aq.t() @ bq.t(), torch.zeros(3, 4), x @ av.t() @ bv.t()], dim=1)
    torch.testing.assert_close(out[[0, 2]], want[[0, 2]])
    assert torch.equal(out[1], torch.zeros(14))


# ---- SGMV (tiled) and BGMV kernels on named shapes --------------------------------------

SGMV_CASES = {
    # name: (rows, in, sub-projection output sizes, rank per sub-projection, slot pattern)
    "decode-1-row-fused-qkv": (1, 1280, (1280, 1280, 1280), 16, "interleaved"),
    "mixed-7-rows-rank4": (7, 384, (384,), 4, "interleaved"),
    "prefill-256-rows-fc1-rank16": (256, 1280, (5120,), 16, "short-runs"),
    "encoder-2-clips-fc2-rank8": (3000, 5120, (1280,), 8, "clips"),
    "encoder-2-clips-rank12": (3000, 384, (3840,), 12, "clips"),
    "encoder-16-clips-fused-qkv-rank48": (24000, 1280, (1280, 1280, 1280), 16, "clips"),
    "gqa-fused-uneven-subs": (256, 1280, (1280, 256, 256), 16, "short-runs"),
}
"""`clips`: runs of 1500 rows (`clips:N`: of N) (a Whisper request's encoder rows, 384k rows scaled down to 16
requests) cycling slots -1, 0, 1, 2; `short-runs`: runs of 1..40 rows; `interleaved`: a slot
per row. Slots include -1 (the base model) everywhere."""


def _slot_pattern(num_rows: int, pattern: str, num_slots: int, gen: torch.Generator):
    if pattern == "interleaved":
        return torch.randint(-1, num_slots, (num_rows,), generator=gen)
    if pattern.startswith("clips"):
        clip = int(pattern.partition(":")[2] or 1500)
        lengths = [clip] * (num_rows // clip) + ([num_rows % clip] if num_rows % clip else [])
        slots = [(i % (num_slots + 1)) - 1 for i in range(len(lengths))]
    else:
        lengths, slots, total = [], [], 0
        while total < num_rows:
            length = min(int(torch.randint(1, 41, (1,), generator=gen)), num_rows - total)
            lengths.append(length)
            slots.append(int(torch.randint(-1, num_slots, (1,), generator=gen)))
            total += length
    return torch.repeat_interleave(torch.tensor(slots), torch.tensor(lengths))


def _sgmv_case(name: str, device: str, dtype: torch.dtype, num_slots: int = 3):
    """x, block-diagonal (fused) A/B as `LoRALinear` lays them out, indices, base output."""
    num_rows, k, sub_sizes, sub_rank, pattern = SGMV_CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    n, rank = sum(sub_sizes), sub_rank * len(sub_sizes)
    a = torch.randn(num_slots, rank, k, generator=gen) * 0.1
    b = torch.zeros(num_slots, n, rank)
    row = 0
    for j, size in enumerate(sub_sizes):
        cols = slice(j * sub_rank, (j + 1) * sub_rank)
        b[:, row : row + size, cols] = torch.randn(num_slots, size, sub_rank, generator=gen) * 0.1
        row += size
    x = torch.randn(num_rows, k, generator=gen)
    idx = _slot_pattern(num_rows, pattern, num_slots, gen)
    base = torch.randn(num_rows, n, generator=gen)
    to = {"device": device, "dtype": dtype}
    return x.to(**to), a.to(**to), b.to(**to), idx.to(device), base.to(**to), sub_sizes


def _reference_in_chunks(x, a, b, idx, chunk: int = 2048) -> torch.Tensor:
    """`lora_delta_reference` over row chunks (it gathers each row's A and B: [T, N, R])."""
    parts = [
        lora_delta_reference(x[i : i + chunk], a, b, idx[i : i + chunk])
        for i in range(0, x.shape[0], chunk)
    ]
    return torch.cat(parts)


def _check_kernels(name: str, device: str, dtype: torch.dtype, bgmv: bool = True) -> None:
    """SGMV (fused sub-projections and plain), BGMV (unless not `bgmv`: one interpreted
    program per row is slow) and the `add_lora` dispatch against the reference; rows of slot
    -1 keep their base output bit for bit."""
    from v1.lora.ops import add_lora
    from v1.lora.triton_ops import bgmv_add_lora, sgmv_add_lora

    x, a, b, idx, base, subs = _sgmv_case(name, device, dtype)
    want = base.float() + _reference_in_chunks(x, a, b, idx)
    scale = float(want.abs().max())
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    runs = {
        "sgmv-fused": lambda o: sgmv_add_lora(o, x, a, b, idx, subs, rows_per_run=1500.0),
        "sgmv-plain": lambda o: sgmv_add_lora(o, x, a, b, idx, None, rows_per_run=1.0),
        "bgmv": lambda o: bgmv_add_lora(o, x, a, b, idx),
        "add_lora": lambda o: add_lora(o, x, a, b, idx, rows_per_run=1500.0, sub_sizes=subs),
    }
    if not bgmv:
        del runs["bgmv"]
    for label, run in runs.items():
        got = run(base.clone())
        torch.testing.assert_close(
            got.float(),
            want,
            atol=tol * scale,
            rtol=tol,
            msg=lambda m, label=label: f"{label}: {m}",
        )
        untouched = idx < 0
        assert torch.equal(got[untouched], base[untouched]), label


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(SGMV_CASES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_sgmv_and_bgmv_equal_the_reference(name: str, dtype: torch.dtype) -> None:
    _check_kernels(name, "cuda", dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sgmv_block_sizes_of_every_regime_equal_the_reference() -> None:
    """Every block shape `sgmv_blocks` picks (16/64/128 rows), on one mixed-run case."""
    from v1.lora.triton_ops import sgmv_add_lora

    x, a, b, idx, base, subs = _sgmv_case("gqa-fused-uneven-subs", "cuda", torch.float16)
    want = base.float() + lora_delta_reference(x, a, b, idx)
    for block_m, block_m_expand in ((16, 16), (64, 64), (128, 64), (128, 128)):
        got = sgmv_add_lora(
            base.clone(), x, a, b, idx, subs, block_m=block_m, block_m_expand=block_m_expand
        )
        tol = 2e-3 * float(want.abs().max())
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_lora_in_a_cuda_graph_replays_reading_the_indices_in_place() -> None:
    """A captured decode step (BGMV: capture never takes SGMV, whatever rows_per_run says)
    replays with new slots written into the same indices tensor."""
    from v1.lora.ops import add_lora
    from v1.lora.triton_ops import bgmv_add_lora

    x, a, b, idx, base, subs = _sgmv_case("mixed-7-rows-rank4", "cuda", torch.float16)
    static_idx, out = idx.clone(), base.clone()
    bgmv_add_lora(out, x, a, b, static_idx)  # warm-up: Triton compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(base)
        add_lora(out, x, a, b, static_idx, rows_per_run=1e9, sub_sizes=subs)
    for slots in ([0, 1, 2, -1, 0, 1, 2], [2, 2, 2, 2, -1, -1, 0]):
        static_idx.copy_(torch.tensor(slots, device="cuda"))
        graph.replay()
        want = base.float() + lora_delta_reference(x, a, b, static_idx)
        torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=2e-3)


def test_indices_measure_runs_and_pick_the_kernel_shape() -> None:
    """Encoder rows (1500 per request) run SGMV; decode rows (one per request) BGMV; the
    decoder side starts per-row so CUDA-graph warm-up and capture agree."""
    import numpy as np

    from v1.lora.layers import LoRAIndices
    from v1.lora.ops import SGMV_MIN_ROWS_PER_RUN, use_sgmv

    indices = LoRAIndices(64, 8, torch.device("cpu"))
    assert indices.rows_per_run == {False: 1.0, True: 1.0}
    indices.set(True, np.repeat(np.array([0, 1, -1, 1]), 1500))
    assert indices.rows_per_run[True] == 1500.0 and use_sgmv(indices.rows_per_run[True])
    indices.set(False, np.array([0, 1, 0, -1, 2, 2]))
    assert indices.rows_per_run[False] == 6 / 5 and not use_sgmv(indices.rows_per_run[False])
    indices.set(False, np.zeros(64, dtype=np.int64))  # one adapter, a long prefill
    assert indices.rows_per_run[False] == 64.0 >= SGMV_MIN_ROWS_PER_RUN
    indices.set(False, np.zeros(0, dtype=np.int64))
    assert indices.rows_per_run[False] == 1.0
    assert torch.equal(indices.decoder, torch.full((64,), -1))


INTERPRETER_CASES = {
    # small versions of the named shapes: (rows, in, sub-projection sizes, rank per sub, pattern)
    "one-row": (1, 48, (40, 24, 24), 4, "interleaved"),
    "mixed-rows-rank12": (37, 64, (96,), 12, "interleaved"),
    "short-runs-fused": (150, 64, (48, 32, 32), 8, "short-runs"),
    "runs-of-300": (1300, 32, (48,), 16, "clips:300"),
}


@pytest.mark.slow  # a Python start plus Triton's CPU interpreter: ~40 s on a loaded 2-core box
@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="on a GPU the compiled kernels are tested instead (Triton 3.6's interpreter, on the "
    "H200 image, cannot index a loop bound it loaded from a tensor)",
)
def test_lora_kernels_under_triton_interpreter_equal_the_reference() -> None:
    """The SGMV and BGMV kernels' arithmetic on CPU (Triton's interpreter) in a subprocess
    (TRITON_INTERPRET is read when triton is first imported): `_interpreter_checks`. fp32 and
    fp16 (the interpreter's bf16 tl.dot is wrong; bf16 is checked on the GPU)."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = "from tests.lora.test_lora_ops import _interpreter_checks; _interpreter_checks()"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _interpreter_checks() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    from v1.lora import triton_ops

    assert isinstance(triton_ops._sgmv_shrink_kernel, InterpretedFunction)
    SGMV_CASES.update(INTERPRETER_CASES)
    for name in INTERPRETER_CASES:
        for dtype in (torch.float32, torch.float16):
            _check_kernels(name, "cpu", dtype, bgmv=SGMV_CASES[name][0] <= 200)
    # strided x (a slice of a wider tensor) and every row of the base model
    x, a, b, idx, base, subs = _sgmv_case("short-runs-fused", "cpu", torch.float32)
    wide = torch.randn(x.shape[0], 3 * x.shape[1])
    wide[:, 64:128] = x
    got = triton_ops.sgmv_add_lora(base.clone(), wide[:, 64:128], a, b, idx, subs)
    want = base + lora_delta_reference(x, a, b, idx)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    none = torch.full_like(idx, -1)
    assert torch.equal(triton_ops.sgmv_add_lora(base.clone(), x, a, b, none, subs), base)
    _check_lora_linear_layout(triton_ops.sgmv_add_lora)


def _check_lora_linear_layout(sgmv) -> None:
    """`LoRALinear`'s slots (GQA-like uneven q/k/v, ranks 3 and 5 under max rank 8, k not
    targeted in one slot) through SGMV with the layer's sub-projection sizes equal the CPU
    grouped path: the layout SGMV's expand relies on (sub j owns ranks [j*8, j*8 + 8))."""
    import numpy as np

    from v1.lora.layers import LoRAIndices, LoRALinear
    from v1.lora.ops import add_lora_grouped
    from v1.lora.targets import LoRATarget

    target = LoRATarget("qkv", 32, (48, 16, 16), encoder_side=True)
    indices = LoRAIndices(4, 64, torch.device("cpu"))
    layer = LoRALinear(target, 3, 8, indices, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    for slot, rank, subs in ((0, 3, (0, 1, 2)), (2, 5, (0, 2))):
        layer.set_slot(
            slot,
            {
                j: (torch.randn(rank, 32, generator=gen), torch.randn(size, rank, generator=gen))
                for j, size in enumerate(target.output_sizes)
                if j in subs
            },
        )
    slots = np.repeat(np.array([2, -1, 0, 2, 1]), [20, 5, 17, 1, 7])  # slot 1: empty (zeros)
    indices.set(True, slots)
    idx = indices.rows(True, len(slots))
    x, base = torch.randn(len(slots), 32, generator=gen), torch.randn(len(slots), 80, generator=gen)
    want = add_lora_grouped(base.clone(), x, layer.lora_a, layer.lora_b, idx)
    got = sgmv(base.clone(), x, layer.lora_a, layer.lora_b, idx, target.output_sizes, 50.0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
