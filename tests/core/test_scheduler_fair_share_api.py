"""Fair shares and priorities through AsyncLLM (a multiprocess core, a tiny random Llama):
a small request sent while an n=large request fills every running slot finishes within a
bounded number of engine steps (counted by the large request's tokens, one per step), and under
`scheduling_policy` priority a high-priority request overtakes the queue."""

from __future__ import annotations

import asyncio

import pytest

from v1.config import make_engine_config
from v1.engine.async_llm import AsyncLLM
from v1.outputs import RequestOutputKind
from v1.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(180)

MAX_NUM_SEQS = 8


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def make_llm(model_dir: str, **overrides) -> AsyncLLM:
    args = dict(device="cpu", block_size=16, num_kv_blocks=512, max_num_seqs=MAX_NUM_SEQS)
    config = make_engine_config(model_dir, **{**args, **overrides})
    return AsyncLLM.from_engine_config(config)


def test_a_small_request_finishes_in_bounded_steps_beside_an_n_large_request(
    tiny_llama_dir: str,
) -> None:
    llm = make_llm(tiny_llama_dir)
    big_max_tokens, small_max_tokens = 80, 5

    async def main() -> tuple[int, list[int]]:
        big_tokens = [0] * MAX_NUM_SEQS  # tokens each child has so far (one per engine step)
        started = asyncio.Event()
        small_done_at: list[int] = []

        async def big() -> None:
            params = greedy(big_max_tokens, n=MAX_NUM_SEQS)
            async for out in llm.generate(
                "hello", params, "big", output_kind=RequestOutputKind.DELTA
            ):
                for completion in out.outputs:
                    big_tokens[completion.index] += len(completion.token_ids)
                if sum(big_tokens) >= MAX_NUM_SEQS:
                    started.set()

        async def small() -> int:
            await started.wait()  # every slot is taken by the big request's children now
            sent_at = max(big_tokens)
            async for out in llm.generate("hi", greedy(small_max_tokens), "small"):
                if out.finished:
                    small_done_at.append(max(big_tokens))
                    assert len(out.outputs[0].token_ids) == small_max_tokens
            return sent_at

        big_task = asyncio.create_task(big())
        sent_at = await small()
        await big_task
        return sent_at, small_done_at

    try:
        sent_at, (done_at,) = asyncio.run(main())
    finally:
        llm.shutdown()
    # Without fair shares the small request waits for a big child to finish (~80 steps).
    assert done_at - sent_at <= small_max_tokens + 10, (sent_at, done_at)


def test_priority_policy_lets_a_high_priority_request_overtake_the_queue(
    tiny_llama_dir: str,
) -> None:
    llm = make_llm(tiny_llama_dir, policy="priority", max_num_seqs=1)

    async def main() -> list[str]:
        finished: list[str] = []
        first_token = asyncio.Event()

        async def run(req_id: str, max_tokens: int, priority: int) -> None:
            async for out in llm.generate(
                "hello",
                greedy(max_tokens),
                req_id,
                priority=priority,
                output_kind=RequestOutputKind.DELTA,
            ):
                first_token.set()
                if out.finished:
                    finished.append(req_id)

        head = asyncio.create_task(run("head", 120, 0))
        await first_token.wait()  # "head" holds the only slot; the others queue behind it
        queued = [asyncio.create_task(run(f"low{i}", 3, 5)) for i in range(3)]
        await asyncio.sleep(0.05)
        urgent = asyncio.create_task(run("urgent", 3, -1))
        await asyncio.gather(head, urgent, *queued)
        return finished

    try:
        finished = asyncio.run(main())
    finally:
        llm.shutdown()
    assert finished[:2] == ["head", "urgent"], finished


def test_one_offline_batch_is_one_group_and_is_never_preempted_for_fairness(
    tiny_llama_dir: str,
) -> None:
    """LLM.generate is one client: every core request of a call (n children included) reaches
    the core in one fair-share group, so fair shares never preempt between its own prompts."""
    from v1 import LLM

    with LLM(tiny_llama_dir, multiprocess=False, num_kv_blocks=128, max_num_seqs=4) as llm:
        core = llm.llm_engine.engine_core
        groups: list[str | None] = []
        add_request = core.add_request

        def spy(request):
            groups.append(request.group_id)
            return add_request(request)

        core.add_request = spy
        outs = llm.generate(["a b c", "d e", "f"] * 4, greedy(6, n=2), use_tqdm=False)
        stats = llm.llm_engine.get_stats()
    assert all(len(c.token_ids) == 6 for o in outs for c in o.outputs)
    assert len(groups) == 24 and len(set(groups)) == 1 and groups[0] is not None
    assert stats["num_preemptions"] == 0
