"""The fixed-shape sampler (v1/sample/graphed.py) against the general Sampler: same tokens,
logprobs, ranks and Whisper timestamp state, step after step, on the same logits; which
requests it serves; and the engine through `LLM` with it on and off (CPU: it runs eagerly)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sample_factories import Req, make_state

from v1.sample import Sampler, SamplingState, WhisperTokenInfo
from v1.sample.graphed import SamplerGraphs, capture_sizes, dense_sample, row_inputs
from v1.sampling_params import SamplingParams

VOCAB = 80
WHISPER = WhisperTokenInfo(
    eos_token_id=50,
    no_timestamps_token_id=55,
    timestamp_begin=60,
    max_initial_timestamp_index=5,
)

REQS = [
    Req(params=SamplingParams(temperature=0.0, suppress_tokens=[1, 2, 3], logprobs=2)),
    Req(
        params=SamplingParams(
            temperature=0.0, begin_suppress_tokens=[4, 5], min_tokens=3, stop_token_ids=[7]
        ),
        eos_token_id=50,
    ),
    Req(
        params=SamplingParams(
            temperature=0.0, forced_token_ids=[[0, 9], [2, 11]], whisper_timestamps=True
        )
    ),
    Req(
        params=SamplingParams(temperature=0.0, whisper_timestamps=True, logprobs=0),
        prompt=[1, 2, 61],
        outputs=[12, 62],
    ),
    Req(params=SamplingParams(temperature=0.0, forced_eos_token_id=50), max_output_tokens=4),
    # sot sequence (52), <|0.00|> and a forced text prefix: the first token is free.
    Req(params=SamplingParams(temperature=0.0, whisper_timestamps=True), prompt=[52, 60, 7, 8]),
]


def fill(reqs: list[Req], slots: list[int]) -> SamplingState:
    state, _ = make_state(reqs, slots=slots, vocab_size=VOCAB, max_num_reqs=8, whisper=WHISPER)
    return state


def test_dense_sampler_matches_the_general_sampler_step_after_step() -> None:
    slots = [5, 0, 3, 7, 1, 2]
    general, dense = fill(REQS, slots), fill(REQS, slots)
    slots_np = np.array(slots)
    valid = np.array([True, True, True, False, True, True])  # row 3: a prompt chunk, no token
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        # Timestamps win often (scaled) so the pair rules and the forced timestamp all run.
        logits = torch.randn(len(slots), VOCAB, generator=gen) * 3
        logits[:, WHISPER.timestamp_begin :] += 1.5
        want = Sampler()(logits.clone(), general.make_metadata(slots_np))
        flags, forced = row_inputs(dense, slots_np, valid)
        dense.flush()
        got = dense_sample(
            logits.clone(),
            torch.from_numpy(slots_np),
            torch.from_numpy(flags),
            None if forced is None else torch.from_numpy(forced),
            dense,
            2,
            True,
        )
        torch.testing.assert_close(got.sampled_token_ids, want.sampled_token_ids, rtol=0, atol=0)
        torch.testing.assert_close(got.logprob_token_ids, want.logprob_token_ids, rtol=0, atol=0)
        torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=0)
        torch.testing.assert_close(got.ranks, want.ranks, rtol=0, atol=0)
        kept = slots_np[valid]
        general.append_output_tokens(kept, want.sampled_token_ids[torch.from_numpy(valid)])
        dense.count_output_tokens(kept)
        assert torch.equal(dense.timestamps.state_dev[:-1], general.timestamps.state_dev[:-1])
    assert (dense.num_output_tokens == general.num_output_tokens).all()


def test_rules_it_lacks_send_the_step_to_the_general_sampler() -> None:
    plain = SamplingParams(temperature=0.0, logprobs=1)
    others = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, no_repeat_ngram_size=2),
        SamplingParams(temperature=0.0, allowed_token_ids=[1, 2]),
        SamplingParams(temperature=0.0, logit_bias={3: 1.0}),
    ]
    for params in others:
        state = fill([Req(params=plain), Req(params=params)], [0, 1])
        graphs = SamplerGraphs(state, lambda h: h, VOCAB, torch.float32, 4)
        hidden = torch.randn(2, VOCAB)
        assert graphs.run(hidden, torch.arange(1), np.array([0]), np.array([True])) is not None
        assert graphs.run(hidden, torch.arange(2), np.array([0, 1]), np.ones(2, bool)) is None


def test_runs_on_the_rows_it_is_given_and_pads_to_a_size() -> None:
    state = fill([Req(params=SamplingParams(temperature=0.0, suppress_tokens=[0]))] * 3, [0, 1, 2])
    graphs = SamplerGraphs(state, lambda h: h * 2, VOCAB, torch.float32, 8)
    hidden = torch.randn(5, VOCAB)
    hidden[:, 0] = 100.0  # suppressed
    rows = torch.tensor([4, 0, 2])
    out = graphs.run(hidden, rows, np.array([2, 0, 1]), np.ones(3, bool))
    assert out is not None and out.logprobs is None
    want = hidden[rows].clone()
    want[:, 0] = float("-inf")
    assert torch.equal(out.sampled_token_ids, want.argmax(dim=-1))
    assert [k[0] for k in graphs.graphs] == [4]  # 3 rows run on the size-4 entry
    assert capture_sizes(300) == [1, 2, 4, *range(8, 256, 8), 256, 288, 300]


@pytest.fixture
def tiny_llama(tmp_path) -> str:
    from tests.utils import make_tiny_llama_dir

    return make_tiny_llama_dir(tmp_path)


def generate(
    path: str, monkeypatch: pytest.MonkeyPatch, switch: str, device: str = "cpu"
) -> tuple[list, int]:
    from v1 import LLM

    monkeypatch.setenv("V1_SAMPLER_GRAPHS", switch)
    llm = LLM(
        path,
        device=device,
        dtype="float32",
        multiprocess=False,
        max_num_seqs=8,
        num_kv_blocks=64,
    )
    try:
        params = [
            SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, min_tokens=12),
            SamplingParams(temperature=0.0, max_tokens=9, stop_token_ids=[5], min_tokens=3),
            SamplingParams(temperature=0.0, max_tokens=7, forced_eos_token_id=2),
            SamplingParams(temperature=0.8, seed=3, max_tokens=6),  # general sampler
        ]
        prompts = [{"prompt_token_ids": [3 + i, 9, 11 + 2 * i]} for i in range(len(params))]
        outs = llm.generate(prompts, params, use_tqdm=False)
        graphs = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.state
        graphs = graphs.sampler_graphs
        results = [
            (o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].finish_reason)
            for o in outs
        ]
        return results, 0 if graphs is None else graphs.num_replays
    finally:
        llm.shutdown()


def test_llm_outputs_are_the_same_with_the_fixed_shape_sampler(tiny_llama, monkeypatch) -> None:
    on, replays = generate(tiny_llama, monkeypatch, "1")
    off, none = generate(tiny_llama, monkeypatch, "0")
    assert replays > 0 and none == 0
    assert on == off


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sampler_graphs_on_the_gpu_give_the_general_samplers_outputs(
    tiny_llama, monkeypatch
) -> None:
    on, replays = generate(tiny_llama, monkeypatch, "", device="cuda")  # the CUDA default
    off, none = generate(tiny_llama, monkeypatch, "0", device="cuda")
    assert replays > 0 and none == 0
    for (ids, lps, reason), (ids_off, lps_off, reason_off) in zip(on, off, strict=True):
        assert ids == ids_off and reason == reason_off
        if lps is not None:
            for a, b in zip(lps, lps_off, strict=True):
                assert a.keys() == b.keys()
                for t in a:
                    assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_logprobs", [None, 0])
def test_fused_greedy_kernel_gives_the_general_samplers_outputs(dtype, num_logprobs) -> None:
    """On CUDA, steps without timestamp rules or top-N logprobs sample in one Triton kernel
    (bans, forced tokens, argmax, the sampled token's logprob and rank). Whisper's vocabulary,
    padded rows as the LM head leaves them, the general Sampler on the CPU as the reference."""
    vocab = 51_866
    no_ts = [
        Req(params=SamplingParams(temperature=0.0, suppress_tokens=[1, 2, 3], logprobs=0)),
        Req(
            params=SamplingParams(
                temperature=0.0, begin_suppress_tokens=[4, 5], min_tokens=3, stop_token_ids=[7]
            ),
            eos_token_id=50,
        ),
        Req(params=SamplingParams(temperature=0.0, forced_token_ids=[[0, 9], [2, 11]])),
        Req(params=SamplingParams(temperature=0.0, forced_eos_token_id=50), max_output_tokens=2),
    ]
    slots = np.array([3, 0, 1, 2])
    general, _ = make_state(no_ts, slots=slots.tolist(), vocab_size=vocab, max_num_reqs=4)
    dense, _ = make_state(
        no_ts, slots=slots.tolist(), vocab_size=vocab, max_num_reqs=4, device="cuda"
    )
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        padded = (torch.randn(len(slots), vocab + 38, generator=gen) * 4).to(dtype)
        padded[:, [1, 4, 7]] += 30.0  # banned ids would win: the bans must hold
        logits = padded[:, :vocab]  # the LM head's rows are padded to 64 columns
        want = Sampler()(logits.float().clone(), general.make_metadata(slots))
        flags, forced = row_inputs(dense, slots, np.ones(len(slots), dtype=bool))
        dense.flush()
        got = dense_sample(
            logits.cuda(),
            torch.from_numpy(slots).cuda(),
            torch.from_numpy(flags).cuda(),
            None if forced is None else torch.from_numpy(forced).cuda(),
            dense,
            num_logprobs,
            False,
        )
        assert torch.equal(got.sampled_token_ids.cpu(), want.sampled_token_ids)
        if num_logprobs is not None:
            assert torch.equal(got.ranks.cpu(), want.ranks)
            torch.testing.assert_close(got.logprobs.cpu(), want.logprobs, rtol=0, atol=1e-5)
        general.append_output_tokens(slots, want.sampled_token_ids)
        dense.count_output_tokens(slots)
