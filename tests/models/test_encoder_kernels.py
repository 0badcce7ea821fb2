"""The encoder-only step's fused kernels (`v1/models/layers/triton_encoder.py`): BERT's
embeddings (gathers + adds + LayerNorm) and mean pooling (+ L2 normalize), each against its
torch path, the reference. On CPU: the torch paths stay in use (flag on or off), and the
kernels' arithmetic runs under Triton's interpreter when triton is installed; on a GPU: named
shapes, a whole BERT layer stack, CUDA-graph capture, and `LLM.embed` fused vs unfused."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from v1 import envs
from v1.models import bert
from v1.models.layers import pooler as pooler_mod
from v1.models.layers.norm import use_fused_encoder
from v1.models.layers.pooler import PoolingSegments, l2_normalize, pool_tokens

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _minilm():
    """The real all-MiniLM-L6-v2 folder (its config and weights): the shared assets, or the
    copy a device run carries in .bench_assets/minilm; None when neither holds them (a device
    run may carry its tokenizer alone there)."""
    from pathlib import Path

    from tests.utils import ASSETS

    for path in (ASSETS / "all-MiniLM-L6-v2", Path(REPO) / ".bench_assets" / "minilm"):
        if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
            return path
    return None


def _cfg(hidden: int, vocab: int = 50, max_pos: int = 64, types: int = 2) -> SimpleNamespace:
    return SimpleNamespace(
        vocab_size=vocab,
        hidden_size=hidden,
        max_position_embeddings=max_pos,
        type_vocab_size=types,
        layer_norm_eps=1e-12,
        position_embedding_type="absolute",
    )


def _embeddings(hidden: int, device: str, dtype: torch.dtype, **kw) -> bert.BertEmbeddings:
    g = torch.Generator().manual_seed(0)
    emb = bert.BertEmbeddings(_cfg(hidden, **kw))
    with torch.no_grad():
        for p in emb.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        emb.LayerNorm.weight.add_(1.0)
    return emb.to(device=device, dtype=dtype)


def _inputs(num: int, hidden: int, device: str, seed: int = 0, **kw):
    cfg = _cfg(hidden, **kw)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (num,), generator=g)
    pos = torch.randint(0, cfg.max_position_embeddings, (num,), generator=g)
    types = torch.randint(0, cfg.type_vocab_size, (num,), generator=g)
    return ids.to(device), pos.to(device), types.to(device)


def _segments(lengths: list[int], device: str) -> PoolingSegments:
    return PoolingSegments.from_lengths(np.array(lengths, dtype=np.int64), torch.device(device))


def test_cpu_keeps_the_torch_paths(monkeypatch) -> None:
    """On CPU, flag on or off, the torch paths run: the embeddings equal the unfused formula
    and the pooler's mean equals `pool_tokens`."""
    for flag in (True, False):
        monkeypatch.setattr(envs, "V1_FUSED_ENCODER", flag)
        emb = _embeddings(16, "cpu", torch.float32)
        ids, pos, types = _inputs(9, 16, "cpu")
        assert not use_fused_encoder(emb.word_embeddings.weight)
        expected = emb.LayerNorm(
            emb.word_embeddings.weight[ids]
            + emb.position_embeddings.weight[pos]
            + emb.token_type_embeddings.weight[types]
        )
        torch.testing.assert_close(emb(ids, pos, types), expected, rtol=0, atol=0)
        hidden = torch.randn(12, 16)
        assert pooler_mod._fused_mean_mode(hidden, ("mean",)) is None


def test_fused_mode_choice(monkeypatch) -> None:
    """Only a single mean-like mode on a fusable tensor takes the kernel."""
    fake = SimpleNamespace()
    monkeypatch.setattr(pooler_mod, "use_fused_encoder", lambda x: x is fake)
    assert pooler_mod._fused_mean_mode(fake, ("mean",)) == "mean"
    assert pooler_mod._fused_mean_mode(fake, ("mean_sqrt_len",)) == "mean_sqrt_len"
    assert pooler_mod._fused_mean_mode(fake, ("cls",)) is None
    assert pooler_mod._fused_mean_mode(fake, ("mean", "max")) is None
    assert pooler_mod._fused_mean_mode(object(), ("mean",)) is None


@pytest.mark.slow  # a Python start plus Triton's interpreter: ~10-20 s on a loaded 2-core box
def test_encoder_kernels_under_triton_interpreter_match_torch() -> None:
    """The kernels' arithmetic on CPU (Triton's interpreter) in a subprocess
    (TRITON_INTERPRET is read when triton is first imported): `_interpreter_checks`."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = (
        "from tests.models.test_encoder_kernels import _interpreter_checks; _interpreter_checks()"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _interpreter_checks() -> None:
    """fp16: the embeddings bit-exact with the torch path (same rounding points); float32
    within its rounding; pooling within float32 rounding of the reference."""
    from v1.models.layers.triton_encoder import embed_layer_norm_triton, segment_mean_triton

    for dtype, tol in ((torch.float16, 0.0), (torch.float32, 2e-6)):
        for hidden, num in ((24, 7), (48, 33)):  # non-power-of-2 widths, partial row blocks
            emb = _embeddings(hidden, "cpu", dtype)
            ids, pos, types = _inputs(num, hidden, "cpu")
            norm = emb.LayerNorm
            for tt in (types, None):
                ref = _torch_embeddings(emb, ids, pos, tt)
                out = embed_layer_norm_triton(
                    ids,
                    pos,
                    tt,
                    emb.word_embeddings.weight,
                    emb.position_embeddings.weight,
                    emb.token_type_embeddings.weight,
                    norm.weight,
                    norm.bias,
                    norm.eps,
                )
                torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
        lengths = [1, 5, 17, 40, 3]
        hidden = torch.randn(sum(lengths), 3 * 40, dtype=dtype)[:, 40:80]  # strided rows
        seg = _segments(lengths, "cpu")
        for mode in ("mean", "mean_sqrt_len"):
            ref = pool_tokens(hidden, seg, mode)
            for normalize in (False, True):
                out = segment_mean_triton(
                    hidden, seg.query_start_loc, mode == "mean_sqrt_len", normalize
                )
                expected = l2_normalize(ref) if normalize else ref
                torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def _torch_embeddings(emb, ids, pos, types):
    """BertEmbeddings' torch path (the reference), whatever the flag."""
    saved = envs.V1_FUSED_ENCODER
    envs.V1_FUSED_ENCODER = False
    try:
        return emb(ids, pos, types)
    finally:
        envs.V1_FUSED_ENCODER = saved


# ---------------------------------------------------------------- GPU
@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num", [1, 37, 4096, 32768])
@pytest.mark.parametrize("hidden", [384, 768, 1024])
def test_fused_embeddings_match_torch_gpu(dtype, num, hidden) -> None:
    """Within two 16-bit rounding steps of the torch path (the same rounding points; the
    compiled LayerNorm may contract its multiply-add or reduce in another order, moving last
    bits), at least 90% of the elements bit-equal."""
    emb = _embeddings(hidden, "cuda", dtype, vocab=30522, max_pos=512)
    ids, pos, types = _inputs(num, hidden, "cuda", vocab=30522, max_pos=512)
    assert use_fused_encoder(emb.word_embeddings.weight)
    for tt in (types, None):
        out = emb(ids, pos, tt)
        ref = _torch_embeddings(emb, ids, pos, tt)
        step = 2**-10 if dtype == torch.float16 else 2**-7
        torch.testing.assert_close(out, ref, rtol=2 * step, atol=2 * step * 4)
        assert float((out == ref).float().mean()) >= 0.9


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "lengths", [[1], [16, 512, 3, 200], list(range(16, 513, 4)), [512] * 64 + [1] * 64]
)
@pytest.mark.parametrize("hidden", [384, 768, 1024])
def test_fused_mean_pooling_matches_torch_gpu(dtype, lengths, hidden) -> None:
    g = torch.Generator().manual_seed(0)
    full = torch.randn(sum(lengths), 2 * hidden, generator=g).to("cuda", dtype)
    states = full[:, :hidden]  # strided rows, as a view of a larger output
    seg = _segments(lengths, "cuda")
    for mode in ("mean", "mean_sqrt_len"):
        ref = pool_tokens(states, seg, mode)
        for normalize in (False, True):
            out = pooler_mod._segment_mean(states, seg, mode, normalize)
            expected = l2_normalize(ref) if normalize else ref
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@requires_cuda
@pytest.mark.gpu
def test_fused_pooler_groups_gpu(monkeypatch) -> None:
    """The Pooler with the kernel: one group normalized in the kernel, Matryoshka dimensions
    and mixed normalize flags after it, all equal to the torch path's results."""
    from v1.models.layers.pooler import Pooler
    from v1.pooling_config import ModelPoolingConfig
    from v1.pooling_params import PoolingParams

    config = ModelPoolingConfig(pooling_modes=("mean",), normalize=True)
    lengths = [5, 130, 64, 1]
    states = torch.randn(sum(lengths), 384, device="cuda", dtype=torch.float16)
    seg = _segments(lengths, "cuda")
    cases = [
        [PoolingParams(task="embed")] * 4,
        [PoolingParams(task="embed", dimensions=32)] * 4,
        [PoolingParams(task="embed", normalize=False), PoolingParams(task="embed")] * 2,
    ]
    for params in cases:
        monkeypatch.setattr(envs, "V1_FUSED_ENCODER", True)
        fused = Pooler(config)(states, seg, params)
        monkeypatch.setattr(envs, "V1_FUSED_ENCODER", False)
        ref = Pooler(config)(states, seg, params)
        for a, b in zip(fused, ref, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@requires_cuda
@pytest.mark.gpu
def test_llm_embed_fused_matches_unfused_gpu(monkeypatch) -> None:
    """Real MiniLM weights, fp16, CUDA graphs: `LLM.embed` with the kernels against the torch
    paths (flag off), cosine >= 0.9999 for every input (same steps, same GEMMs)."""
    from v1 import LLM

    minilm = _minilm()
    if minilm is None:
        pytest.skip("MiniLM assets not found")
    rng = np.random.default_rng(0)
    prompts = [
        {"prompt_token_ids": [101, *rng.integers(1000, 29000, size=n - 2).tolist(), 102]}
        for n in rng.integers(3, 257, size=96)  # MiniLM takes 256 tokens
    ]
    results = {}
    for flag in (True, False):
        monkeypatch.setattr(envs, "V1_FUSED_ENCODER", flag)
        llm = LLM(str(minilm), dtype="float16", multiprocess=False, max_num_batched_tokens=4096)
        state = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.state
        assert state.graphs is not None  # both run in the encoder's CUDA graphs
        out = llm.embed(prompts, use_tqdm=False)
        results[flag] = np.array([o.outputs.embedding for o in out])
        llm.shutdown()
    cos = (results[True] * results[False]).sum(-1)
    assert cos.min() >= 0.9999, cos.min()


# ---------------------------------------------------------------- cuDNN ragged attention
def _packed_attention_reference(q, k, v, lengths, scale) -> torch.Tensor:
    """Per-sequence float32 softmax attention of packed [T, H, D] rows."""
    out, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start : start + n].float().transpose(0, 1) for x in (q, k, v))
        probs = torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1)
        out.append((probs @ vs).transpose(0, 1))
        start += n
    return torch.cat(out).to(q.dtype)


def _common(lengths: list[int], max_len: int):
    from v1.attention.backend import CommonAttentionMetadata

    offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=offsets.cuda(),
        query_start_loc_cpu=offsets,
        seq_lens=torch.tensor(lengths, dtype=torch.int32).cuda(),
        seq_lens_cpu=torch.tensor(lengths, dtype=torch.int32),
        num_reqs=len(lengths),
        num_actual_tokens=int(sum(lengths)),
        max_query_len=max_len,
        max_seq_len=max_len,
        causal=False,
    )


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "lengths", [[1], [16, 512, 3, 200], list(range(16, 513, 16)), [512] * 8 + [0, 0]]
)
@pytest.mark.parametrize("heads,head_size", [(12, 32), (12, 64), (16, 64)])
def test_cudnn_varlen_matches_reference_gpu(monkeypatch, dtype, lengths, heads, head_size) -> None:
    """`V1_CUDNN_VARLEN`: cuDNN's ragged attention of strided q/k/v views of one fused
    projection (as BERT's qkv chunks) equals per-sequence attention, like flash varlen; empty
    trailing sequences (the encoder graphs' unused slots) are allowed. Skips where cuDNN
    refuses (the backend then keeps flash varlen)."""
    from v1.attention.backend import AttentionType
    from v1.attention.backends import triton as triton_backend

    monkeypatch.setattr(envs, "V1_CUDNN_VARLEN", True)
    monkeypatch.setattr(triton_backend, "_CUDNN_VARLEN_OK", [True])
    scale = head_size**-0.5
    impl = triton_backend.TritonImpl(heads, head_size, scale, heads, AttentionType.ENCODER_ONLY)
    num = sum(lengths)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(num, 3 * heads * head_size, generator=g).to("cuda", dtype)
    q, k, v = (x.view(num, heads, head_size) for x in qkv.chunk(3, dim=-1))
    common = _common(lengths, 512)
    out = impl._cudnn_varlen_forward(q, k, v, common)
    if out is None:
        pytest.skip("cuDNN ragged attention refused on this build/GPU")
    ref = _packed_attention_reference(q, k, v, lengths, scale)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    monkeypatch.setattr(envs, "V1_CUDNN_VARLEN", False)
    flash_out = impl._varlen_forward(q, k, v, common)
    err_cudnn = (out.float() - ref.float()).abs().max()
    err_flash = (flash_out.float() - ref.float()).abs().max()
    assert err_cudnn <= 2 * err_flash + 1e-3, (err_cudnn, err_flash)


@requires_cuda
@pytest.mark.gpu
def test_llm_embed_cudnn_varlen_matches_flash_gpu(monkeypatch) -> None:
    """MiniLM through `LLM.embed`: cuDNN ragged attention (where available; eager steps, as
    its op cannot be captured) against the default (the Triton encoder-only kernel) in CUDA
    graphs, cosine >= 0.9999 for every input."""
    from v1 import LLM
    from v1.attention.backends import triton as triton_backend

    minilm = _minilm()
    if minilm is None:
        pytest.skip("MiniLM assets not found")
    rng = np.random.default_rng(1)
    prompts = [
        {"prompt_token_ids": [101, *rng.integers(1000, 29000, size=n - 2).tolist(), 102]}
        for n in rng.integers(3, 257, size=64)
    ]
    results = {}
    for flag in (True, False):
        monkeypatch.setattr(envs, "V1_CUDNN_VARLEN", flag)
        monkeypatch.setattr(triton_backend, "_CUDNN_VARLEN_OK", [True])
        llm = LLM(str(minilm), dtype="float16", multiprocess=False, max_num_batched_tokens=4096)
        state = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.state
        assert (state.graphs is None) == flag  # cuDNN varlen: eager; flash: graphs
        out = llm.embed(prompts, use_tqdm=False)
        results[flag] = np.array([o.outputs.embedding for o in out])
        if flag and not triton_backend._CUDNN_VARLEN_OK[0]:
            llm.shutdown()
            pytest.skip("cuDNN ragged attention refused on this build/GPU")
        llm.shutdown()
    cos = (results[True] * results[False]).sum(-1)
    assert cos.min() >= 0.9999, cos.min()


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda_graphs"])
def test_pipelined_pooling_launch_never_syncs_gpu(enforce_eager: bool) -> None:
    """The launch of an encoder-only step (input copies, the graphed or eager pass, the fused
    pooling and the pinned copy of its results) makes no synchronizing CUDA call: the host
    prepares the next steps while the device runs (torch's sync debug mode, after a warm-up)."""
    import warnings

    from v1 import LLM

    minilm = _minilm()
    if minilm is None:
        pytest.skip("MiniLM assets not found")
    llm = LLM(
        str(minilm),
        dtype="float16",
        multiprocess=False,
        enforce_eager=enforce_eager,
        max_num_batched_tokens=2048,
    )
    rng = np.random.default_rng(2)
    prompts = [
        {"prompt_token_ids": [101, *rng.integers(1000, 29000, size=n - 2).tolist(), 102]}
        for n in rng.integers(3, 200, size=64)
    ]
    counts: list[int] = []
    try:
        assert llm.config.scheduler_config.max_steps_in_flight == 3
        runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
        launch = runner.execute_model_async
        llm.embed(prompts, use_tqdm=False)  # warm-up: kernels compile outside the count

        def counted(so):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    out = launch(so)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            if so.total_num_scheduled_tokens:
                counts.append(sum("synchronizing CUDA operation" in str(w.message) for w in caught))
            return out

        runner.execute_model_async = counted
        outs = llm.embed(prompts, use_tqdm=False)
        assert len(outs) == len(prompts)
    finally:
        llm.shutdown()
    assert len(counts) >= 3 and counts == [0] * len(counts), counts
