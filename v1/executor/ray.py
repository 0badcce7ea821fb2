"""Tensor parallelism across Ray nodes: ranks 1..N-1 as Ray actors in a placement group. Ray
only places and supervises them; steps travel as with the multiprocess executor (msgspec over
ZMQ, TCP on this node's address) and collectives over torch.distributed. Needs the `ray` extra;
connects to the cluster Ray finds (RAY_ADDRESS) or starts a local one.
"""

from __future__ import annotations

import socket
from typing import Any

from v1 import envs
from v1.config import EngineConfig
from v1.executor.multiproc import DistributedExecutor
from v1.executor.worker_proc import WorkerAddresses
from v1.logger import init_logger

logger = init_logger(__name__)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ValueError(
            "distributed_executor_backend='ray' needs Ray: pip install 'v1-engine[ray]'"
        ) from e
    return ray


class _RayWorker:
    """The actor: runs one rank's WorkerProc loop until the core says shutdown."""

    def run(
        self,
        config_json: str,
        rank: int,
        addresses: tuple[str, str],
        init_method: str,
        local_rank: int | None,
    ) -> int:
        from v1.executor.worker_proc import WorkerProc

        proc = WorkerProc(
            EngineConfig.from_json(config_json),
            rank,
            WorkerAddresses(*addresses),
            init_method,
            local_rank,
        )
        proc.run()
        proc.close()
        return rank


class _GpuHolder:
    """Holds rank 0's GPU in the placement group (on this node), so Ray gives the other
    ranks other GPUs; tells which one it is."""

    def gpu_id(self) -> str:
        import ray

        return str(ray.get_gpu_ids()[0])


class RayExecutor(DistributedExecutor):
    """Rank 0 in this process (the EngineCore's); one actor per other rank, one bundle each
    (a GPU on CUDA, a CPU otherwise) in a PACK placement group. On CUDA, bundle 0 is rank 0's
    GPU, pinned to this node and held by a small actor."""

    def __init__(self, config: EngineConfig) -> None:
        self.ray = _import_ray()
        if not self.ray.is_initialized():
            self.ray.init()
        self.node_ip = self.ray.util.get_node_ip_address()
        self.actors: list[Any] = []
        self.run_refs: list[Any] = []
        self.placement_group: Any = None
        self.gpu_holder: Any = None
        self._init_method = f"tcp://{_host(self.node_ip)}:{_free_port(self.node_ip)}"
        super().__init__(config)

    def _endpoint(self, name: str) -> str:
        raise AssertionError("RayExecutor binds TCP ports itself")

    def _bind(self, sock: Any, name: str) -> str:
        port = sock.bind_to_random_port(f"tcp://{_host(self.node_ip)}")
        return f"tcp://{_host(self.node_ip)}:{port}"

    def distributed_init_method(self) -> str:
        return self._init_method

    def _start_workers(self, addresses: list[WorkerAddresses]) -> None:
        from ray.util.placement_group import placement_group

        ray = self.ray
        on_gpu = self.config.device_config.device_type == "cuda"
        bundles = [{"GPU": 1} if on_gpu else {"CPU": 1}] * len(addresses)
        if on_gpu:  # rank 0's GPU first, on this node
            bundles = [{"GPU": 1, f"node:{self.node_ip}": 0.001}, *bundles]
        self.placement_group = placement_group(bundles, strategy="PACK")
        ray.get(self.placement_group.ready())
        first = 0
        if on_gpu:
            holder_cls = ray.remote(num_cpus=0, num_gpus=1)(_GpuHolder)
            self.gpu_holder = holder_cls.options(scheduling_strategy=self._bundle(0)).remote()
            self.local_rank0 = _visible_index(ray.get(self.gpu_holder.gpu_id.remote()))
            first = 1
        num_cpus, num_gpus = (0, 1) if on_gpu else (1, 0)
        actor_cls = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(_RayWorker)
        config_json = self.config.to_json()
        for index, address in enumerate(addresses):
            strategy = self._bundle(first + index)
            actor = actor_cls.options(scheduling_strategy=strategy).remote()
            self.actors.append(actor)
            self.run_refs.append(
                actor.run.remote(
                    config_json,
                    index + 1,
                    (address.input, address.output),
                    self._init_method,
                    0 if on_gpu else None,  # Ray shows each actor its one GPU
                )
            )

    def _bundle(self, index: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group, placement_group_bundle_index=index
        )

    def _exited_worker(self) -> str | None:
        if not self.run_refs:
            return None
        done, _ = self.ray.wait(self.run_refs, num_returns=1, timeout=0)
        if not done:
            return None
        rank = self.run_refs.index(done[0]) + 1
        try:
            self.ray.get(done[0])
            detail = "returned"
        except Exception as e:  # noqa: BLE001 - what killed it is the message
            detail = f"died: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return f"tensor-parallel worker rank {rank} (Ray actor) {detail}"

    def _stop_workers(self) -> None:
        ray = self.ray
        if self.run_refs:
            ray.wait(self.run_refs, num_returns=len(self.run_refs), timeout=2.0)
        for actor in self.actors:
            ray.kill(actor)
        self.actors.clear()
        if self.gpu_holder is not None:
            ray.kill(self.gpu_holder)
            self.gpu_holder = None
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
            self.placement_group = None


def _visible_index(gpu_id: str) -> int:
    """The torch device index of physical GPU `gpu_id` in this process."""
    ids = envs.cuda_visible_devices()
    if not ids:
        return int(gpu_id)
    if gpu_id not in ids:
        raise ValueError(f"Ray gave rank 0 GPU {gpu_id}, not visible here ({','.join(ids)})")
    return ids.index(gpu_id)


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def _free_port(ip: str) -> int:
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        return s.getsockname()[1]
