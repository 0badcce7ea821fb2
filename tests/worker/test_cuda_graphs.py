"""CUDA graphs on CPU: capture sizes, the padded query offsets (one kernel work item per
request, every padding row owned by a single-token request), the static buffers a replay reads
(checked step by step against the eager metadata of real BART and Llama runs: mixed steps,
chunked prefill, preemption), and whole runs with replays emulated (graph_emulation.py) giving
the eager tokens, Whisper's first steps replayed. Real replays: test_gpu_cuda_graphs.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from graph_emulation import EmulatedBackend, EmulatedGraphs
from worker_factories import (
    bart_inputs,
    decoder_request,
    drain,
    llama_prompts,
    make_core,
    make_tiny_bart_dir,
    runner_of,
)

from tests.utils import ASSETS, make_tiny_llama_dir, needs_assets
from v1.attention.backend import AttentionType
from v1.worker.cuda_graphs import (
    CudaGraphManager,
    capture_sizes,
    graph_max_tokens,
    graph_query_start_loc,
    padded,
)

Q_MAX = 16
"""The Triton backend's DECODE_BLOCK_M (not importable without Triton)."""


@pytest.mark.parametrize("max_tokens", [1, 3, 4, 8, 12, 64, 256, 300, 512])
def test_capture_sizes_cover_every_token_count(max_tokens: int) -> None:
    sizes = capture_sizes(max_tokens)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == max_tokens
    for size in sizes[:-1]:
        assert size in (1, 2, 4) or (size < 256 and size % 8 == 0) or size % 16 == 0
    # Padding stays below 8 tokens up to 256, below 16 beyond.
    for a, b in zip(sizes, sizes[1:], strict=False):
        assert b - a <= (8 if b <= 256 else 16)


def test_graph_max_tokens_is_bounded_by_budget_queries_and_cap() -> None:
    assert graph_max_tokens(128, 4096, Q_MAX) == 512
    assert graph_max_tokens(4, 4096, Q_MAX) == 4 * Q_MAX
    assert graph_max_tokens(256, 24, Q_MAX) == 24


def test_padded_fills_after_the_values() -> None:
    out = padded(np.array([5, 7]), 5, -1, np.int64)
    assert out.dtype == np.int64 and out.tolist() == [5, 7, -1, -1, -1]


def kernel_rows(qsl: np.ndarray, block_m: int) -> list[list[int]]:
    """The rows each program of the Triton kernel stores (program i: request i, block 0)."""
    starts, lens = qsl[:-1], np.minimum(np.diff(qsl), block_m)
    return [list(range(s, s + n)) for s, n in zip(starts, lens, strict=True)]


@pytest.mark.parametrize("seed", range(20))
def test_graph_query_start_loc_gives_every_row_one_short_request(seed: int) -> None:
    rng = np.random.default_rng(seed)
    num_reqs = int(rng.integers(1, 12))
    query_lens = rng.integers(1, Q_MAX + 1, size=num_reqs)
    qsl = np.concatenate([[0], np.cumsum(query_lens)])
    num_tokens = int(qsl[-1])
    size = next(s for s in capture_sizes(512) if s >= num_tokens)
    out = graph_query_start_loc(qsl, size)
    assert out.dtype == np.int32 and out.shape == (size + 1,)
    assert out[: num_reqs + 1].tolist() == qsl.tolist()
    lens = np.diff(out)
    # Padding rows are single-token requests (the kernel zeroes them), then empty requests.
    num_pad = size - num_tokens
    assert lens[num_reqs : num_reqs + num_pad].tolist() == [1] * num_pad
    assert not lens[num_reqs + num_pad :].any()
    # One program per request stores each of the `size` rows exactly once.
    rows = sorted(r for program in kernel_rows(out, Q_MAX) for r in program)
    assert rows == list(range(size))


# ---- the static buffers of real steps ----


def graph_manager(runner: Any, cls: type[CudaGraphManager], max_tokens: int) -> Any:
    """A graph manager over the runner's KV groups, batch and decoder forward (as the runner
    builds its own on CUDA)."""
    state = runner.state
    return cls(runner.attn_metadata, runner.input_batch, state.decode_forward, max_tokens, Q_MAX)


def check_buffers(runner: Any, manager: CudaGraphManager, step: Any, size: int) -> None:
    """The buffers `prepare` filled equal what the eager path builds for the real rows, and
    make padding rows read and write nothing."""
    num_tokens, num_reqs = step.num_tokens, len(step.req_ids)
    assert size == min(s for s in manager.sizes if s >= num_tokens)
    assert torch.equal(manager.input_ids[:num_tokens], step.input_ids)
    assert torch.equal(manager.positions[:num_tokens], step.positions)
    qsl = manager.query_start_loc[: size + 1].numpy()
    assert qsl.tolist() == graph_query_start_loc(step.query_start_loc, size).tolist()
    groups = runner.attn_metadata
    eager = groups.decoder(step)
    if groups.group_types.count(AttentionType.ENCODER_DECODER):
        eager.update(runner.state._cross_attn_metadata(step, []))
    for i, attn_type in enumerate(groups.group_types):
        common = eager[groups.group_layers[i][0]].common
        lens = manager.seq_lens[i][:size]
        assert torch.equal(lens[:num_reqs], common.seq_lens)
        assert not lens[num_reqs:].any(), "padding requests must have seq_len 0"
        width = common.block_table.shape[1]
        assert torch.equal(manager.block_tables[i][:num_reqs, :width], common.block_table)
        slots = manager.slot_mappings[i]
        if attn_type == AttentionType.DECODER:
            assert torch.equal(slots[:num_tokens], common.slot_mapping)
            assert (slots[num_tokens:size] == -1).all(), "padding tokens must not write"
        else:
            assert slots is None and common.slot_mapping is None


def run_checked(core: Any, requests: list[Any], max_tokens: int) -> dict[str, int]:
    """Drains the core; before each eager step, fills a CPU graph manager's buffers (no
    capture) when a graph would serve the step and checks them. Returns step counts."""
    runner = runner_of(core)
    manager = graph_manager(runner, CudaGraphManager, max_tokens)
    counts = {"graphed": 0, "mixed": 0, "eager": 0}
    forward = runner.state.forward

    def checked_forward(step: Any, so: Any) -> Any:
        if manager.can_run(step, so):
            check_buffers(runner, manager, step, manager.prepare(step))
            counts["graphed"] += 1
            counts["mixed"] += int(step.num_tokens > len(step.req_ids))
        return forward(step, so)

    runner.state.forward = checked_forward
    drain(core, requests)
    counts["eager"] = manager.num_eager_steps
    return counts


def test_llama_step_buffers_match_the_eager_metadata(tmp_path) -> None:
    path = make_tiny_llama_dir(tmp_path)
    # Budget 20: chunks of up to 20 tokens (some too long for a graph), preemption.
    core = make_core(
        path, num_kv_blocks=10, max_model_len=144, max_num_seqs=4, max_num_batched_tokens=20
    )
    requests = [decoder_request(i, p) for i, p in enumerate(llama_prompts(10))]
    counts = run_checked(core, requests, max_tokens=20)
    assert counts["mixed"] > 0 and counts["eager"] > 0
    assert core.get_stats()["num_preemptions"] > 0


def test_bart_step_buffers_match_the_eager_metadata(tmp_path) -> None:
    path = make_tiny_bart_dir(tmp_path)
    core = make_core(path, num_kv_blocks=24, max_num_seqs=4, max_num_batched_tokens=16)
    requests = [decoder_request(i, dec, enc) for i, (enc, dec) in enumerate(bart_inputs(9))]
    counts = run_checked(core, requests, max_tokens=16)
    # Every step fits (<= 16 tokens): first steps of multi-token prompts mixed with decodes.
    assert counts["eager"] == 0 and counts["mixed"] > 0


# ---- whole runs, replays emulated ----


@pytest.fixture
def emulated_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runners built in the test use the Triton-contract emulation instead of torch SDPA."""
    from v1.attention import selector

    monkeypatch.setitem(selector._BACKENDS, "graph_emulation", "graph_emulation:EmulatedBackend")
    monkeypatch.setattr(
        "v1.worker.model_runner.select_backend", lambda *args, **kwargs: EmulatedBackend
    )


def run_emulated(
    path: str, requests: list[Any], graphs: bool, **overrides: Any
) -> tuple[dict[str, list[int]], EmulatedGraphs | None]:
    core = make_core(path, **overrides)
    runner = runner_of(core)
    assert runner.backend_name == "graph_emulation" and runner.cuda_graphs is None
    manager = None
    if graphs:
        sc = core.config.scheduler_config
        max_tokens = graph_max_tokens(sc.max_num_seqs, sc.max_num_batched_tokens, Q_MAX)
        manager = graph_manager(runner, EmulatedGraphs, max_tokens)
        with torch.inference_mode():
            manager.capture()
        runner.cuda_graphs = manager
    return drain(core, requests), manager


@pytest.mark.usefixtures("emulated_backend")
def test_llama_replays_give_the_eager_tokens(tmp_path) -> None:
    path = make_tiny_llama_dir(tmp_path)
    requests = [decoder_request(i, p) for i, p in enumerate(llama_prompts(10))]
    args = dict(num_kv_blocks=8, max_model_len=112, max_num_seqs=4, max_num_batched_tokens=16)
    eager, _ = run_emulated(path, requests, graphs=False, **args)
    replayed, graphs = run_emulated(path, requests, graphs=True, **args)
    assert replayed == eager
    assert graphs.num_eager_steps == 0 and graphs.num_mixed_replays > 0
    assert graphs.num_replays > graphs.num_mixed_replays


@pytest.mark.usefixtures("emulated_backend")
def test_bart_replays_give_the_eager_tokens(tmp_path) -> None:
    path = make_tiny_bart_dir(tmp_path)
    requests = [decoder_request(i, dec, enc) for i, (enc, dec) in enumerate(bart_inputs(9))]
    # Budget 12: 4-token chunks of recomputed requests next to 1-6 token first steps.
    args = dict(
        num_kv_blocks=9,
        max_model_len=64,  # one longest request (4 + 4 blocks) fits the crowded cache
        max_encoder_input_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=12,
    )
    eager, _ = run_emulated(path, requests, graphs=False, **args)
    replayed, graphs = run_emulated(path, requests, graphs=True, **args)
    assert replayed == eager
    assert graphs.num_eager_steps == 0 and graphs.num_mixed_replays > 0


@needs_assets(ASSETS / "whisper-base")
@pytest.mark.usefixtures("emulated_backend")
def test_whisper_first_steps_replay(tmp_path) -> None:
    from tests.models.test_whisper import make_tiny_whisper_dir, make_waves
    from v1.config import make_engine_config
    from v1.engine.inputs.whisper import WhisperInputBuilder
    from v1.sampling_params import SamplingParams
    from v1.tokenizer import get_tokenizer

    path = make_tiny_whisper_dir(tmp_path / "whisper")
    args = dict(num_kv_blocks=2048, max_num_seqs=3, max_num_encoder_input_tokens=3000)
    model_config = make_engine_config(path, **args).model_config
    builder = WhisperInputBuilder(model_config, get_tokenizer(model_config))
    requests = [
        builder.build(
            f"w{i}",
            {"language": "en", "multi_modal_data": {"audio": (wave, 16_000)}},
            SamplingParams(temperature=0.0, max_tokens=3 + 2 * i),
        )
        for i, wave in enumerate(make_waves(5, seed=6))
    ]
    assert len(requests[0].prompt_token_ids) == 4
    eager, _ = run_emulated(path, requests, graphs=False, **args)
    replayed, graphs = run_emulated(path, requests, graphs=True, **args)
    assert replayed == eager
    # No decoder step ran eagerly: the 4-token first steps replayed, beside decodes too.
    assert graphs.num_eager_steps == 0
    assert graphs.num_mixed_replays >= 3  # at most 2 new requests (audio windows) a step
