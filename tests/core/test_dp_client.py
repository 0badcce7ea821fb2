"""Data parallelism: two EngineCore processes behind one client (tiny random Llama on CPU):
least-loaded routing, encoder-content affinity, aborts to the owning core, summed stats, and
one core's death failing every pending request."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.models.test_whisper import WHISPER_BASE, make_tiny_whisper_dir
from tests.utils import ASSETS, needs_assets
from v1.config import EngineConfig, make_engine_config
from v1.core.dp_client import AsyncDPClient, CoreLoadBalancer, core_device_envs, merge_stats
from v1.core.errors import EngineDeadError
from v1.core.protocol import EncoderInput, EngineCoreRequest
from v1.engine.async_llm import AsyncLLM
from v1.engine.beam_search import BeamSearchParams
from v1.entrypoints.llm import LLM
from v1.entrypoints.openai.metrics import ServerMetrics
from v1.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(240)

PROMPTS = ["The quick brown fox", "Hello world!", "To be or not to be", "A journey of"]


def make_request(req_id: str, content_hash: str | None = None) -> EngineCoreRequest:
    encoder_input = None
    if content_hash is not None:
        encoder_input = EncoderInput(
            num_encoder_tokens=3, content_hash=content_hash, token_ids=[1, 2, 3]
        )
    return EngineCoreRequest(request_id=req_id, prompt_token_ids=[1], encoder_input=encoder_input)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


# ---- routing logic ----
def test_balancer_sends_to_the_core_with_fewest_unfinished_requests():
    lb = CoreLoadBalancer(3)
    assert [lb.assign(make_request(f"r{i}")) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    # Core 2 finished both of its requests, core 0 one: core 2 first, then 0, then in turn.
    assert lb.release(["r2", "r5", "r0"], finished=True) == {2: ["r2", "r5"], 0: ["r0"]}
    assert [lb.assign(make_request(f"s{i}")) for i in range(5)] == [2, 0, 2, 0, 1]
    assert [lb.load(i) for i in range(3)] == [3, 3, 2]


def test_balancer_keeps_the_cores_unfinished_counts_equal():
    """A transcription run sends every clip before the first finishes: each core must get an
    equal share (the stale-report count this replaced let one core of 4 take 9% more than the
    mean on 4 H200s, which alone caps DP 4 at 3.66x). As requests finish in any order, the
    cores' unfinished counts stay within one of each other."""
    lb = CoreLoadBalancer(4)
    for i in range(2048):
        lb.assign(make_request(f"q{i}"))
    assert lb.num_in_flight == [512] * 4
    rng = random.Random(0)
    in_flight = [f"q{i}" for i in range(2048)]
    for i in range(4000):
        lb.release([in_flight.pop(rng.randrange(len(in_flight)))], finished=True)
        lb.assign(make_request(f"s{i}"))
        in_flight.append(f"s{i}")
        assert max(lb.num_in_flight) - min(lb.num_in_flight) <= 1


def test_balancer_keeps_encoder_content_on_one_core_and_forgets_released_requests():
    lb = CoreLoadBalancer(2, affinity_capacity=2)
    assert lb.assign(make_request("a", "h1")) == 0
    assert lb.assign(make_request("b", "h2")) == 1
    # Same audio again: core 0 although it is now the busier one.
    assert lb.assign(make_request("x")) == 0  # (the tie's lower index)
    assert lb.assign(make_request("c", "h1")) == 0
    assert lb.owner == {"a": 0, "b": 1, "x": 0, "c": 0}
    assert lb.release(["a", "c", "unknown"]) == {0: ["a", "c"]}
    assert lb.num_in_flight == [1, 1] and lb.release(["a"]) == {}
    # A bounded map: the oldest hash is dropped (and routed by load again).
    lb.assign(make_request("d", "h3"))
    lb.assign(make_request("e", "h4"))
    assert "h1" not in lb._affinity and len(lb._affinity) == 2


def test_balancer_sends_forks_to_the_core_holding_their_parent():
    lb = CoreLoadBalancer(2)
    step = make_request("p")
    step.hold_kv = True
    assert lb.assign(step) == 0
    lb.assign(make_request("x"))
    lb.release(["x"], finished=True)  # core 1 idle: plain requests would go there
    # The step finished: the core holds its KV, so the balancer keeps knowing where.
    assert lb.release(["p"], finished=True) == {0: ["p"]}
    assert lb.held_owner == {"p": 0} and lb.num_in_flight == [0, 0]
    children = [make_request(f"c{i}") for i in range(3)]
    for child in children:
        child.hold_kv, child.fork_from = True, "p"
    children[-1].last_fork = True  # it releases the parent in the core
    assert [lb.assign(c) for c in children] == [0, 0, 0]
    assert lb.held_owner == {}
    lb.release(["c0", "c1"], finished=True)
    # A held step no request forks from is released by an abort, sent to its core.
    assert lb.release(["c1", "unknown"]) == {0: ["c1"]}
    assert lb.held_owner == {"c0": 0}
    # A step that ended otherwise (aborted, failed) is not held.
    lb.release(["c2"])
    assert lb.held_owner == {"c0": 0} and lb.release(["c2"]) == {}


def test_cuda_cores_get_disjoint_device_slices(tiny_llama_dir: str, monkeypatch):
    config = make_engine_config(tiny_llama_dir, device="cuda", data_parallel_size=2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    assert core_device_envs(config) == [
        {"CUDA_VISIBLE_DEVICES": "3"},
        {"CUDA_VISIBLE_DEVICES": "5"},
    ]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ValueError, match="needs 2 CUDA devices; 1 visible"):
        core_device_envs(config)
    pinned = make_engine_config(tiny_llama_dir, device="cuda:1", data_parallel_size=2)
    with pytest.raises(ValueError, match="own devices"):
        core_device_envs(pinned)
    cpu = make_engine_config(tiny_llama_dir, device="cpu", data_parallel_size=2)
    share = str(max(1, len(os.sched_getaffinity(0)) // 2))  # each CPU core: its thread share
    assert core_device_envs(cpu) == [{"OMP_NUM_THREADS": share}] * 2


def test_data_parallel_size_is_validated(tiny_llama_dir: str):
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1"):
        make_engine_config(tiny_llama_dir, data_parallel_size=0)
    with pytest.raises(ValueError, match="needs the multiprocess engine core"):
        LLM(tiny_llama_dir, device="cpu", data_parallel_size=2, multiprocess=False)


def test_merged_stats_sum_counters_and_recompute_usage():
    a = {
        "num_running_reqs": 2,
        "num_used_blocks": 10,
        "num_total_blocks": 100,
        "kv_cache_usage": 0.1,
    }
    b = {
        "num_running_reqs": 1,
        "num_used_blocks": 50,
        "num_total_blocks": 100,
        "kv_cache_usage": 0.5,
    }
    merged = merge_stats([a, b])
    assert merged["num_running_reqs"] == 3 and merged["num_total_blocks"] == 200
    assert merged["kv_cache_usage"] == pytest.approx(0.3)
    assert merged["data_parallel"] == [a, b]


# ---- two real cores ----
@pytest.fixture(scope="module")
def config(tiny_llama_dir: str) -> EngineConfig:
    return make_engine_config(
        tiny_llama_dir,
        device="cpu",
        block_size=16,
        num_kv_blocks=512,
        max_num_seqs=128,
        data_parallel_size=2,
    )


@pytest.fixture(scope="module")
def engines():
    holder: dict[str, AsyncLLM] = {}
    yield holder
    for llm in holder.values():
        llm.shutdown()


@pytest.fixture
def llm(engines: dict[str, AsyncLLM], config: EngineConfig) -> AsyncLLM:
    """One data-parallel AsyncLLM for the module (restarted if a test killed it)."""
    current = engines.get("llm")
    if current is None or not current.is_running:
        if current is not None:
            current.shutdown()
        current = engines["llm"] = AsyncLLM.from_engine_config(config)
    assert isinstance(current.engine_core, AsyncDPClient)
    return current


async def collect(llm: AsyncLLM, prompt: str, params: SamplingParams, req_id: str) -> list[int]:
    last = None
    async for out in llm.generate(prompt, params, req_id):
        last = out
    assert last is not None and last.finished
    return list(last.outputs[0].token_ids)


async def wait_idle(llm: AsyncLLM, timeout_s: float = 5.0) -> dict[str, Any]:
    """Both cores hold no request and no KV block."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await llm.get_stats()
        cores = stats["data_parallel"]
        idle = all(
            s["num_requests"] == 0 and s["num_kv_requests"] == 0 and s["num_used_blocks"] == 0
            for s in cores
        )
        if idle or time.monotonic() > deadline:
            assert idle, cores
            return stats
        await asyncio.sleep(0.05)


def test_200_concurrent_requests_spread_over_both_cores_and_free_every_block(llm: AsyncLLM):
    async def main() -> dict[str, Any]:
        before = await llm.get_stats()
        results = await asyncio.gather(
            *[collect(llm, PROMPTS[i % 4], greedy(1 + i % 7), f"c{i}") for i in range(200)]
        )
        assert [len(r) for r in results] == [1 + i % 7 for i in range(200)]
        # Greedy on equal weights: a prompt's tokens are the same whichever core ran it.
        longest = {
            p: max((r for i, r in enumerate(results) if i % 4 == p), key=len) for p in range(4)
        }
        assert all(r == longest[i % 4][: len(r)] for i, r in enumerate(results))
        stats = await wait_idle(llm)
        return before, stats

    before, stats = asyncio.run(main())
    cores, cores_before = stats["data_parallel"], before["data_parallel"]
    served = [
        s["prefix_cache_queries"] - b["prefix_cache_queries"]
        for s, b in zip(cores, cores_before, strict=True)
    ]
    assert len(cores) == 2 and all(n > 0 for n in served), served
    assert stats["num_total_blocks"] == sum(s["num_total_blocks"] for s in cores)
    assert llm.engine_core.balancer.owner == {}
    assert llm.engine_core.balancer.num_in_flight == [0, 0]


def test_abort_reaches_the_owning_core_only(llm: AsyncLLM):
    async def main() -> None:
        streams = [llm.generate(PROMPTS[0], greedy(200), f"long{i}") for i in range(2)]
        firsts = [await s.__anext__() for s in streams]
        assert all(not f.finished for f in firsts)
        client = llm.engine_core
        owners = [client.core_of(f"long{i}") for i in range(2)]
        assert sorted(owners) == [0, 1]  # the second went to the idle core
        await llm.abort("long0")
        deadline = time.monotonic() + 5
        while True:
            per_core = (await llm.get_stats())["data_parallel"]
            if per_core[owners[0]]["num_requests"] == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
        assert per_core[owners[0]]["num_requests"] == 0
        assert per_core[owners[1]]["num_requests"] == 1  # the other core's request runs on
        assert client.core_of("long0") is None and client.core_of("long1") == owners[1]
        rest = [out async for out in streams[1]]
        assert rest[-1].finished and len(rest[-1].outputs[0].token_ids) == 200
        await wait_idle(llm)

    asyncio.run(main())


def test_metrics_report_the_union_of_the_cores(llm: AsyncLLM):
    async def main() -> str:
        await wait_idle(llm)
        body, _ = await ServerMetrics("tiny").render(llm)
        return body.decode()

    body = asyncio.run(main())
    per_core = llm.engine_core.cores[0].start_utility("get_stats", []).result(10)
    total = 2 * per_core["num_total_blocks"]  # both cores have the same cache
    assert f'v1_kv_cache_total_blocks{{model_name="tiny"}} {float(total)}' in body, body


def test_killing_one_core_fails_every_pending_request_and_stops_the_other(llm: AsyncLLM):
    async def main() -> list[BaseException | list[int]]:
        tasks = [
            asyncio.ensure_future(collect(llm, PROMPTS[i % 4], greedy(250), f"k{i}"))
            for i in range(8)
        ]
        while len(llm.engine_core.balancer.owner) < 8 or any(
            llm.engine_core.balancer.load(i) == 0 for i in range(2)
        ):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        os.kill(llm.engine_core.pids[0], signal.SIGKILL)
        killed_at = time.monotonic()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert time.monotonic() - killed_at < 2.0
        return results

    other = llm.engine_core.cores[1]
    results = asyncio.run(main())
    # Every request still pending at the kill fails loudly; on a fast (or a slow, loaded)
    # machine one may have finished all its tokens before the kill landed: 250, or what
    # max_model_len leaves after its prompt.
    max_len = llm.model_config.effective_max_model_len
    complete = [
        min(250, max_len - len(llm.tokenizer(PROMPTS[i % 4])["input_ids"])) for i in range(8)
    ]
    dead = [r for r in results if isinstance(r, EngineDeadError)]
    assert dead and all(
        isinstance(r, EngineDeadError) or (isinstance(r, list) and len(r) == complete[i])
        for i, r in enumerate(results)
    ), [r if isinstance(r, EngineDeadError) else len(r) for r in results]
    assert "data-parallel EngineCore 0" in str(dead[0])
    assert llm.errored
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(llm, PROMPTS[0], greedy(2), "after"))
    # No core outlives the engine (short waits: each holds the lock the stopping thread needs).
    deadline = time.monotonic() + 10
    while other.wait_for_exit(timeout=0.1) is None and time.monotonic() < deadline:
        pass
    assert other.wait_for_exit(timeout=0) is not None


def test_offline_llm_with_two_cores_matches_one_core(tiny_llama_dir: str, monkeypatch):
    from v1.core.mp_client import MPClient
    from v1.core.protocol import EngineCoreRequestType

    sent: list[tuple[EngineCoreRequestType, int]] = []
    send = MPClient._send

    def counting_send(self: MPClient, kind: EngineCoreRequestType, payload: Any) -> None:
        sent.append((kind, len(payload) if kind is EngineCoreRequestType.ADD_MANY else 1))
        send(self, kind, payload)

    monkeypatch.setattr(MPClient, "_send", counting_send)
    params = greedy(6)
    prompts = [PROMPTS[i % 4] + " " * (i % 3) for i in range(24)]
    kwargs: dict[str, Any] = dict(device="cpu", block_size=16, num_kv_blocks=256)
    with LLM(tiny_llama_dir, multiprocess=False, **kwargs) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
        beam = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
        expected_beams = [
            [s.token_ids for s in o.sequences] for o in one.beam_search(PROMPTS, beam)
        ]
    with LLM(tiny_llama_dir, data_parallel_size=2, **kwargs) as two:
        got = [o.outputs[0].token_ids for o in two.generate(prompts, params)]
        # Each beam step goes to the core holding its parent's KV and forks it there.
        got_beams = [[s.token_ids for s in o.sequences] for o in two.beam_search(PROMPTS, beam)]
        stats = two.llm_engine.get_stats()
    assert got == expected and got_beams == expected_beams
    # The generate batch's top-ups went out as one ADD_MANY message per core, not one per prompt.
    many = [n for kind, n in sent if kind is EngineCoreRequestType.ADD_MANY]
    assert many and sum(many) >= len(prompts) // 2
    assert stats["num_forks"] == len(PROMPTS) * 5 * 3  # every step after the first, all beams
    assert [s["num_used_blocks"] for s in stats["data_parallel"]] == [0, 0]
    assert [s["num_kv_requests"] for s in stats["data_parallel"]] == [0, 0]
    assert all(s["prefix_cache_queries"] > 0 for s in stats["data_parallel"])


def _num_cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_num_cuda_devices() < 2, reason="needs 2 CUDA GPUs")
def test_two_cores_on_two_gpus_match_one(tiny_llama_dir: str):
    """Each core sees only its own GPU (a CUDA_VISIBLE_DEVICES slice) and both serve."""
    params = greedy(8)
    prompts = [PROMPTS[i % 4] + " " * (i % 5) for i in range(64)]
    kwargs: dict[str, Any] = dict(device="cuda", dtype="float32", enforce_eager=True)
    with LLM(tiny_llama_dir, **kwargs) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    with LLM(tiny_llama_dir, data_parallel_size=2, **kwargs) as two:
        client = two.llm_engine.engine_core
        visible = [Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") for pid in client.pids]
        got = [o.outputs[0].token_ids for o in two.generate(prompts, params)]
        stats = two.llm_engine.get_stats()
    slices = [[v for v in env if v.startswith(b"CUDA_VISIBLE_DEVICES=")] for env in visible]
    assert slices[0] != slices[1] and all(len(s) == 1 for s in slices), slices
    assert got == expected
    assert all(s["prefix_cache_queries"] > 0 for s in stats["data_parallel"])
    assert [s["num_used_blocks"] for s in stats["data_parallel"]] == [0, 0]


@needs_assets(WHISPER_BASE, ASSETS / "audio" / "jfk.flac")
def test_same_audio_goes_to_the_core_that_encoded_it(tmp_path: Path):
    model = make_tiny_whisper_dir(tmp_path / "tiny_whisper")
    clip = str(ASSETS / "audio" / "jfk.flac")
    with LLM(model, device="cpu", data_parallel_size=2) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=4)
        llm.transcribe([clip] * 4, params, language="en", temperature=0.0, use_tqdm=False)
        stats = llm.llm_engine.get_stats()["data_parallel"]
    lookups = sorted(s["num_encoder_lookups"] for s in stats)
    assert lookups == [0, 4]
    assert sum(s["num_encoder_runs"] for s in stats) == 1


def test_serve_and_batch_take_data_parallel_size():
    from v1.entrypoints.cli import engine_kwargs, make_parser

    args = make_parser().parse_args(["serve", "m", "--data-parallel-size", "2"])
    assert engine_kwargs(args) == {"data_parallel_size": 2}
