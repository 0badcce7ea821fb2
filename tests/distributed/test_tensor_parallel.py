"""Tensor parallelism on CPU over gloo: TP=2 gives the TP=1 greedy tokens (embeddings within
1e-5) for every model family, through `LLM`; a dead worker fails the engine loudly and leaves
no process behind.

Each family builds one tiny random model and one TP=2 engine (rank 1 is a worker process).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.utils import (
    ASSETS,
    ONE_TORCH_THREAD,
    make_tiny_bart_dir,
    make_tiny_llama_dir,
    make_tiny_model_dir,
    make_tiny_t5_dir,
    make_tiny_wordpiece_tokenizer,
)
from v1 import LLM, BeamSearchParams, SamplingParams
from v1.core.errors import EngineDeadError

pytestmark = ONE_TORCH_THREAD

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ENGINE_ARGS = dict(num_kv_blocks=96, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog.", "To be or not to be"]
WORKER_MODULE = "v1.executor.worker_proc"


def worker_pids(parent_pid: int | None = None) -> list[int]:
    """Pids of running tensor-parallel workers (started by `parent_pid` if given)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "Z" or WORKER_MODULE.encode() not in cmdline:
            continue
        if parent_pid is None or f"--parent-pid={parent_pid}".encode() in cmdline:
            pids.append(int(entry))
    return pids


def run_tp1_and_tp2(path: str, run: Callable[[LLM], Any], **engine_args: Any) -> list[Any]:
    """run(llm) on a TP=1 and a TP=2 engine (in this process; rank 1 a worker process);
    afterwards no worker of ours is left."""
    results = []
    for tp in (1, 2):
        with LLM(path, multiprocess=False, tensor_parallel_size=tp, **engine_args) as llm:
            if tp == 2:
                assert len(worker_pids(os.getpid())) == 1
            results.append(run(llm))
    assert worker_pids(os.getpid()) == []
    return results


def generate_tokens(prompts: list[Any]) -> Callable[[LLM], list[list[int]]]:
    def run(llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]

    return run


def beams_and_tokens(prompts: list[Any]) -> Callable[[LLM], tuple]:
    """Greedy tokens, then a 3-beam search (every beam step forks its parent's KV: block copies
    run on every rank) and its fork count."""
    generate = generate_tokens(prompts)

    def run(llm: LLM) -> tuple:
        params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
        beams = [[s.token_ids for s in o.sequences] for o in llm.beam_search(prompts, params)]
        stats = llm.llm_engine.get_stats()
        assert stats["num_block_copies"] > 0 and stats["num_kv_requests"] == 0
        return generate(llm), beams, stats["num_forks"]

    return run


def token_prompts(n: int = 4) -> list[dict[str, list[int]]]:
    return [
        {"prompt_token_ids": [1] + [(7 * k + 3 * i) % 300 + 10 for i in range(5 + 6 * k)]}
        for k in range(n)
    ]


def assert_same_tokens(results: list[list[list[int]]]) -> None:
    tp1, tp2 = results
    assert tp2 == tp1
    assert all(len(t) == GREEDY.max_tokens for t in tp1)
    assert len({tuple(t) for t in tp1}) > 1  # outputs depend on the input


# ---- decoder-only: Llama (GQA), Qwen2 (one kv head: replicated), GPT-2 (fused c_attn) ----
@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_decoder_only_tp2_matches_tp1(tmp_path: Path, family: str) -> None:
    if family == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        path = make_tiny_model_dir(
            Qwen2Config,
            Qwen2ForCausalLM,
            tmp_path,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,  # fewer kv heads than ranks: each rank keeps a copy
            max_position_embeddings=256,
            initializer_range=0.2,
            tie_word_embeddings=False,
        )
    else:
        from transformers import GPT2Config, GPT2LMHeadModel

        path = make_tiny_model_dir(
            GPT2Config,
            GPT2LMHeadModel,
            tmp_path,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=256,
            initializer_range=0.2,
        )
    generate = beams_and_tokens(token_prompts())

    def run(llm: LLM) -> tuple[tuple, int]:
        return generate(llm), llm.llm_engine.engine_core.engine_core.kv_cache_config.num_blocks

    # Sized by bytes, pipelined steps (the GPU's defaults).
    args = {**ENGINE_ARGS, "num_kv_blocks": None, "kv_cache_memory_bytes": 96 * 4096}
    (run1, blocks1), (run2, blocks2) = run_tp1_and_tp2(path, run, async_scheduling=True, **args)
    assert_same_tokens([run1[0], run2[0]])
    assert run2[1:] == run1[1:]  # the same beams, every beam step forked on both
    # Each rank caches its own heads: half of GPT-2's 4 per rank, so twice the blocks in the
    # same bytes; Qwen2's one kv head is copied on both ranks.
    assert blocks2 == (2 * blocks1 if family == "gpt2" else blocks1)


def test_llama_multiprocess_tp2_and_dead_worker(tmp_path: Path) -> None:
    """The EngineCore in its own process with rank 1 beside it: same tokens as TP=1; then
    killing rank 1 mid-generation fails the pending requests with EngineDeadError within 2 s,
    and neither the core nor the worker survives."""
    path = make_tiny_llama_dir(tmp_path, initializer_range=0.2, max_position_embeddings=512)
    prompts = token_prompts()
    args = {**ENGINE_ARGS, "max_model_len": 384, "num_kv_blocks": 200}
    with LLM(path, multiprocess=False, **args) as llm:
        expected = generate_tokens(prompts)(llm)
    llm = LLM(path, multiprocess=True, tensor_parallel_size=2, **args)
    try:
        core_pid = llm.llm_engine.engine_core.pid
        (worker,) = worker_pids(core_pid)
        assert generate_tokens(prompts)(llm) == expected
        killed_at: list[float] = []

        def kill_soon() -> None:
            time.sleep(0.5)
            os.kill(worker, signal.SIGKILL)
            killed_at.append(time.monotonic())

        killer = threading.Thread(target=kill_soon)
        killer.start()
        long = SamplingParams(temperature=0, max_tokens=360, ignore_eos=True)
        with pytest.raises(EngineDeadError, match="rank 1"):
            llm.generate(prompts * 2, long, use_tqdm=False)
        failed_at = time.monotonic()
        killer.join()
        assert killed_at and failed_at - killed_at[0] < 2.0
        with pytest.raises(EngineDeadError):
            llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (worker_pids(core_pid) or _alive(core_pid)):
        time.sleep(0.05)
    assert not _alive(core_pid) and worker_pids(core_pid) == []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# ---- encoder-decoder: BART, Marian, T5, mT5 ----
def _bart_family_dir(path: Path, family: str) -> str:
    # mBART's pre-norm needs more spread
    init_std = 0.5 if family == "mbart" else 0.2
    return make_tiny_bart_dir(path, family=family, init_std=init_std, decoder_start_token_id=2)


def _t5_family_dir(path: Path, family: str) -> str:
    return make_tiny_t5_dir(
        path,
        family=family,
        add_bos=True,
        relative_attention_num_buckets=8,
        n_positions=64,
        feed_forward_proj="gated-gelu" if family == "mt5" else "relu",
        tie_word_embeddings=family != "mt5",
        initializer_factor=4.0,
    )


@pytest.mark.parametrize("family", ["bart", "mbart", "marian", "t5", "mt5"])
def test_encoder_decoder_tp2_matches_tp1(tmp_path: Path, family: str) -> None:
    make = _t5_family_dir if family in ("t5", "mt5") else _bart_family_dir
    path = make(tmp_path, family)
    results = run_tp1_and_tp2(path, generate_tokens(TEXTS), max_model_len=64, **ENGINE_ARGS)
    assert_same_tokens(results)


def test_bart_absorbed_cross_attention_tp2_matches_tp1(tmp_path: Path) -> None:
    """Absorbed cross-attention: each rank projects its heads' W_k/W_v; the encoder states
    are replicated."""
    path = _bart_family_dir(tmp_path, "bart")
    tp1, tp2 = run_tp1_and_tp2(
        path, beams_and_tokens(TEXTS), cross_attention="absorbed", **ENGINE_ARGS
    )
    assert_same_tokens([tp1[0], tp2[0]])
    assert tp2[1:] == tp1[1:]  # beams fork their self-attention KV beside the encoder states


# ---- Whisper: encoder and decoder ----
@pytest.mark.skipif(not (ASSETS / "whisper-base").is_dir(), reason="needs whisper-base files")
def test_whisper_tp2_matches_tp1(tmp_path: Path) -> None:
    from tests.models.test_whisper import make_tiny_whisper_dir, make_waves

    path = make_tiny_whisper_dir(tmp_path / "whisper")
    gen_config = Path(path) / "generation_config.json"
    gen = json.loads(gen_config.read_text())
    gen["alignment_heads"] = [[1, 0], [1, 1]]  # inside the tiny decoder (2 layers of 4 heads)
    gen_config.write_text(json.dumps(gen))
    waves = make_waves(3, seed=1)
    prompts = [{"prompt": "", "multi_modal_data": {"audio": (w, 16_000)}} for w in waves]

    def run(llm: LLM) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=10)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if llm.config.parallel_config.tensor_parallel_size > 1:
            # The alignment pass needs whole heads: refused up front, the engine serves on.
            words = SamplingParams(temperature=0, max_tokens=10, word_timestamps=True)
            with pytest.raises(Exception, match="not supported with tensor_parallel_size > 1"):
                llm.generate(prompts[:1], words, use_tqdm=False)
        return tokens

    tp1, tp2 = run_tp1_and_tp2(
        path, run, num_kv_blocks=320, block_size=16, max_num_seqs=3, max_model_len=64
    )
    assert tp2 == tp1 and all(tp1)


# ---- encoder-only: BERT, XLM-R ----
@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_encoder_only_tp2_embeddings_match_tp1(tmp_path: Path, family: str) -> None:
    from transformers import BertConfig, BertModel, XLMRobertaConfig, XLMRobertaModel

    make_tiny_wordpiece_tokenizer(tmp_path)
    config_cls, model_cls = (
        (BertConfig, BertModel) if family == "bert" else (XLMRobertaConfig, XLMRobertaModel)
    )
    extra = {"pad_token_id": 1} if family == "xlm-roberta" else {}
    path = make_tiny_model_dir(
        config_cls,
        model_cls,
        tmp_path,
        tokenizer_from=tmp_path,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        **extra,
    )

    def run(llm: LLM) -> np.ndarray:
        return np.array([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])

    tp1, tp2 = run_tp1_and_tp2(path, run, max_num_batched_tokens=256, max_num_seqs=4)
    assert tp1.shape == (len(TEXTS), 32)
    np.testing.assert_allclose(tp2, tp1, atol=1e-5, rtol=0)


def test_indivisible_heads_fail_clearly(tmp_path: Path) -> None:
    path = make_tiny_llama_dir(tmp_path, num_attention_heads=4, num_key_value_heads=2)
    config = json.loads((Path(path) / "config.json").read_text())
    assert config["num_attention_heads"] == 4
    with pytest.raises(ValueError, match="does not divide the attention heads"):
        LLM(path, multiprocess=False, tensor_parallel_size=3, **ENGINE_ARGS)
    assert worker_pids(os.getpid()) == []
