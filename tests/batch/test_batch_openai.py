"""`v1 batch` on an OpenAI Batch file (vLLM's run-batch format): each line's body is answered
by the server's own endpoint (/v1/completions, /v1/chat/completions, /v1/embeddings,
/v1/audio/transcriptions), written as {"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}; bad lines are error records; restarts skip written shards."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.batch.test_batch_local import read_output
from tests.entrypoints.openai.conftest import (
    AUDIO_DIR,
    CHAT_TEMPLATE,
    MINILM_DIR,
    WHISPER_DIR,
    make_chat_llama_dir,
)
from tests.utils import require_asset
from v1.__main__ import main
from v1.entrypoints.llm import LLM
from v1.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(400)


def write_lines(path: Path, lines: list) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def request(custom_id: str, url: str, body: dict, method: str = "POST") -> dict:
    return {"custom_id": custom_id, "method": method, "url": url, "body": body}


def run(inp: str, out: Path, model: str, *extra: str) -> int:
    args = ["batch", "--input", inp, "--output", str(out), "--model", model, "--quiet"]
    return main([*args, "--device", "cpu", *extra])


def by_custom_id(out: Path) -> dict[str, dict]:
    rows = read_output(out)
    for row in rows:
        assert set(row) == {"id", "custom_id", "response", "error"}
        assert set(row["response"]) == {"status_code", "request_id", "body"}
    return {row["custom_id"]: row for row in rows}


def test_completions_and_chat_lines_are_answered_like_the_server(tmp_path: Path, capsys) -> None:
    model = make_chat_llama_dir(tmp_path / "llama", CHAT_TEMPLATE)
    prompts = [f"the {w} jumps" for w in ("fox", "dog", "cat", "cow")]
    greedy = {"max_tokens": 5, "temperature": 0.0}
    lines: list = [
        request(f"c{i}", "/v1/completions", {"model": "tiny", "prompt": p, **greedy})
        for i, p in enumerate(prompts)
    ]
    chat = [{"role": "user", "content": "hello"}]
    lines += [
        request("chat", "/v1/chat/completions", {"model": "tiny", "messages": chat, **greedy}),
        request("empty", "/v1/completions", {"model": "tiny", "prompt": "", "max_tokens": 2}),
        request("wrong-model", "/v1/completions", {"model": "gpt-4", "prompt": "x"}),
        request("get", "/v1/completions", {"model": "tiny", "prompt": "x"}, method="GET"),
        request("stream", "/v1/completions", {"model": "tiny", "prompt": "x", "stream": True}),
        "{not json",
    ]
    inp, out = write_lines(tmp_path / "batch.jsonl", lines), tmp_path / "out"
    extra = ("--served-model-name", "tiny", "--num-kv-blocks", "64", "--shard-size", "6")
    assert run(inp, out, model, *extra) == 0  # no --task: the file's format says it
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["rows"] == 10 and summary["shards"] == 2 and summary["errors"] == 5
    rows = by_custom_id(out)

    with LLM(model, multiprocess=False, num_kv_blocks=64) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=5)
        expected = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
        (chat_out,) = llm.chat(chat, params, use_tqdm=False)
    for i, text in enumerate(expected):
        row = rows[f"c{i}"]
        assert row["error"] is None and row["response"]["status_code"] == 200
        body = row["response"]["body"]
        assert body["object"] == "text_completion" and body["choices"][0]["text"] == text
    chat_body = rows["chat"]["response"]["body"]
    assert chat_body["choices"][0]["message"]["content"] == chat_out.outputs[0].text

    assert rows["empty"]["response"]["status_code"] == 400
    assert rows["empty"]["error"]["message"] == "prompt is an empty string"
    assert rows["wrong-model"]["response"]["status_code"] == 404
    assert "gpt-4" in rows["wrong-model"]["error"]["message"]
    assert "method must be POST" in rows["get"]["error"]["message"]
    assert "streaming is not supported" in rows["stream"]["error"]["message"]
    assert "not JSON" in rows["line-10"]["error"]["message"]

    # A restart answers only the missing shard.
    (out / "part-00001.jsonl").unlink()
    assert run(inp, out, model, *extra) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["written"], summary["skipped"]) == (1, 1)
    assert set(by_custom_id(out)) == set(rows)


def test_embedding_lines_match_llm_embed(tmp_path: Path) -> None:
    require_asset(MINILM_DIR)
    texts = ["a cat sat", "on the mat"]
    lines = [
        request("e0", "/v1/embeddings", {"model": str(MINILM_DIR), "input": texts[0]}),
        request("e1", "/v1/embeddings", {"model": str(MINILM_DIR), "input": texts}),
        request("bad", "/v1/embeddings", {"model": str(MINILM_DIR), "input": ""}),
    ]
    inp, out = write_lines(tmp_path / "emb.jsonl", lines), tmp_path / "out"
    assert run(inp, out, str(MINILM_DIR), "--task", "openai") == 0
    rows = by_custom_id(out)
    with LLM(str(MINILM_DIR), multiprocess=False, device="cpu") as llm:
        expected = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
    (single,) = rows["e0"]["response"]["body"]["data"]
    np.testing.assert_allclose(single["embedding"], expected[0], atol=1e-5)
    pair = rows["e1"]["response"]["body"]["data"]
    np.testing.assert_allclose([d["embedding"] for d in pair], expected, atol=1e-5)
    assert rows["bad"]["response"]["status_code"] == 400 and rows["bad"]["error"]


def test_transcription_lines_read_local_audio_files(tmp_path: Path) -> None:
    require_asset(WHISPER_DIR)
    clip = AUDIO_DIR / "librispeech" / "test_audio_0.flac"
    lines = [
        request("t0", "/v1/audio/transcriptions", {"file": str(clip), "language": "en"}),
        request("t1", "/v1/audio/transcriptions", {"file_url": f"file://{clip}"}),
        request("missing", "/v1/audio/transcriptions", {"file": str(tmp_path / "nope.wav")}),
    ]
    inp, out = write_lines(tmp_path / "asr.jsonl", lines), tmp_path / "out"
    assert run(inp, out, str(WHISPER_DIR), "--served-model-name", "whisper-1") == 0
    rows = by_custom_id(out)
    for custom_id in ("t0", "t1"):
        assert rows[custom_id]["response"]["status_code"] == 200, rows[custom_id]
        assert "I exist" in rows[custom_id]["response"]["body"]["text"]
    assert "cannot read the audio file" in rows["missing"]["error"]["message"]
