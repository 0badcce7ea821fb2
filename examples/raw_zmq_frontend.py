"""A frontend that speaks the wire protocol by hand: pyzmq + a generic msgpack codec, no v1 client.

What a frontend in another language does (docs/protocol.md): bind two sockets, start the core
with `python -m v1.engine.core_process`, read the handshake, send ADD / ABORT / UTILITY /
SHUTDOWN frames and decode the positional EngineCoreOutputs arrays.

    python examples/raw_zmq_frontend.py --model DIR    # a decoder-only model folder
    python examples/raw_zmq_frontend.py                # a tiny random Llama, built on the fly
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import msgspec  # used only as a plain msgpack library here
import numpy as np
import zmq

ADD, ABORT, UTILITY, SHUTDOWN = b"\x00", b"\x01", b"\x02", b"\x03"
FINISH_REASONS = {0: "stop", 1: "length", 2: "abort", 3: "error"}


def decode(frames: list[zmq.Frame]) -> Any:
    """Payload frame + aux frames -> plain Python objects; array ext values become ndarrays."""

    def ext_hook(code: int, data: memoryview) -> Any:
        if code != 1:
            raise ValueError(f"unexpected ext type {code}")
        dtype, shape, index = msgspec.msgpack.decode(data)
        return np.frombuffer(frames[index].buffer, dtype=np.dtype(dtype)).reshape(shape)

    return msgspec.msgpack.decode(frames[0].buffer, ext_hook=ext_hook)


def encode(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


def tiny_llama() -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tempfile.mkdtemp(prefix="v1-example-")
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model folder (default: a tiny random Llama)")
    args = parser.parse_args()

    workdir = tempfile.mkdtemp(prefix="v1-raw-")  # mode 0700: only we can reach the sockets
    ctx = zmq.Context()
    to_core = ctx.socket(zmq.PUSH)
    to_core.setsockopt(zmq.SNDHWM, 0)
    to_core.bind(f"ipc://{workdir}/input.sock")
    from_core = ctx.socket(zmq.PULL)
    from_core.setsockopt(zmq.RCVHWM, 0)
    from_core.bind(f"ipc://{workdir}/output.sock")

    # EngineConfig.to_json() layout; sub-configs may list only the fields that differ.
    config = {
        "model_config": {"model": args.model or tiny_llama()},
        "cache_config": {"num_kv_blocks": 256},
        "scheduler_config": {},
        "parallel_config": {},
        "device_config": {"device": "cpu"},
        "enforce_eager": False,
    }
    config_path = os.path.join(workdir, "config.json")
    with open(config_path, "w") as f:
        json.dump(config, f)
    core = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "v1.engine.core_process",
            "--config",
            config_path,
            "--input",
            f"ipc://{workdir}/input.sock",
            "--output",
            f"ipc://{workdir}/output.sock",
        ]
    )
    try:
        if not from_core.poll(600_000):
            raise TimeoutError("no handshake from the EngineCore")
        ready = decode(from_core.recv_multipart(copy=False))
        if ready.get("status", "READY") != "READY":
            raise RuntimeError(f"the EngineCore failed to start: {ready.get('error')}")
        print(f"handshake: {ready}")

        for req_id, prompt, max_tokens in (("a", [1, 15, 27, 3], 6), ("b", [1, 2], 500)):
            request = {
                "request_id": req_id,
                "prompt_token_ids": prompt,
                "sampling_params": {
                    "temperature": 0.0,
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                },
            }
            to_core.send_multipart([ADD, encode(request)])

        tokens: dict[str, list[int]] = {"a": [], "b": []}
        while True:
            outputs, *_ = decode(from_core.recv_multipart(copy=False))
            for out in outputs:
                # [request_id, new_token_ids, logprob ids, logprobs, ranks, pooled, finish, ...]
                req_id, new_ids, finish = out[0], out[1], out[6]
                tokens[req_id] += new_ids
                if req_id == "b" and len(tokens["b"]) >= 4:
                    to_core.send_multipart([ABORT, encode(["b"])])
                if finish is not None:
                    print(f"{req_id} finished ({FINISH_REASONS[finish]}): {tokens[req_id]}")
            if any(o[0] == "a" and o[6] is not None for o in outputs):
                break

        to_core.send_multipart([UTILITY, encode([1, "get_stats", []])])
        while True:
            message = decode(from_core.recv_multipart(copy=False))
            utility = message[3] if len(message) > 3 else None
            if utility is not None and utility["call_id"] == 1:
                stats = utility["result"]
                print(
                    f"b was aborted after {len(tokens['b'])} tokens; core now holds "
                    f"{stats['num_requests']} requests"
                )
                break
        to_core.send_multipart([SHUTDOWN])
        print(f"core exited with code {core.wait(timeout=30)}")
    finally:
        if core.poll() is None:
            core.kill()
        to_core.close(linger=0)
        from_core.close(linger=0)
        ctx.term()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
