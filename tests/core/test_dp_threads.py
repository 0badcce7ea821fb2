"""Data-parallel cores on CPU cap their threads at their share of the host's cores (as tensor-
parallel ranks do): each core process starts with OMP_NUM_THREADS = cores // N and its worker
runs steps with that many torch threads."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from v1 import LLM, SamplingParams
from v1.config import make_engine_config
from v1.core.dp_client import core_device_envs, cpu_threads_per_rank
from v1.worker.worker import Worker


def host_cpus() -> int:
    return len(os.sched_getaffinity(0))


def test_each_cpu_core_gets_its_share_of_the_host(tiny_llama_dir: str) -> None:
    for dp, tp in ((2, 1), (3, 1), (2, 2)):
        config = make_engine_config(
            tiny_llama_dir, device="cpu", data_parallel_size=dp, tensor_parallel_size=tp
        )
        share = max(1, host_cpus() // (dp * tp))
        assert cpu_threads_per_rank(dp * tp) == share
        assert core_device_envs(config) == [{"OMP_NUM_THREADS": str(share)}] * dp


def test_a_data_parallel_worker_runs_with_its_share_of_threads(tiny_llama_dir: str) -> None:
    before = torch.get_num_threads()
    config = make_engine_config(
        tiny_llama_dir, device="cpu", data_parallel_size=2, num_kv_blocks=16
    )
    worker = Worker(config)
    try:
        assert torch.get_num_threads() == min(before, max(1, host_cpus() // 2))
    finally:
        worker.shutdown()
    assert torch.get_num_threads() == before


def test_llm_data_parallel_core_processes_start_with_the_cap(tiny_llama_dir: str) -> None:
    with LLM(
        tiny_llama_dir, device="cpu", data_parallel_size=2, num_kv_blocks=64, block_size=16
    ) as llm:
        pids = llm.llm_engine.engine_core.pids
        assert len(pids) == 2
        for pid in pids:
            env = dict(
                item.split(b"=", 1)
                for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                if b"=" in item
            )
            assert env[b"OMP_NUM_THREADS"] == str(max(1, host_cpus() // 2)).encode()
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        outs = llm.generate(["a b", "c d", "e f"], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
