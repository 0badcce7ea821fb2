"""AsyncLLM over a multiprocess EngineCore running a tiny random Llama: concurrency, abort
storms, id reuse, in-process parity and engine death."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from typing import Any

import pytest

from tests.utils import with_auto_bursts
from v1.config import EngineConfig, make_engine_config
from v1.core.errors import EngineDeadError
from v1.engine.async_llm import AsyncLLM
from v1.engine.llm_engine import LLMEngine
from v1.outputs import RequestOutputKind
from v1.pooling_params import PoolingParams
from v1.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(180)

PROMPTS = ["The quick brown fox", "Hello world!", "To be or not to be", "A journey of"]


@pytest.fixture(scope="module")
def config(tiny_llama_dir: str) -> EngineConfig:
    return make_engine_config(
        tiny_llama_dir, device="cpu", block_size=16, num_kv_blocks=1024, max_num_seqs=256
    )


@pytest.fixture(scope="module")
def engines(config: EngineConfig):
    holder: dict[str, AsyncLLM] = {}
    yield holder
    for llm in holder.values():
        llm.shutdown()


@pytest.fixture
def llm(engines: dict[str, AsyncLLM], config: EngineConfig) -> AsyncLLM:
    """One AsyncLLM for the module (restarted if a test killed it)."""
    current = engines.get("llm")
    if current is None or not current.is_running:
        if current is not None:
            current.shutdown()
        current = engines["llm"] = AsyncLLM.from_engine_config(config)
    return current


def greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


async def stream(
    llm: AsyncLLM,
    prompt: Any,
    params: SamplingParams,
    req_id: str,
    kind: RequestOutputKind = RequestOutputKind.DELTA,
) -> list[int]:
    """Every token id of one request (delta outputs concatenated, or the last cumulative)."""
    token_ids: list[int] = []
    last = None
    async for out in llm.generate(prompt, params, req_id, output_kind=kind):
        last = out
        if kind == RequestOutputKind.DELTA:
            token_ids += out.outputs[0].token_ids
    assert last is not None and last.finished
    return token_ids if kind == RequestOutputKind.DELTA else last.outputs[0].token_ids


async def assert_core_idle(llm: AsyncLLM, timeout_s: float = 5.0) -> None:
    """The core holds no request and no KV block (aborts sent from a closing iterator travel
    on their own, so give them a moment to arrive)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        stats = await llm.get_stats()
        idle = stats["num_requests"] == 0 and stats["num_kv_requests"] == 0
        idle = idle and stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0
        if idle or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.05)
    assert idle, stats


def test_200_concurrent_requests_get_their_token_counts(llm: AsyncLLM):
    async def main() -> None:
        kinds = [
            RequestOutputKind.DELTA,
            RequestOutputKind.CUMULATIVE,
            RequestOutputKind.FINAL_ONLY,
        ]
        results = await asyncio.gather(
            *[
                stream(llm, PROMPTS[i % 4], greedy(1 + i % 9), f"c{i}", kinds[i % 3])
                for i in range(200)
            ]
        )
        assert [len(r) for r in results] == [1 + i % 9 for i in range(200)]
        # equal prompts, greedy: equal tokens whatever the batch or the output kind
        longest = {p: max(results[p::4], key=len) for p in range(4)}
        for i, tokens in enumerate(results):
            assert tokens == longest[i % 4][: len(tokens)]
        await assert_core_idle(llm)

    asyncio.run(main())


def test_abort_storm_frees_everything_and_ids_are_reusable(llm: AsyncLLM):
    async def main() -> None:
        first_output: dict[str, asyncio.Event] = {f"s{i}": asyncio.Event() for i in range(200)}

        async def run(req_id: str, max_tokens: int) -> int:
            n = 0
            async for out in llm.generate(
                PROMPTS[0], greedy(max_tokens), req_id, output_kind=RequestOutputKind.DELTA
            ):
                n += len(out.outputs[0].token_ids)
                first_output[req_id].set()
            return n

        # even ids run long and get cancelled mid-stream; odd ids finish
        tasks = {
            f"s{i}": asyncio.create_task(run(f"s{i}", 200 if i % 2 == 0 else 5)) for i in range(200)
        }
        cancelled = [f"s{i}" for i in range(0, 200, 2)]
        await asyncio.wait_for(
            asyncio.gather(*(first_output[r].wait() for r in cancelled)), timeout=60
        )
        for req_id in cancelled:
            tasks[req_id].cancel()
        done = await asyncio.gather(*tasks.values(), return_exceptions=True)
        for req_id, result in zip(tasks, done, strict=True):
            if req_id in cancelled:
                assert isinstance(result, asyncio.CancelledError) or result == 200
            else:
                assert result == 5
        assert sum(isinstance(r, asyncio.CancelledError) for r in done) >= 90
        await assert_core_idle(llm)
        # every id can be used again at once
        again = await asyncio.gather(*(stream(llm, PROMPTS[1], greedy(3), r) for r in cancelled))
        assert all(len(t) == 3 for t in again)
        await assert_core_idle(llm)

    asyncio.run(main())


def test_closing_or_aborting_a_stream_aborts_the_request(llm: AsyncLLM):
    async def main() -> None:
        gen = llm.generate(PROMPTS[2], greedy(200), "closed", output_kind=RequestOutputKind.DELTA)
        await gen.__anext__()
        await gen.aclose()  # GeneratorExit inside generate()

        async def consume(req_id: str) -> list[Any]:
            return [o async for o in llm.generate(PROMPTS[3], greedy(200), req_id)]

        task = asyncio.create_task(consume("aborted"))
        await asyncio.sleep(0.2)
        await llm.abort("aborted")
        outs = await asyncio.wait_for(task, timeout=30)  # ends without a final output
        assert not outs or not outs[-1].finished
        await assert_core_idle(llm)
        assert len(await stream(llm, PROMPTS[2], greedy(2), "closed")) == 2

    asyncio.run(main())


def test_parallel_sampling_merges_children_and_aborts_them_together(llm: AsyncLLM):
    async def main() -> None:
        params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, ignore_eos=True)
        final = None
        async for out in llm.generate(PROMPTS[0], params, "n3"):
            final = out
        assert final is not None and final.finished and final.request_id == "n3"
        assert sorted(c.index for c in final.outputs) == [0, 1, 2]
        assert all(len(c.token_ids) == 4 for c in final.outputs)
        long = params.clone(max_tokens=200)
        gen = llm.generate(PROMPTS[0], long, "n3", output_kind=RequestOutputKind.DELTA)
        await gen.__anext__()
        await gen.aclose()  # aborts all three children
        await assert_core_idle(llm)

    asyncio.run(main())


def test_duplicate_live_request_id_is_refused(llm: AsyncLLM):
    async def main() -> None:
        first = llm.generate(PROMPTS[0], greedy(50), "dup")
        await first.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await llm.generate(PROMPTS[0], greedy(5), "dup").__anext__()
        async for _ in first:
            pass
        assert len(await stream(llm, PROMPTS[0], greedy(2), "dup")) == 2  # free again

    asyncio.run(main())


def test_wrong_kind_of_request_is_a_value_error(llm: AsyncLLM):
    async def main() -> None:
        with pytest.raises(ValueError, match="not a pooling"):
            await llm.encode("hi", PoolingParams(), "e").__anext__()
        with pytest.raises(ValueError, match="Whisper"):
            await llm.transcribe(b"RIFF")
        with pytest.raises(ValueError):
            await llm.generate("", greedy(2), "empty").__anext__()
        await llm.check_health()

    asyncio.run(main())


def test_same_tokens_in_process_and_multiprocess(llm: AsyncLLM, config: EngineConfig):
    params = [greedy(12), SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)]
    inproc = LLMEngine(config, multiprocess=False)
    try:
        expected: dict[str, list[int]] = {}
        for i, prompt in enumerate(PROMPTS):
            for j, p in enumerate(params):
                inproc.add_request(f"r{i}-{j}", prompt, p)
        while inproc.has_unfinished_requests():
            for out in inproc.step():
                if out.finished:
                    expected[out.request_id] = out.outputs[0].token_ids
    finally:
        inproc.shutdown()

    async def main() -> dict[str, list[int]]:
        ids = [
            (f"r{i}-{j}", prompt, p)
            for i, prompt in enumerate(PROMPTS)
            for j, p in enumerate(params)
        ]
        got = await asyncio.gather(*(stream(llm, pr, p, r) for r, pr, p in ids))
        return {r: t for (r, _, _), t in zip(ids, got, strict=True)}

    assert asyncio.run(main()) == expected
    assert all(len(t) == 12 for t in expected.values())


def test_beam_search_forks_and_a_cancelled_search_frees_its_beams(llm: AsyncLLM):
    """AsyncLLM.beam_search (the server's use_beam_search) forks each beam from its parent's
    KV in the core; cancelling a search midway releases its held and in-flight beams."""
    from v1 import BeamSearchParams

    async def main() -> None:
        before = await llm.get_stats()
        params = BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True)
        done = await llm.beam_search(PROMPTS[0], params, "beam-a")
        stats = await llm.get_stats()
        assert len(done.sequences) == 4
        # 11 steps after the first, 4 beams each: every one forked its parent's KV.
        assert stats["num_forks"] - before["num_forks"] == 11 * 4
        await assert_core_idle(llm)

        long = BeamSearchParams(beam_width=4, max_tokens=200, ignore_eos=True)
        task = asyncio.ensure_future(llm.beam_search(PROMPTS[1], long, "beam-b"))
        while (await llm.get_stats())["num_forks"] < stats["num_forks"] + 12:
            assert not task.done()
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await assert_core_idle(llm)

    asyncio.run(main())


def test_core_death_fails_pending_and_later_requests(llm: AsyncLLM):
    async def main() -> None:
        started = asyncio.Event()

        async def long(req_id: str) -> None:
            async for _ in llm.generate(PROMPTS[0], greedy(240), req_id):
                started.set()

        tasks = [asyncio.create_task(long(f"d{i}")) for i in range(5)]
        await asyncio.wait_for(started.wait(), timeout=60)
        os.kill(llm.engine_core.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=10)
        assert time.monotonic() - killed_at < 2.0
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert llm.errored and not llm.is_running
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError):
            await llm.generate(PROMPTS[0], greedy(2), "later").__anext__()
        with pytest.raises(EngineDeadError):
            await llm.check_health()
        with pytest.raises(EngineDeadError):
            await llm.get_stats()
        assert time.monotonic() - t0 < 1.0  # three calls, none waits on the dead core

    asyncio.run(main())
    llm.shutdown()
    llm.shutdown()


def test_requests_take_the_fair_share_group_of_their_context(llm: AsyncLLM, monkeypatch):
    """The server sets `request_group` per HTTP request: every core request it makes (n
    children included) carries that group; without it each call is its own group."""
    from v1.engine.async_llm import request_group

    sent: list[Any] = []
    original = llm.engine_core.add_request_async

    async def capture(request: Any) -> None:
        sent.append(request)
        await original(request)

    monkeypatch.setattr(llm.engine_core, "add_request_async", capture)

    async def main() -> None:
        token = request_group.set("http-1")
        try:
            await stream(llm, "hello", greedy(2, n=3), "grouped")
        finally:
            request_group.reset(token)
        await stream(llm, "hello", greedy(2), "alone")

    asyncio.run(main())
    groups = {r.request_id: r.group_id for r in sent}
    assert len(groups) == 4
    assert {g for rid, g in groups.items() if rid != "alone"} == {"http-1"}
    assert groups["alone"] == "alone"


def test_decode_bursts_stream_the_same_tokens_in_chunks(llm: AsyncLLM, config: EngineConfig):
    """A multiprocess core with num_scheduler_steps=4 streams each request's tokens several at
    a time (one delta per burst), the same tokens as one token per step."""
    params = [greedy(13), SamplingParams(temperature=1.0, seed=7, max_tokens=11, ignore_eos=True)]
    ids = [
        (f"b{i}-{j}", prompt, p) for i, prompt in enumerate(PROMPTS) for j, p in enumerate(params)
    ]

    async def run(engine: AsyncLLM) -> tuple[dict[str, list[int]], list[int]]:
        sizes: list[int] = []

        async def one(req_id: str, prompt: str, p: SamplingParams) -> list[int]:
            tokens: list[int] = []
            async for out in engine.generate(
                prompt, p, req_id, output_kind=RequestOutputKind.DELTA
            ):
                sizes.append(len(out.outputs[0].token_ids))
                tokens += out.outputs[0].token_ids
            return tokens

        got = await asyncio.gather(*(one(r, pr, p) for r, pr, p in ids))
        await assert_core_idle(engine)
        return {r: t for (r, _, _), t in zip(ids, got, strict=True)}, sizes

    expected, one_at_a_time = asyncio.run(run(llm))
    bursts = AsyncLLM.from_engine_config(
        dataclasses.replace(
            config,
            scheduler_config=dataclasses.replace(config.scheduler_config, num_scheduler_steps=4),
            auto_num_scheduler_steps=False,  # a user's value: streamed requests burst too
        )
    )
    try:
        got, chunks = asyncio.run(run(bursts))
    finally:
        bursts.shutdown()
    assert got == expected and {len(t) for t in got.values()} == {11, 13}
    assert max(one_at_a_time) == 1 and max(chunks) == 4


def test_auto_bursts_run_final_only_requests_and_keep_streams_per_token(
    llm: AsyncLLM, config: EngineConfig
):
    """An auto num_scheduler_steps (a GPU server's: 8, here forced on CPU) runs requests whose
    outputs nobody reads token by token (FINAL_ONLY) in decode bursts, the same tokens as one
    token a step; streamed requests (DELTA) keep one token a delta and get no burst."""
    params = greedy(13)

    async def run(engine: AsyncLLM, kind: RequestOutputKind) -> tuple[list[list[int]], int]:
        before = (await engine.get_stats())["num_decode_bursts"] if engine is not llm else 0
        outs = await asyncio.gather(
            *(
                stream(engine, p, params, f"auto-{kind.name}-{i}", kind)
                for i, p in enumerate(PROMPTS)
            )
        )
        await assert_core_idle(engine)
        return list(outs), (await engine.get_stats())["num_decode_bursts"] - before

    expected, _ = asyncio.run(run(llm, RequestOutputKind.FINAL_ONLY))
    auto = with_auto_bursts(config)
    engine = AsyncLLM.from_engine_config(auto)
    try:
        final, final_bursts = asyncio.run(run(engine, RequestOutputKind.FINAL_ONLY))
        streamed, streamed_bursts = asyncio.run(run(engine, RequestOutputKind.DELTA))

        async def delta_sizes() -> list[int]:
            sizes = []
            async for out in engine.generate(
                PROMPTS[0], params, "auto-sizes", output_kind=RequestOutputKind.DELTA
            ):
                sizes.append(len(out.outputs[0].token_ids))
            return sizes

        sizes = asyncio.run(delta_sizes())
    finally:
        engine.shutdown()
    assert final == expected and streamed == expected
    assert final_bursts > 0 and streamed_bursts == 0
    assert max(sizes) == 1 and sum(sizes) == 13
