"""InputProcessor: prompt forms per model kind, validation at the edge, generation defaults."""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from transformers import BartConfig, BertConfig, GenerationConfig, LlamaConfig, MarianConfig

from tests.utils import make_tiny_tokenizer, make_tiny_wordpiece_tokenizer
from v1.config import ModelConfig
from v1.engine.input_processor import InputProcessor
from v1.pooling_params import PoolingParams
from v1.sampling_params import SamplingParams

VOCAB = 384
MAX_LEN = 16


def make_processor(
    path: Path,
    hf_config: Any,
    tokenizer: Any,
    *,
    generation_config: dict[str, Any] | None = None,
    extra_config: dict[str, Any] | None = None,
    **kwargs: Any,
) -> InputProcessor:
    """An InputProcessor for `hf_config` saved in `path` (plus an optional
    generation_config.json and legacy generation fields in config.json)."""
    path.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(str(path))
    if extra_config:
        data = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**data, **extra_config}))
    if generation_config is not None:
        GenerationConfig(**generation_config).save_pretrained(str(path))
    return InputProcessor(ModelConfig(model=str(path)), tokenizer, **kwargs)


@pytest.fixture(scope="module")
def bart_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("bart_tok"), add_bos=True, add_eos=True)


@pytest.fixture(scope="module")
def wordpiece(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_wordpiece_tokenizer(tmp_path_factory.mktemp("wordpiece"))


@pytest.fixture
def llama(tmp_path: Path, tiny_tokenizer) -> InputProcessor:
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=MAX_LEN,
        eos_token_id=2,
        bos_token_id=1,
    )
    return make_processor(tmp_path / "llama", cfg, tiny_tokenizer)


def bart_config(**kwargs: Any) -> BartConfig:
    return BartConfig(
        vocab_size=VOCAB,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        max_position_embeddings=MAX_LEN,
        **kwargs,
    )


@pytest.fixture
def bart(tmp_path: Path, bart_tokenizer) -> InputProcessor:
    return make_processor(tmp_path / "bart", bart_config(), bart_tokenizer)


def bert_processor(
    path: Path, tokenizer: Any, arch: str = "BertModel", num_labels: int = 2, **kwargs: Any
):
    cfg = BertConfig(
        num_labels=num_labels,
        vocab_size=len(tokenizer),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=MAX_LEN,
        architectures=[arch],
    )
    return make_processor(path, cfg, tokenizer, **kwargs)


@pytest.fixture
def bert(tmp_path: Path, wordpiece) -> InputProcessor:
    return bert_processor(tmp_path / "bert", wordpiece)


GREEDY = SamplingParams(temperature=0)


# ---- parameters ----


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.5},
        {"temperature": math.nan},
        {"temperature": math.inf},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"min_p": 1.5},
        {"max_tokens": 0},
        {"max_tokens": -3},
        {"min_tokens": -1},
        {"min_tokens": 5, "max_tokens": 2},
        {"n": 0},
        {"n": 1000},
        {"logprobs": 21},
        {"presence_penalty": 3.0},
        {"repetition_penalty": 0.0},
        {"stop_token_ids": [-1]},
        {"stop": [""]},
        {"truncate_prompt_tokens": 0},
    ],
)
def test_invalid_sampling_params_raise(kwargs: dict[str, Any]) -> None:
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
        ({"suppress_tokens": [VOCAB + 7]}, "suppress_tokens"),
        ({"allowed_token_ids": [3, VOCAB]}, "allowed_token_ids"),
        ({"begin_suppress_tokens": [VOCAB]}, "begin_suppress_tokens"),
        ({"forced_token_ids": [[0, VOCAB]]}, "forced_token_ids"),
        ({"stop": ["x"], "detokenize": False}, "detokenize"),
    ],
)
def test_params_checked_against_the_model(
    llama: InputProcessor, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        llama.process("r", "hello", SamplingParams(**kwargs))


def test_params_type_must_fit_the_model_kind(
    llama: InputProcessor, bart: InputProcessor, bert: InputProcessor
) -> None:
    for generator in (llama, bart):
        with pytest.raises(ValueError, match="SamplingParams"):
            generator.process("r", "hello", PoolingParams())
    with pytest.raises(ValueError, match="encoder-only"):
        bert.process("r", "hello", SamplingParams())
    with pytest.raises(ValueError, match="classifier"):
        bert.process("r", "hello", PoolingParams(task="classify"))


def test_pooling_params_changed_after_passing_are_checked_again(bert: InputProcessor) -> None:
    """A batch's shared params pass once; the same object changed afterwards is checked anew
    (the builder remembers a copy of what passed, not the object)."""
    params = PoolingParams()
    bert.process("r", "hello", params)
    bert.process("r", "hello", params)
    params.task = "classify"
    with pytest.raises(ValueError, match="classifier"):
        bert.process("r", "hello", params)
    with pytest.raises(ValueError, match="encoder-only"):
        bert.process("r", "hello", None)


# ---- prompts ----


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ("", "empty"),
        ({"prompt": ""}, "empty"),
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [1, -1]}, "outside the vocabulary"),
        ({"prompt_token_ids": [1, VOCAB]}, "outside the vocabulary"),
        ({"prompt_token_ids": [1, 2.5]}, "ints"),
        ({"prompt_token_ids": [True]}, "ints"),
        ({"prompt_token_ids": "1 2 3"}, "list of ints"),
        ([1, 2, 3], "must be a string"),
        (42, "must be a string"),
        (None, "must be a string"),
        ({"prompt_ids": [1]}, "got a dict with keys"),
        ({"prompt_token_ids": [1], "priority": 3}, "unexpected prompt keys"),
        ({"prompt_token_ids": [1], "token_type_ids": [0]}, "encoder-only"),
        ({"prompt": "hi", "multi_modal_data": {"audio": (np.zeros(10), 16000)}}, "Whisper"),
        ({"multi_modal_data": {"audio": (np.zeros(10), 16000)}}, "Whisper"),
        ({"encoder_prompt": "a", "decoder_prompt": "b"}, "must be a string"),
        ({"prompt_token_ids": list(range(4, 4 + MAX_LEN))}, "max_model_len"),
    ],
)
def test_invalid_decoder_only_prompts_raise(llama: InputProcessor, prompt: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llama.process("r", prompt, GREEDY)


def test_decoder_only_request(llama: InputProcessor, tiny_tokenizer) -> None:
    req = llama.process("r1", "hello world", GREEDY, arrival_time=5.0, priority=3)
    assert req.prompt_token_ids == tiny_tokenizer("hello world")["input_ids"]
    assert req.prompt_token_ids[0] == 1  # the tokenizer's BOS
    assert req.eos_token_id == 2 and req.encoder_input is None
    assert (req.request_id, req.arrival_time, req.priority) == ("r1", 5.0, 3)
    assert req.sampling_params.temperature == 0
    tokens = llama.process("r2", {"prompt_token_ids": [5, 6, 7]}, GREEDY)
    assert tokens.prompt_token_ids == [5, 6, 7]
    # The longest prompt leaves one position to generate.
    longest = list(range(4, 4 + MAX_LEN - 1))
    assert llama.process("r3", {"prompt_token_ids": longest}, GREEDY).prompt_token_ids == longest
    assert llama.prompt_texts("hello") == ("hello", None)


def test_decoder_prompt_truncation_keeps_the_last_tokens(llama: InputProcessor) -> None:
    ids = list(range(4, 4 + 3 * MAX_LEN))
    req = llama.process("r", {"prompt_token_ids": ids}, SamplingParams(truncate_prompt_tokens=5))
    assert req.prompt_token_ids == ids[-5:]


# ---- encoder-decoder ----


def test_encoder_decoder_prompt_forms(bart: InputProcessor, bart_tokenizer) -> None:
    text_ids = bart_tokenizer("hello world")["input_ids"]
    assert text_ids[0] == 1 and text_ids[-1] == 2  # <s> ... </s>
    req = bart.process("r", "hello world", GREEDY)
    # A plain prompt is the ENCODER input; the decoder starts from decoder_start_token_id (2).
    assert req.encoder_input.token_ids == text_ids
    assert req.encoder_input.num_encoder_tokens == len(text_ids)
    expected_hash = hashlib.sha256(np.asarray(text_ids, dtype="<i8").tobytes()).hexdigest()
    assert req.encoder_input.content_hash == expected_hash
    assert req.prompt_token_ids == [2] and req.eos_token_id == 2
    assert bart.process("t", {"prompt_token_ids": text_ids}, GREEDY).encoder_input == (
        req.encoder_input
    )
    # Explicit pairs: a decoder string is tokenized without special tokens, start prepended.
    pair = {"encoder_prompt": "hello world", "decoder_prompt": "the fox"}
    req = bart.process("p", pair, GREEDY)
    fox = bart_tokenizer("the fox", add_special_tokens=False)["input_ids"]
    assert req.prompt_token_ids == [2, *fox]
    assert req.encoder_input.token_ids == text_ids
    assert bart.prompt_texts(pair) == ("the fox", "hello world")
    assert bart.prompt_texts("hello world") == (None, "hello world")
    # Token decoder prompts already starting with the start token are kept (as transformers).
    for dec, expected in (([2, 7, 8], [2, 7, 8]), ([7, 8], [2, 7, 8]), (None, [2])):
        prompt = {"encoder_prompt": {"prompt_token_ids": [5, 6]}, "decoder_prompt": None}
        if dec is not None:
            prompt["decoder_prompt"] = {"prompt_token_ids": dec}
        assert bart.process("q", prompt, GREEDY).prompt_token_ids == expected


def test_encoder_decoder_invalid_prompts(bart: InputProcessor) -> None:
    long_ids = [1, *range(4, 4 + MAX_LEN), 2]
    cases = [
        ({"encoder_prompt": "", "decoder_prompt": None}, "empty"),
        ({"encoder_prompt": "hi", "decoder_prompt": ""}, "empty"),
        ({"encoder_prompt": {"prompt_token_ids": [VOCAB]}, "decoder_prompt": None}, "vocabulary"),
        ({"encoder_prompt": "hi", "decoder_prompt": {"prompt_token_ids": [-1]}}, "vocabulary"),
        ({"encoder_prompt": {"encoder_prompt": "a", "decoder_prompt": None}}, "itself"),
        ({"prompt_token_ids": long_ids}, "limit of 16"),
        (
            {"encoder_prompt": "hi", "decoder_prompt": {"prompt_token_ids": list(range(4, 20))}},
            "max_model_len",
        ),
    ]
    for prompt, match in cases:
        with pytest.raises(ValueError, match=match):
            bart.process("r", prompt, GREEDY)


DECODER_VOCAB = 96
"""Marian's own target vocabulary, smaller than its source vocabulary (VOCAB)."""


@pytest.fixture
def marian(tmp_path: Path, bart_tokenizer) -> InputProcessor:
    cfg = MarianConfig(
        vocab_size=VOCAB,
        decoder_vocab_size=DECODER_VOCAB,
        share_encoder_decoder_embeddings=False,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=MAX_LEN,
        pad_token_id=0,
        eos_token_id=2,
        forced_eos_token_id=2,
        decoder_start_token_id=2,
    )
    return make_processor(tmp_path / "marian", cfg, bart_tokenizer)


def test_marian_encoder_and_decoder_vocabularies(marian: InputProcessor) -> None:
    """Encoder ids are checked against the source vocabulary, decoder prompt and sampling ids
    against the decoder's own (smaller) one."""
    source_only = [1, DECODER_VOCAB, VOCAB - 1, 5, 2]
    req = marian.process("r", {"prompt_token_ids": source_only}, GREEDY)
    assert req.encoder_input.token_ids == source_only and req.prompt_token_ids == [2]
    pair = {
        "encoder_prompt": {"prompt_token_ids": source_only},
        "decoder_prompt": {"prompt_token_ids": [DECODER_VOCAB - 1]},
    }
    assert marian.process("p", pair, GREEDY).prompt_token_ids == [2, DECODER_VOCAB - 1]
    cases = [
        ({"prompt_token_ids": [5, VOCAB]}, GREEDY, rf"encoder vocabulary \[0, {VOCAB}\)"),
        (
            {"encoder_prompt": "hi", "decoder_prompt": {"prompt_token_ids": [DECODER_VOCAB]}},
            GREEDY,
            rf"{DECODER_VOCAB} in the decoder prompt is outside the decoder vocabulary",
        ),
        ("hi", SamplingParams(stop_token_ids=[DECODER_VOCAB]), "stop_token_ids"),
        ("hi", SamplingParams(allowed_token_ids=[DECODER_VOCAB]), "allowed_token_ids"),
        ("hi", SamplingParams(suppress_tokens=[DECODER_VOCAB]), "suppress_tokens"),
    ]
    for prompt, params, match in cases:
        with pytest.raises(ValueError, match=match):
            marian.process("r", prompt, params)


def test_encoder_truncation_keeps_first_tokens_and_final_eos(bart: InputProcessor) -> None:
    ids = [1, *range(4, 4 + 2 * MAX_LEN), 2]
    req = bart.process("r", {"prompt_token_ids": ids}, SamplingParams(truncate_prompt_tokens=6))
    assert req.encoder_input.token_ids == [1, 4, 5, 6, 7, 2]
    # Asked for more than the model takes: cut to the model's limit.
    req = bart.process("r", {"prompt_token_ids": ids}, SamplingParams(truncate_prompt_tokens=999))
    assert req.encoder_input.token_ids == ids[: MAX_LEN - 1] + [2]


def test_generation_config_fills_unset_params(tmp_path: Path, bart_tokenizer) -> None:
    gen = {
        "decoder_start_token_id": 2,
        "bos_token_id": 0,
        "eos_token_id": [2, 11],
        "forced_bos_token_id": 5,
        "forced_eos_token_id": 2,
        "suppress_tokens": [7, 8, VOCAB + 50],
        "begin_suppress_tokens": [9],
        "no_repeat_ngram_size": 3,
        "min_length": 6,
    }
    proc = make_processor(tmp_path, bart_config(), bart_tokenizer, generation_config=gen)
    req = proc.process("r", "hello", SamplingParams())
    p = req.sampling_params
    assert req.eos_token_id == 2
    assert p.forced_token_ids == [[0, 5]]  # decoder prompt [start]: forced BOS applies
    assert p.forced_eos_token_id == 2
    assert p.suppress_tokens == [7, 8]  # ids outside the vocabulary are dropped
    assert p.begin_suppress_tokens is None  # transformers moves it past the forced BOS
    assert p.no_repeat_ngram_size == 3
    assert p.min_tokens == 5  # min_length 6 counts the decoder start token
    assert p.stop_token_ids == [11]  # the second EOS id
    assert p.max_tokens == 16  # vLLM's default, not generation_config.max_length

    # A longer decoder prompt: no forced BOS, begin_suppress applies, min_length counts it.
    pair = {"encoder_prompt": "hello", "decoder_prompt": {"prompt_token_ids": [2, 5, 6]}}
    p = proc.process("r", pair, SamplingParams()).sampling_params
    assert p.forced_token_ids is None and p.begin_suppress_tokens == [9] and p.min_tokens == 3

    # Explicit values win; ignore_eos drops the extra EOS stop id; min_tokens <= max_tokens.
    user = SamplingParams(
        forced_token_ids=[[0, 6]],
        forced_eos_token_id=3,
        suppress_tokens=[],
        begin_suppress_tokens=[10],
        no_repeat_ngram_size=0,
        min_tokens=1,
        ignore_eos=True,
        stop_token_ids=[12],
    )
    p = proc.process("r", "hello", user).sampling_params
    assert p == user
    assert proc.process("r", "hello", SamplingParams(max_tokens=2)).sampling_params.min_tokens == 2


def test_legacy_generation_fields_in_config_json(tmp_path: Path, bart_tokenizer) -> None:
    """Without generation_config.json, generation fields of config.json count (as
    transformers' from_pretrained reads them)."""
    proc = make_processor(
        tmp_path,
        bart_config(),
        bart_tokenizer,
        extra_config={"no_repeat_ngram_size": 4, "forced_bos_token_id": 0},
    )
    p = proc.process("r", "hello", SamplingParams()).sampling_params
    assert p.no_repeat_ngram_size == 4 and p.forced_token_ids == [[0, 0]]
    assert p.forced_eos_token_id == 2  # BART's model config default


def test_decoder_only_generation_defaults(tmp_path: Path, tiny_tokenizer) -> None:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    gen = {"eos_token_id": 2, "suppress_tokens": [9], "min_length": 5, "forced_bos_token_id": 7}
    proc = make_processor(tmp_path, cfg, tiny_tokenizer, generation_config=gen)
    p = proc.process("r", {"prompt_token_ids": [1, 4, 5]}, SamplingParams()).sampling_params
    # min_length counts the prompt; forced BOS only fires on a one-token prompt.
    assert p.min_tokens == 2 and p.suppress_tokens == [9] and p.forced_token_ids is None
    p = proc.process("r", {"prompt_token_ids": [1]}, SamplingParams()).sampling_params
    assert p.forced_token_ids == [[0, 7]] and p.min_tokens == 4


# ---- encoder-only ----


def test_encoder_only_inputs(bert: InputProcessor, wordpiece) -> None:
    req = bert.process("r", "hello world", PoolingParams())
    enc = wordpiece("hello world")
    assert req.prompt_token_ids == enc["input_ids"] and req.token_type_ids == [0] * len(
        enc["input_ids"]
    )
    assert req.pooling_params.task == "embed" and req.sampling_params is None
    assert req.encoder_input is None
    pair = wordpiece("hello", "the dog")
    for req in (
        bert.process_pair("p", "hello", "the dog", PoolingParams()),
        bert.process("p", {"text": "hello", "text_pair": "the dog"}, PoolingParams()),
    ):
        assert req.prompt_token_ids == pair["input_ids"]
        assert req.token_type_ids == pair["token_type_ids"] and 1 in req.token_type_ids
    tokens = {"prompt_token_ids": [2, 100, 3, 101, 3], "token_type_ids": [0, 0, 0, 1, 1]}
    req = bert.process("t", tokens, PoolingParams())
    assert req.token_type_ids == [0, 0, 0, 1, 1]


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ({"prompt_token_ids": [2, 100, 3], "token_type_ids": [0, 0]}, "token_type_ids"),
        ({"prompt_token_ids": [2, 100, 3], "token_type_ids": [0, 5, 0]}, "token_type_ids"),
        ({"prompt_token_ids": [2, 100, 3], "token_type_ids": [0, "1", 0]}, "token_type_ids"),
        ({"prompt_token_ids": [2, 100, 3], "token_type_ids": [0, True, 0]}, "token_type_ids"),
        ({"prompt_token_ids": [2, np.float64(100), 3]}, "ints"),  # numpy ints are ids
        ({"prompt_token_ids": (2, 100, None)}, "ints"),
        ({"text": "hello", "text_pair": ""}, "empty"),
        ({"text": "hello", "text_pair": 3}, "string"),
        ({"encoder_prompt": "a", "decoder_prompt": "b"}, "encoder-decoder"),
        ("the " * 30, "limit of 16"),
        (None, "^an input must be a string"),
    ],
)
def test_invalid_encoder_only_inputs(bert: InputProcessor, prompt: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        bert.process("r", prompt, PoolingParams())


def assert_builds_alike(bert: InputProcessor, prompts: list[Any], pre: list[Any]) -> None:
    """Each pretokenized prompt builds the request (or the error) its original builds, with
    and without truncation."""
    for params in (PoolingParams(), PoolingParams(truncate_prompt_tokens=10)):
        for prompt, built in zip(prompts, pre, strict=True):
            try:
                expected = bert.process("r", prompt, params, arrival_time=1.0)
            except ValueError as e:
                with pytest.raises(ValueError, match=re.escape(str(e))):
                    bert.process("r", built, params, arrival_time=1.0)
                continue
            assert bert.process("r", built, params, arrival_time=1.0) == expected


def test_pretokenized_encoder_only_prompts_build_the_same_requests(bert: InputProcessor) -> None:
    """`pretokenize` tokenizes a batch's texts and text pairs together; each request it builds
    is the one its own prompt builds (truncation of long texts and pairs included), and a
    prompt that fails fails with the same error."""
    prompts: list[Any] = [
        "hello world",
        {"text": "hello", "text_pair": "the dog"},
        {"prompt_token_ids": [2, 100, 3]},
        "the " * 30,
        {"text": "the quick brown fox " * 4, "text_pair": "the lazy dog " * 4},
        "gold",
        "",
        {"text": "hello", "text_pair": ""},
        {"prompt": "a query document"},
        {"text": "all that glitters", "text_pair": "is not gold"},
    ]
    pre = bert.builder.pretokenize(prompts)
    assert sum(p is not q for p, q in zip(prompts, pre, strict=True)) == 6
    assert_builds_alike(bert, prompts, pre)


def test_pretokenize_checks_token_id_prompts_together(bert: InputProcessor) -> None:
    """Token-id prompts of a chunk have their ids checked in one pass: each request is the one
    its own prompt builds (over-long ones fail or truncate alike); prompts with segment ids or
    no ids keep their own path; one bad id anywhere leaves every prompt to its own check."""
    prompts: list[Any] = [
        {"prompt_token_ids": [2, 100, 3]},
        {"prompt_token_ids": (2, 101, 102, 3)},
        {"prompt_token_ids": [2, *([100] * 30), 3]},
        {"prompt_token_ids": [2, 100, 3], "token_type_ids": [0, 0, 0]},
        {"prompt_token_ids": []},
        "hello world",
    ]
    pre = bert.builder.pretokenize(prompts)
    assert [p is not q for p, q in zip(prompts, pre, strict=True)] == [1, 1, 1, 0, 0, 0]
    assert_builds_alike(bert, prompts, pre)
    bad = [{"prompt_token_ids": [2, 100, 3]}, {"prompt_token_ids": [2, 10**6, 3]}]
    assert bert.builder.pretokenize(bad) == bad  # each keeps its own check
    with pytest.raises(ValueError, match="outside the vocabulary"):
        bert.process("r", bad[1], PoolingParams())


def test_encoder_only_truncation(bert: InputProcessor, wordpiece) -> None:
    text = "the quick brown fox " * 10
    req = bert.process("r", text, PoolingParams(truncate_prompt_tokens=8))
    assert len(req.prompt_token_ids) == 8 and req.prompt_token_ids[-1] == 3  # [SEP] kept
    assert req.prompt_token_ids == wordpiece(text, truncation=True, max_length=8)["input_ids"]
    req = bert.process_pair("p", text, "hello world", PoolingParams(truncate_prompt_tokens=10))
    assert len(req.prompt_token_ids) == len(req.token_type_ids) == 10
    assert req.token_type_ids[-1] == 1 and req.prompt_token_ids.count(3) == 2
    ids = {"prompt_token_ids": [2, *([100] * 30), 3], "token_type_ids": [0] * 32}
    req = bert.process("t", ids, PoolingParams(truncate_prompt_tokens=5))
    assert req.prompt_token_ids == [2, 100, 100, 100, 3] and req.token_type_ids == [0] * 5


def test_encoder_only_limit_includes_the_step_budget(tmp_path: Path, wordpiece) -> None:
    """An encoder-only input runs whole in one step, so the token budget caps it too."""
    proc = bert_processor(tmp_path, wordpiece, max_num_batched_tokens=6)
    with pytest.raises(ValueError, match="limit of 6"):
        proc.process("r", "the quick brown fox jumps", PoolingParams())


def test_cross_encoder_accepts_classify_and_score(tmp_path: Path, wordpiece) -> None:
    proc = bert_processor(tmp_path, wordpiece, arch="BertForSequenceClassification", num_labels=1)
    for task in ("classify", "score", "embed"):
        assert proc.process("r", "hello", PoolingParams(task=task)).pooling_params.task == task
    two_labels = bert_processor(tmp_path / "two", wordpiece, arch="BertForSequenceClassification")
    with pytest.raises(ValueError, match="one label"):
        two_labels.process("r", "hello", PoolingParams(task="score"))


def test_word_timestamps_need_a_whisper_model(llama: InputProcessor) -> None:
    with pytest.raises(ValueError, match="word_timestamps needs a Whisper model"):
        llama.process("r", "hello", SamplingParams(word_timestamps=True))
    with pytest.raises(ValueError, match="word_timestamps must be a boolean"):
        SamplingParams(word_timestamps=1)  # type: ignore[arg-type]


# ---- input builders (v1/engine/inputs) ----


def test_one_builder_per_model_kind_chosen_once(
    llama: InputProcessor, bart: InputProcessor, bert: InputProcessor
) -> None:
    from v1.engine.inputs.decoder_only import DecoderOnlyInputBuilder
    from v1.engine.inputs.encoder_decoder import EncoderDecoderInputBuilder
    from v1.engine.inputs.encoder_only import EncoderOnlyInputBuilder

    expected = {
        DecoderOnlyInputBuilder: llama,
        EncoderDecoderInputBuilder: bart,
        EncoderOnlyInputBuilder: bert,
    }
    for cls, proc in expected.items():
        builder = proc.builder
        assert type(builder) is cls and builder.info is proc.info is proc.model_config.info
        params = GREEDY if cls is not EncoderOnlyInputBuilder else PoolingParams()
        proc.process("a", "hello world", params)
        assert proc.builder is builder  # not rebuilt per request
    assert llama.builder.prompt_is_decoder_prompt
    assert not bart.builder.prompt_is_decoder_prompt and not bert.builder.prompt_is_decoder_prompt


def test_builders_know_their_decoder_prompt_length(
    llama: InputProcessor, bart: InputProcessor, bert: InputProcessor, tiny_tokenizer
) -> None:
    """What the server's room check asks before building: the decoder prompt each kind makes
    of a prompt (equal to the built request's)."""
    text = "the quick brown fox jumps over the lazy dog"
    num_ids = len(tiny_tokenizer(text)["input_ids"])
    assert llama.builder.decoder_prompt_len(text) == num_ids
    assert llama.builder.decoder_prompt_len(text, truncate_prompt_tokens=3) == 3
    assert llama.builder.decoder_prompt_len({"prompt_token_ids": [5, 6, 7, 8]}, 2) == 2
    short = "the lazy dog"  # fits max_model_len
    built = llama.process("r", short, GREEDY)
    assert len(built.prompt_token_ids) == llama.builder.decoder_prompt_len(short)
    # Text encoder-decoder: a plain prompt is the encoder's; the decoder starts from one token.
    assert bart.builder.decoder_prompt_len(text) == 1
    assert bart.builder.decoder_prompt_len({"prompt_token_ids": list(range(5, 15))}) == 1
    pair = {"encoder_prompt": "hello", "decoder_prompt": "the lazy dog"}
    num_pair = bart.builder.decoder_prompt_len(pair)
    assert num_pair > 1 and num_pair == len(bart.process("r", pair, GREEDY).prompt_token_ids)
    assert bert.builder.decoder_prompt_len(text) == 0  # no decoder


def test_pretokenize_sorts_prompts_by_kind_in_one_pass() -> None:
    from v1.engine.inputs.encoder_only import _prompt_kinds

    prompts = [
        "a text",
        "",
        {"prompt_token_ids": [5, 6]},
        {"prompt_token_ids": []},
        {"prompt_token_ids": (7,)},
        {"prompt_token_ids": [5], "token_type_ids": [0]},
        {"text": "q", "text_pair": "d"},
        {"text": "q", "text_pair": ""},
        {"text": "q", "text_pair": 3},
        {"prompt": "p"},
        None,
    ]
    assert _prompt_kinds(prompts) == ([2, 4], [0], [6])
