"""Round trips per second of 1-token requests through the asyncio engine-core client.

Measures the frontend <-> EngineCore path (encode, ZMQ, decode, schedule, output routing), not
the model: by default the core runs a fake executor that samples one token per request at once.

    python benchmarks/client_roundtrip.py                      # fake executor, AsyncMPClient
    python benchmarks/client_roundtrip.py --model DIR          # a real (tiny) model on CPU
    python benchmarks/client_roundtrip.py --model DIR --via asyncllm   # + tokenize/detokenize
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from typing import Any

from v1.config import EngineConfig, make_engine_config
from v1.core.executor import Executor
from v1.core.mp_client import AsyncMPClient
from v1.core.protocol import EngineCoreRequest
from v1.core.sched_output import ModelRunnerOutput, SchedulerOutput
from v1.engine.core_client import CORE_PROGRAM
from v1.kv_cache.spec import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from v1.sampling_params import SamplingParams


class OneTokenExecutor(Executor):
    """Samples token 7 for every request that reaches the end of its prompt: no model."""

    def __init__(self, config: EngineConfig) -> None:
        self.block_size = config.cache_config.block_size

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        return {"layers.0.self_attn": FullAttentionSpec(self.block_size, 1, 8, "float32")}

    def determine_available_kv_bytes(self) -> int:
        return 64 << 20

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        return None

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        req_ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[7] for _ in req_ids])


def tiny_model_dir() -> str:
    """A config-only Llama folder (the fake executor loads no weights)."""
    from transformers import LlamaConfig

    path = tempfile.mkdtemp(prefix="v1-bench-")
    LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=256,
    ).save_pretrained(path)
    return path


async def run_client(client: AsyncMPClient, num_requests: int, concurrency: int) -> float:
    """Seconds to push `num_requests` 1-token requests with at most `concurrency` in flight."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    window = asyncio.Semaphore(concurrency)
    pending: dict[str, asyncio.Future] = {}
    loop = asyncio.get_running_loop()

    async def route_outputs() -> None:
        while True:
            outputs = await client.get_output_async()
            for out in outputs.outputs:
                if out.finished:
                    fut = pending.pop(out.request_id)
                    assert out.error is None, out.error
                    fut.set_result(len(out.new_token_ids))

    async def one(i: int) -> int:
        async with window:
            fut = pending[f"r{i}"] = loop.create_future()
            await client.add_request_async(
                EngineCoreRequest(
                    request_id=f"r{i}", prompt_token_ids=[1, 2, 3, 4], sampling_params=params
                )
            )
            return await fut

    router = asyncio.create_task(route_outputs())
    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(num_requests)))
    elapsed = time.perf_counter() - start
    router.cancel()
    assert counts == [1] * num_requests
    return elapsed


async def run_asyncllm(llm: Any, num_requests: int, concurrency: int) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    window = asyncio.Semaphore(concurrency)

    async def one(i: int) -> int:
        async with window:
            final = None
            async for out in llm.generate("Hello world", params, f"r{i}"):
                final = out
            return len(final.outputs[0].token_ids)

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(num_requests)))
    assert counts == [1] * num_requests
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model folder (default: fake executor, no model)")
    parser.add_argument("--via", choices=("client", "asyncllm"), default="client")
    parser.add_argument("--num-requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=500)
    args = parser.parse_args()
    if args.via == "asyncllm" and args.model is None:
        parser.error("--via asyncllm needs --model (a folder with a tokenizer)")

    config = make_engine_config(
        args.model or tiny_model_dir(),
        device="cpu",
        num_kv_blocks=4096,
        max_num_seqs=max(args.concurrency, 1),
    )
    client_kwargs = {}
    if args.model is None:
        client_kwargs["executor_factory"] = f"{OneTokenExecutor.__module__}:OneTokenExecutor"
        if OneTokenExecutor.__module__ == "__main__":  # the spawned core imports us by file name
            client_kwargs["executor_factory"] = "client_roundtrip:OneTokenExecutor"

    if args.via == "client":
        engine: Any = AsyncMPClient(config, program=CORE_PROGRAM, **client_kwargs)
        run = run_client
    else:
        from v1.engine.async_llm import AsyncLLM

        engine = AsyncLLM.from_engine_config(config, **client_kwargs)
        run = run_asyncllm

    async def bench() -> float:
        await run(engine, args.warmup, args.concurrency)
        return await run(engine, args.num_requests, args.concurrency)

    try:
        elapsed = asyncio.run(bench())
    finally:
        engine.shutdown()
    executor = "fake one-token executor" if args.model is None else args.model
    print(
        f"{args.num_requests / elapsed:,.0f} requests/s of 1-token requests via {args.via} "
        f"({args.num_requests} requests, {args.concurrency} in flight, {executor}): "
        f"{elapsed * 1e6 / args.num_requests:.0f} us each"
    )


if __name__ == "__main__":
    main()
