"""ModelInfo: the facts of a model derived once per process (tasks, Whisper's special tokens,
pooling config, classifier head), and through the public API: folder files read once at start-up,
never per request; pooling params checked once at the edge and once at the core boundary."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from transformers import BertConfig, BertForSequenceClassification, BertModel

from tests.utils import ASSETS, make_tiny_model_dir, make_tiny_wordpiece_tokenizer
from v1 import LLM, PoolingParams, SamplingParams
from v1.config import ModelConfig

WHISPER_BASE = ASSETS / "whisper-base"
MINILM = ASSETS / "all-MiniLM-L6-v2"
TINY_BERT = dict(
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
)
ENGINE_ARGS = dict(device="cpu", multiprocess=False, max_num_batched_tokens=256, max_num_seqs=4)
needs_whisper = pytest.mark.skipif(not WHISPER_BASE.is_dir(), reason="needs whisper-base")


def tiny_bert_dir(path: Path, model_cls: type, **kwargs: Any) -> str:
    make_tiny_wordpiece_tokenizer(path)
    return make_tiny_model_dir(
        BertConfig, model_cls, path, tokenizer_from=path, **{**TINY_BERT, **kwargs}
    )


@pytest.fixture(scope="module")
def embedder_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_bert_dir(tmp_path_factory.mktemp("embedder"), BertModel)


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("cross_encoder")
    return tiny_bert_dir(path, BertForSequenceClassification, num_labels=1)


class Calls:
    """Counts the calls of a module function (patched for the test)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> None:
        self.count = 0
        original = getattr(module, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)


# ---- facts ----


def test_supported_tasks_per_model_kind(
    tiny_llama_dir: str, embedder_dir: str, cross_encoder_dir: str
) -> None:
    cases = {tiny_llama_dir: {"generate"}, embedder_dir: {"embed", "score"}}
    cases[cross_encoder_dir] = {"embed", "classify", "score"}
    if WHISPER_BASE.is_dir():
        cases[str(WHISPER_BASE)] = {"transcription", "generate"}
    for path, tasks in cases.items():
        info = ModelConfig(model=path).info
        assert info.supported_tasks == tasks, path
        assert info.has_classifier == ("classify" in tasks)
        assert (info.pooling is None) == ("generate" in tasks)
    cross = ModelConfig(model=cross_encoder_dir).info
    assert cross.pooling.has_classifier and cross.pooling.num_labels == 1
    assert not ModelConfig(model=embedder_dir).info.pooling.has_classifier


def test_model_config_holds_one_model_info(embedder_dir: str) -> None:
    mc = ModelConfig(model=embedder_dir)
    assert mc.info is mc.info
    assert mc.info.pooling is mc.info.pooling


@needs_whisper
def test_whisper_base_special_tokens() -> None:
    info = ModelConfig(model=str(WHISPER_BASE)).info
    tokens = info.whisper_tokens
    assert (tokens.eos, tokens.no_timestamps, tokens.timestamp_begin) == (50257, 50363, 50364)
    assert tokens.max_initial_timestamp_index == 50
    assert tokens.no_speech == 50362  # <|nocaptions|> in this vocabulary
    assert (tokens.sot, tokens.prev) == (50258, 50361)
    assert tokens.task_ids == {"transcribe": 50359, "translate": 50358}
    assert tokens.language_ids["en"] == 50259 and len(tokens.language_ids) == 99
    assert info.alignment_heads and all(len(pair) == 2 for pair in info.alignment_heads)


@needs_whisper
def test_whisper_tokens_a_config_omits_come_from_the_vocabulary_layout(tmp_path: Path) -> None:
    """No <|notimestamps|>, <|startofprev|> or task ids in the generation config: the ids at
    the end of every Whisper vocabulary, the same as the full config names."""
    shutil.copy(WHISPER_BASE / "config.json", tmp_path / "config.json")
    generation = json.loads((WHISPER_BASE / "generation_config.json").read_text())
    for key in ("no_timestamps_token_id", "prev_sot_token_id", "task_to_id"):
        del generation[key]
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    partial = ModelConfig(model=str(tmp_path)).info.whisper_tokens
    assert partial == ModelConfig(model=str(WHISPER_BASE)).info.whisper_tokens


# ---- read once, checked at the edge and the core boundary (public API) ----


def test_pooling_config_is_loaded_once_per_process_not_per_request(
    embedder_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import v1.pooling_config as st

    loads = Calls(monkeypatch, st, "load_pooling_config")
    checks = Calls(monkeypatch, st, "validate_pooling_params")
    with LLM(embedder_dir, **ENGINE_ARGS) as llm:
        assert loads.count == 1  # start-up: frontend, EngineCore and runner share it
        texts = ["the quick brown fox", "hello world", "gold"]
        for _ in range(3):
            outputs = llm.embed(texts, use_tqdm=False)
            assert all(o.error is None and len(o.outputs.embedding) == 32 for o in outputs)
        scores = llm.score("the quick brown fox", ["the lazy dog", "gold"], use_tqdm=False)
        assert all(-1.0 <= s.outputs.score <= 1.0 for s in scores)
        num_requests = 3 * len(texts) + 3  # score embeds each distinct text once
        assert loads.count == 1
        # Once per request at the core boundary (admission); at the edge (the input
        # processor) once per distinct params: it remembers the last params that passed, and
        # every request here shares equal params.
        assert checks.count == num_requests + 1
        with pytest.raises(ValueError, match="Matryoshka"):
            llm.embed("hello", PoolingParams(dimensions=8), use_tqdm=False)
        assert checks.count == num_requests + 2  # refused at the edge: nothing queued
        assert loads.count == 1


def test_cross_encoder_scores_with_one_pooling_config_load(
    cross_encoder_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import v1.pooling_config as st

    loads = Calls(monkeypatch, st, "load_pooling_config")
    with LLM(cross_encoder_dir, **ENGINE_ARGS) as llm:
        for _ in range(2):
            scores = llm.score("a query", ["the lazy dog", "gold", "hello"], use_tqdm=False)
            assert all(0.0 <= s.outputs.score <= 1.0 for s in scores)  # sigmoid of one label
        assert loads.count == 1


@needs_whisper
def test_generation_config_is_read_once_per_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whisper's generation config (special tokens, suppress lists, alignment heads) is read
    once for the frontend's builder and the runner's timestamp rules; building another input
    builder (as each transcription does) reads nothing again."""
    import v1.model_info as model_info
    from tests.utils import make_tiny_whisper_dir
    from v1.engine.inputs.whisper import WhisperInputBuilder

    path = make_tiny_whisper_dir(tmp_path / "whisper")
    reads = Calls(monkeypatch, model_info, "load_generation_config")
    with LLM(path, **ENGINE_ARGS) as llm:
        assert reads.count == 1
        rng = np.random.default_rng(0)
        audio = (0.1 * rng.standard_normal(16_000)).astype(np.float32)
        prompt = {"prompt": "", "multi_modal_data": {"audio": (audio, 16_000)}}
        for _ in range(2):
            out = llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == 2
        engine = llm.llm_engine
        builder = WhisperInputBuilder(engine.model_config, engine.tokenizer)
        assert builder.tokens is engine.input_processor.builder.tokens
        assert reads.count == 1
