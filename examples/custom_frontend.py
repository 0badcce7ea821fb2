"""A custom frontend: drive an EngineCore process through SyncMPClient with hand-built requests.

No tokenizer, no LLM class: token ids in, token ids out. This is the layer to embed the engine
in another program (docs/protocol.md describes the same exchange on the wire).

    python examples/custom_frontend.py                 # a tiny random Llama, built on the fly
    python examples/custom_frontend.py --model DIR     # any decoder-only model folder
"""

from __future__ import annotations

import argparse
import tempfile

from v1.config import make_engine_config
from v1.core.mp_client import SyncMPClient
from v1.core.protocol import EngineCoreRequest, FinishReason
from v1.engine.core_client import CORE_PROGRAM
from v1.sampling_params import SamplingParams


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
    config = make_engine_config(args.model or tiny_llama(), device="cpu", num_kv_blocks=256)

    client = SyncMPClient(
        config, program=CORE_PROGRAM
    )  # starts the core program and waits for its handshake
    try:
        print(
            f"core pid {client.pid}: {client.num_kv_blocks} KV blocks, "
            f"max_model_len {client.max_model_len}"
        )
        requests = [
            EngineCoreRequest(
                request_id="greedy",
                prompt_token_ids=[1, 15, 27, 3],
                sampling_params=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
            ),
            EngineCoreRequest(
                request_id="sampled",
                prompt_token_ids=[1, 9, 9, 4],
                sampling_params=SamplingParams(
                    temperature=0.8, seed=42, max_tokens=6, logprobs=2, ignore_eos=True
                ),
            ),
            EngineCoreRequest(
                request_id="aborted",
                prompt_token_ids=[1, 2],
                sampling_params=SamplingParams(max_tokens=200, ignore_eos=True),
            ),
        ]
        for request in requests:
            client.add_request(request)

        tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
        running = {"greedy", "sampled"}
        while running:
            outputs = client.get_output(timeout=60)
            for out in outputs.outputs:
                tokens[out.request_id] += out.new_token_ids
                if out.new_logprobs:
                    print(
                        f"  {out.request_id}: token {out.new_token_ids[0]} "
                        f"logprob {out.new_logprobs[0][0]:.3f} rank {out.new_logprob_ranks[0]}"
                    )
                if out.request_id == "aborted" and len(tokens["aborted"]) >= 3:
                    client.abort_requests(["aborted"])  # no further output for it
                if out.finished:
                    running.discard(out.request_id)
                    reason = FinishReason(out.finish_reason)
                    print(f"{out.request_id} finished ({reason}): {tokens[out.request_id]}")
        print(f"aborted after {len(tokens['aborted'])} tokens")
        stats = client.call_utility("get_stats")
        print(
            f"core: {stats['num_requests']} requests left, "
            f"{stats['num_used_blocks']} KV blocks in use"
        )
    finally:
        client.shutdown()


if __name__ == "__main__":
    main()
