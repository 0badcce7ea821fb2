"""Pipelined generation steps (async_scheduling) give exactly what synchronous steps give.

Step N+1 is launched before step N's tokens reach the host; the tokens feed N+1 on the device and
every sampling rule reads device state. For Llama, BART, T5 and Whisper (tiny random models and
the real whisper-base): greedy, seeded sampling, stop strings, min_tokens, n>1, penalties,
preemption under a tiny KV cache and aborts mid-run all give identical tokens, and every KV block
is free afterwards. With `max_steps_in_flight` 3 or 4, more steps are in flight when a request is
preempted: one re-admitted before they are read back must not take their stale rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.utils import (
    ASSETS,
    ONE_TORCH_THREAD,
    WHISPER_BASE,
    make_tiny_bart_dir,
    make_tiny_llama_dir,
    make_tiny_t5_dir,
    make_tiny_whisper_dir,
)
from v1 import LLM, SamplingParams

pytestmark = ONE_TORCH_THREAD

ENGINE_ARGS = dict(
    multiprocess=False, block_size=4, max_num_seqs=4, max_num_batched_tokens=24, max_model_len=64
)
"""A small budget (chunked prefill) and few slots; `num_kv_blocks` is set per model so that
the batch preempts."""

PARAMS = [
    SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=11, max_tokens=12),
    SamplingParams(temperature=0, max_tokens=16, stop=["e", "o", " ", "a", "m", "9"], min_tokens=3),
    SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=10, repetition_penalty=1.3),
    SamplingParams(temperature=0, max_tokens=12, no_repeat_ngram_size=2, frequency_penalty=0.4),
    SamplingParams(temperature=0.7, seed=9, min_tokens=6, max_tokens=9, logprobs=2),
]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("llama"), initializer_range=0.2)


@pytest.fixture(scope="module")
def bart_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("bart")
    return make_tiny_bart_dir(path, init_std=0.2)


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("t5")
    return make_tiny_t5_dir(
        path,
        add_bos=True,
        seed=2,
        num_decoder_layers=2,
        relative_attention_num_buckets=16,
        relative_attention_max_distance=24,
        feed_forward_proj="relu",
        initializer_factor=5.0,
    )


def prompts(kind: str) -> list[Any]:
    texts = [
        "the quick brown fox jumps over the lazy dog " * (1 + k % 2) + str(k) for k in range(6)
    ]
    return texts


def count_bursts(llm: LLM) -> list[int]:
    """The num_decode_steps of every step the engine's scheduler hands out from now on."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    make_output = scheduler._make_output
    steps: list[int] = []

    def counted(*args: Any) -> Any:
        out = make_output(*args)
        steps.append(out.num_decode_steps)
        return out

    scheduler._make_output = counted
    return steps


def run(model: str, async_scheduling: bool, requests: list[Any], **kwargs: Any):
    """({request index: [(token ids, finish reason, text)]}, stats) of one engine."""
    with LLM(model, async_scheduling=async_scheduling, **(ENGINE_ARGS | kwargs)) as llm:
        steps = count_bursts(llm)
        outputs = llm.generate(
            [p for p, _ in requests], [params for _, params in requests], use_tqdm=False
        )
        results = [
            [(list(c.token_ids), c.finish_reason, c.text, c.logprobs) for c in out.outputs]
            for out in outputs
        ]
        return results, llm.llm_engine.get_stats() | {"num_bursts": sum(n > 1 for n in steps)}


def strip_logprobs(results: list[Any]) -> list[Any]:
    return [[c[:3] for c in out] for out in results]


def assert_logprobs_close(a: list[Any], b: list[Any]) -> None:
    """Same ids and ranks; values equal up to float rounding (a pipelined step may batch
    differently, which changes CPU matmul blocking in the last bits)."""
    for out_a, out_b in zip(a, b, strict=True):
        for ca, cb in zip(out_a, out_b, strict=True):
            assert (ca[3] is None) == (cb[3] is None)
            for pa, pb in zip(ca[3] or [], cb[3] or [], strict=True):
                assert pa.keys() == pb.keys()
                for token, lp in pa.items():
                    assert lp.rank == pb[token].rank
                    assert abs(lp.logprob - pb[token].logprob) < 1e-4 * max(1.0, abs(lp.logprob))


def assert_idle(stats: dict[str, Any]) -> None:
    assert stats["num_requests"] == 0 and stats["num_kv_requests"] == 0
    assert stats["num_used_blocks"] == 0, stats


@pytest.mark.parametrize(
    "model,depth,steps,pipelined",
    [
        ("llama", 2, 1, True),
        ("bart", 2, 1, True),
        ("t5", 2, 1, True),
        ("llama", 3, 1, True),
        ("bart", 3, 1, True),
        ("llama", 4, 1, True),
        ("llama", 2, 4, True),
        ("llama", 2, 3, False),
        ("llama", 3, 4, True),
        ("bart", 2, 4, True),
        ("t5", 2, 3, True),
    ],
)
def test_pipelined_generation_is_token_identical(
    model: str,
    depth: int,
    steps: int,
    pipelined: bool,
    llama_dir: str,
    bart_dir: str,
    t5_dir: str,
) -> None:
    """`steps` > 1: decode bursts (num_scheduler_steps), here against one token per step."""
    path = {"llama": llama_dir, "bart": bart_dir, "t5": t5_dir}[model]
    requests = [(p, PARAMS[i % len(PARAMS)]) for i, p in enumerate(prompts(model) * 2)]
    kwargs: dict[str, Any] = {"num_kv_blocks": 17}
    if model != "llama":  # one maximal request (decoder + cross blocks) fits 23 blocks
        kwargs = {"num_kv_blocks": 24, "max_model_len": 32, "max_encoder_input_len": 48}
    sync, _ = run(path, False, requests, **kwargs)
    piped, stats = run(
        path,
        pipelined,
        requests,
        max_steps_in_flight=depth,
        num_scheduler_steps=steps,
        **kwargs,
    )
    assert strip_logprobs(piped) == strip_logprobs(sync)
    assert_logprobs_close(piped, sync)
    assert stats["num_preemptions"] > 0  # the tiny cache preempted while steps were in flight
    assert (stats["num_bursts"] > 0) == (steps > 1)
    assert_idle(stats)
    reasons = {c[1] for out in sync for c in out}
    assert reasons >= ({"length"} if model == "t5" else {"length", "stop"}), reasons


def test_abort_mid_run_frees_every_block(llama_dir: str) -> None:
    with LLM(
        llama_dir,
        **(ENGINE_ARGS | dict(async_scheduling=True, num_kv_blocks=40, max_model_len=128)),
    ) as llm:
        engine = llm.llm_engine
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        for i, text in enumerate(prompts("llama")):
            engine.add_request(f"r{i}", text, params)
        finished: dict[str, Any] = {}
        for step in range(40):
            if step == 6:
                engine.abort_request(["r0", "r3", "r5"])
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            if not engine.has_unfinished_requests():
                break
        assert set(finished) == {"r1", "r2", "r4"}
        assert all(len(o.outputs[0].token_ids) == 30 for o in finished.values())
        engine.step()  # lets the runner drop the last finished requests
        assert_idle(engine.get_stats())
        # The same requests again, unaborted, give the same tokens as the first run.
        again = llm.generate([prompts("llama")[i] for i in (1, 2, 4)], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [
            finished[r].outputs[0].token_ids for r in ("r1", "r2", "r4")
        ]


def test_whisper_tiny_pipelined_is_token_identical(tmp_path: Path) -> None:
    if not WHISPER_BASE.is_dir():
        pytest.skip(f"needs {WHISPER_BASE}")
    path = make_tiny_whisper_dir(tmp_path / "whisper")
    rng = torch.Generator().manual_seed(0)
    clips = [(torch.randn(16000 * (2 + i), generator=rng).numpy() * 0.1, 16000) for i in range(5)]
    results = []
    bursts = []
    for async_scheduling, steps in ((False, 1), (True, 1), (True, 4)):
        with LLM(
            path, async_scheduling=async_scheduling, num_scheduler_steps=steps, **ENGINE_ARGS
        ) as llm:
            counted = count_bursts(llm)
            outs = llm.transcribe(
                clips,
                SamplingParams(temperature=0, max_tokens=20),
                timestamps=True,
                temperature=0.0,
            )
            results.append([(o.text, [s.text for s in o.segments]) for o in outs])
            assert_idle(llm.llm_engine.get_stats())
            bursts.append(sum(n > 1 for n in counted))
    assert results[0] == results[1] == results[2]
    assert bursts[0] == bursts[1] == 0 and bursts[2] > 0


@pytest.mark.skipif(not WHISPER_BASE.is_dir(), reason=f"needs {WHISPER_BASE}")
def test_real_whisper_base_pipelined_transcripts_with_timestamps() -> None:
    # The two short LibriSpeech clips (4.7 s each): a batch of two real transcriptions whose
    # requests end at different steps; JFK's 11 s only made the three runs slower.
    clips = sorted(str(p) for p in (ASSETS / "audio" / "librispeech").glob("*.flac"))
    assert len(clips) == 2
    results = []
    for async_scheduling, steps in ((False, 1), (True, 1), (True, 8)):
        with LLM(
            str(WHISPER_BASE),
            async_scheduling=async_scheduling,
            num_scheduler_steps=steps,
            multiprocess=False,
        ) as llm:
            outs = llm.transcribe(clips, timestamps=True)
            results.append([(o.text, [(s.start, s.end, s.text) for s in o.segments]) for o in outs])
    assert results[0] == results[1] == results[2]
    assert "A man said to the universe, Sir, I exist." in results[1][0][0]
    assert "Mr. Quilter's manner" in results[1][1][0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model", ["llama", "whisper"])
def test_decode_bursts_on_gpu_replay_graphs_token_identical(
    model: str, llama_dir: str, tmp_path: Path
) -> None:
    """On CUDA (decoder and sampler graphs, pipelined steps) a burst of 4 decode steps gives
    the tokens of one step at a time (fp32, equal lengths: the same rows in every step)."""
    kwargs: dict[str, Any] = dict(
        device="cuda",
        dtype="float32",
        multiprocess=False,
        num_kv_blocks=1024,  # no memory profile: a fixed pool
        max_num_seqs=8,
        max_num_batched_tokens=512,
    )
    if model == "llama":
        inputs: Any = prompts("llama")
        params = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)
    else:
        if not WHISPER_BASE.is_dir():
            pytest.skip(f"needs {WHISPER_BASE}")
        path = make_tiny_whisper_dir(tmp_path / "whisper")
        rng = torch.Generator().manual_seed(1)
        inputs = [(torch.randn(16000 * 5, generator=rng).numpy() * 0.1, 16000) for _ in range(6)]
        params = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)
    results, bursts = [], []
    for steps in (1, 4):
        with LLM(
            llama_dir if model == "llama" else path, num_scheduler_steps=steps, **kwargs
        ) as llm:
            counted = count_bursts(llm)
            if model == "llama":
                outs = llm.generate(inputs, params, use_tqdm=False)
                results.append([o.outputs[0].token_ids for o in outs])
            else:
                outs = llm.transcribe(inputs, params, language="en", temperature=0.0)
                results.append([[s.tokens for s in o.segments] for o in outs])
            bursts.append(sum(n > 1 for n in counted))
            assert_idle(llm.llm_engine.get_stats())
    assert results[0] == results[1]
    assert bursts[0] == 0 and bursts[1] > 0
