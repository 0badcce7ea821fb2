"""LoRA through the OpenAI-compatible server (`v1 serve --enable-lora --lora-modules`): the
`model` field picks the adapter, `/v1/models` lists adapters, `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter` change them at run time, bad adapters get 400 and the server keeps
serving."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch

from tests.entrypoints.openai.conftest import RemoteServer
from tests.lora.conftest import LLAMA_TARGETS, make_adapter, peft_greedy

PROMPT = [1, 5, 9, 13, 17, 2, 8]
NUM_TOKENS = 6


def _text(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=NUM_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert out.model == model
    return out.choices[0].text


def _peft_text(llama_dir: str, adapter: str | None) -> str:
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokens = peft_greedy(LlamaForCausalLM, llama_dir, adapter, NUM_TOKENS, input_ids=PROMPT)
    return AutoTokenizer.from_pretrained(llama_dir).decode(tokens, skip_special_tokens=True)


def test_server_serves_loads_and_unloads_adapters(
    llama_dir: str, llama_adapters: list[str], tmp_path: Path
) -> None:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    too_big = make_adapter(model, tmp_path / "r16", LLAMA_TARGETS, 16, seed=9)
    args = [
        "--enable-lora",
        "--max-loras", "2",
        "--max-lora-rank", "8",
        "--lora-modules", f"a4={llama_adapters[0]}",
        "--num-kv-blocks", "128",
        "--block-size", "4",
        "--max-model-len", "64",
    ]  # fmt: skip
    server = RemoteServer("lora", llama_dir, args, tmp_path).wait_ready()
    try:
        client = server.openai()
        http = server.http()
        ids = [m.id for m in client.models.list().data]
        assert ids == [llama_dir, "a4"]
        assert _text(client, "a4") == _peft_text(llama_dir, llama_adapters[0])
        base = _text(client, llama_dir)
        assert base == _peft_text(llama_dir, None)
        assert base != _text(client, "a4")

        # Families that do not run adapters refuse their names instead of running the base.
        r = http.post("/tokenize", json={"model": "a4", "prompt": "hi"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"

        # Bad loads: 400 with an OpenAI error body; nothing changes.
        for body, words in [
            ({"lora_name": "x", "lora_path": str(tmp_path / "nowhere")}, "does not exist"),
            ({"lora_name": "x", "lora_path": too_big}, "max_lora_rank"),
            ({"lora_name": "a4", "lora_path": llama_adapters[1]}, "already served"),
        ]:
            r = http.post("/v1/load_lora_adapter", json=body)
            assert r.status_code == 400, r.text
            assert words in r.json()["error"]["message"]
        with pytest.raises(openai.NotFoundError):
            _text(client, "x")

        r = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "b8", "lora_path": llama_adapters[1]}
        )
        assert r.status_code == 200, r.text
        assert "b8" in [m.id for m in client.models.list().data]
        assert _text(client, "b8") == _peft_text(llama_dir, llama_adapters[1])
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a4"}).status_code == 200
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a4"}).status_code == 404
        with pytest.raises(openai.NotFoundError):
            _text(client, "a4")
        assert _text(client, llama_dir) == base  # still serving
    finally:
        server.stop()
