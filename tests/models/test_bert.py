"""BERT, RoBERTa, XLM-R and their classifiers through the EngineCore vs transformers, the pooling
layer against per-request loops, sentence-transformers folder reading, and per-request errors
(the engine keeps serving after each)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from v1.config import ModelConfig, make_engine_config
from v1.core.engine_core import EngineCore
from v1.core.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason
from v1.executor.uniproc import UniProcExecutor
from v1.models import bert
from v1.models.layers.pooler import Pooler, PoolingSegments, pool_tokens
from v1.pooling_config import (
    ModelPoolingConfig,
    classifier_activation_of,
    pooling_modes_of,
    validate_pooling_params,
)
from v1.pooling_params import PoolingParams
from v1.worker.model_loader import construct_model, iterate_weights, load_model

from .hf_reference import randomize_

ATOL = 1e-4
VOCAB = 120
MINILM = Path(__file__).resolve().parents[3] / "shared" / "assets" / "all-MiniLM-L6-v2"
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=48,
    max_position_embeddings=48,
)
# architecture -> (transformers class, config overrides)
ARCHS: dict[str, tuple[Any, dict[str, Any]]] = {
    "BertModel": (transformers.BertModel, {"model_type": "bert", "type_vocab_size": 2}),
    "RobertaModel": (
        transformers.RobertaModel,
        {"model_type": "roberta", "type_vocab_size": 1, "pad_token_id": 1},
    ),
    "XLMRobertaModel": (
        transformers.XLMRobertaModel,
        {"model_type": "xlm-roberta", "type_vocab_size": 1, "pad_token_id": 1},
    ),
    "BertForSequenceClassification": (
        transformers.BertForSequenceClassification,
        {"model_type": "bert", "type_vocab_size": 2},
    ),
    "RobertaForSequenceClassification": (
        transformers.RobertaForSequenceClassification,
        {"model_type": "roberta", "type_vocab_size": 1, "pad_token_id": 1},
    ),
    "XLMRobertaForSequenceClassification": (
        transformers.XLMRobertaForSequenceClassification,
        {"model_type": "xlm-roberta", "type_vocab_size": 1, "pad_token_id": 1},
    ),
}
# Lengths summing past one step's budget (40 tokens), so the core needs several steps.
LENGTHS = [3, 37, 1, 20, 12, 40, 5, 9]


# ---- factories ----
def make_hf_model(arch: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    hf_cls, arch_overrides = ARCHS[arch]
    kwargs = {**TINY, **arch_overrides, **overrides}
    config = transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    config.architectures = [arch]
    return randomize_(hf_cls(config).float(), seed).eval()


def save_checkpoint(
    hf_model: torch.nn.Module,
    path: Path,
    st_modules: list[str] | None = None,
    pooling: dict[str, Any] | None = None,
) -> str:
    """save_pretrained, plus sentence-transformers files when `st_modules` is given."""
    hf_model.save_pretrained(path)
    if st_modules is not None:
        modules = [
            {"idx": i, "name": str(i), "path": "", "type": f"sentence_transformers.models.{m}"}
            for i, m in enumerate(st_modules)
        ]
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling or {}))
    return str(path)


def make_core(path: str, **kwargs: Any) -> EngineCore:
    kwargs = {"device": "cpu", "max_num_batched_tokens": 40, "max_num_seqs": 8, **kwargs}
    return EngineCore(make_engine_config(path, **kwargs), UniProcExecutor)


def random_inputs(
    lengths: list[int], seed: int = 0, type_ids: bool = False
) -> list[dict[str, Any]]:
    """Token ids (and segment ids: a second segment from the middle on) per length."""
    rng = random.Random(seed)
    inputs = []
    for n in lengths:
        ids = [rng.randrange(3, VOCAB) for _ in range(n)]
        types = [0] * (n // 2) + [1] * (n - n // 2) if type_ids else None
        inputs.append({"ids": ids, "type_ids": types})
    return inputs


def run_core(
    core: EngineCore, inputs: list[dict[str, Any]], params: PoolingParams | list[PoolingParams]
) -> tuple[list[EngineCoreOutput], int]:
    """Queue every input, step until done: (final outputs in input order, steps taken)."""
    params = params if isinstance(params, list) else [params] * len(inputs)
    for i, (inp, p) in enumerate(zip(inputs, params, strict=True)):
        core.add_request(
            EngineCoreRequest(
                request_id=str(i),
                prompt_token_ids=inp["ids"],
                token_type_ids=inp.get("type_ids"),
                pooling_params=p,
            )
        )
    finished: dict[str, EngineCoreOutput] = {}
    steps = 0
    while core.has_work():
        steps += 1
        for out in core.step().outputs:
            if out.finish_reason is not None:
                finished[out.request_id] = out
    assert core.get_stats()["num_requests"] == 0
    return [finished[str(i)] for i in range(len(inputs))], steps


@torch.inference_mode()
def hf_forward(hf_model: torch.nn.Module, inp: dict[str, Any]) -> Any:
    kwargs = {"input_ids": torch.tensor([inp["ids"]])}
    if inp.get("type_ids") is not None:
        kwargs["token_type_ids"] = torch.tensor([inp["type_ids"]])
    return hf_model(**kwargs)


def hf_hidden(hf_model: torch.nn.Module, inp: dict[str, Any]) -> torch.Tensor:
    out = hf_forward(hf_model, inp)
    if hasattr(out, "last_hidden_state"):
        return out.last_hidden_state[0]
    return out.hidden_states[-1][0]


def checkpoint(tmp_path: Path, arch: str, **overrides: Any) -> tuple[torch.nn.Module, str]:
    hf_model = make_hf_model(arch, **overrides)
    return hf_model, save_checkpoint(hf_model, tmp_path)


# ---- encoders vs transformers ----
@pytest.mark.parametrize("arch", ["BertModel", "RobertaModel", "XLMRobertaModel"])
def test_encoder_hidden_states_match_transformers(tmp_path: Path, arch: str) -> None:
    hf_model, path = checkpoint(tmp_path, arch)
    is_bert = arch == "BertModel"
    inputs = random_inputs(LENGTHS, type_ids=is_bert)
    if not is_bert:  # a padding id inside the input: RoBERTa positions skip it, like HF
        inputs[3]["ids"][4] = hf_model.config.pad_token_id
    outs, steps = run_core(make_core(path), inputs, PoolingParams(task="encode"))
    assert steps >= 4  # sum(LENGTHS) = 127 tokens at 40 per step
    for inp, out in zip(inputs, outs, strict=True):
        assert out.error is None and out.finish_reason == FinishReason.STOP
        assert out.pooled_output.dtype == np.float32
        expected = hf_hidden(hf_model, inp)
        torch.testing.assert_close(torch.from_numpy(out.pooled_output), expected, atol=ATOL, rtol=0)


def test_token_type_ids_change_bert_output(tmp_path: Path) -> None:
    hf_model, path = checkpoint(tmp_path, "BertModel")
    with_types = random_inputs([10], type_ids=True)
    without = [{"ids": with_types[0]["ids"], "type_ids": None}]
    core = make_core(path)
    (a,), _ = run_core(core, with_types, PoolingParams(task="encode"))
    (b,), _ = run_core(core, without, PoolingParams(task="encode"))
    assert not np.allclose(a.pooled_output, b.pooled_output, atol=1e-3)
    torch.testing.assert_close(
        torch.from_numpy(b.pooled_output), hf_hidden(hf_model, without[0]), atol=ATOL, rtol=0
    )


def test_embed_defaults_to_normalized_cls_without_sentence_transformers(tmp_path: Path) -> None:
    hf_model, path = checkpoint(tmp_path, "BertModel")
    inputs = random_inputs(LENGTHS[:4])
    params = [PoolingParams(), PoolingParams(normalize=False)] * 2
    outs, _ = run_core(make_core(path), inputs, params)
    for inp, p, out in zip(inputs, params, outs, strict=True):
        cls = hf_hidden(hf_model, inp)[0]
        expected = cls if p.normalize is False else torch.nn.functional.normalize(cls, dim=-1)
        torch.testing.assert_close(torch.from_numpy(out.pooled_output), expected, atol=ATOL, rtol=0)


def st_reference(hidden: torch.Tensor, modes: tuple[str, ...]) -> torch.Tensor:
    """sentence-transformers Pooling of one unpadded sequence, written out plainly."""
    n = hidden.shape[0]
    weights = torch.arange(1, n + 1, dtype=hidden.dtype)[:, None]
    ref = {
        "cls": hidden[0],
        "max": hidden.max(0).values,
        "mean": hidden.mean(0),
        "mean_sqrt_len": hidden.sum(0) / n**0.5,
        "weightedmean": (hidden * weights).sum(0) / weights.sum(),
        "last": hidden[-1],
    }
    return torch.cat([ref[m] for m in modes])


ST_FLAGS = {
    "cls": "pooling_mode_cls_token",
    "max": "pooling_mode_max_tokens",
    "mean": "pooling_mode_mean_tokens",
    "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens",
    "weightedmean": "pooling_mode_weightedmean_tokens",
    "last": "pooling_mode_lasttoken",
}


@pytest.mark.parametrize(
    "modes, normalize",
    [(("mean",), True), (("cls", "max", "mean_sqrt_len"), False), (("weightedmean", "last"), True)],
)
def test_sentence_transformers_pooling(
    tmp_path: Path, modes: tuple[str, ...], normalize: bool
) -> None:
    hf_model = make_hf_model("BertModel")
    st_modules = ["Transformer", "Pooling"] + (["Normalize"] if normalize else [])
    path = save_checkpoint(hf_model, tmp_path, st_modules, {ST_FLAGS[m]: True for m in modes})
    assert ModelConfig(model=path).info.pooling.pooling_modes == modes
    inputs = random_inputs(LENGTHS, type_ids=True)
    outs, _ = run_core(make_core(path), inputs, PoolingParams())
    for inp, out in zip(inputs, outs, strict=True):
        expected = st_reference(hf_hidden(hf_model, inp), modes)
        if normalize:
            expected = torch.nn.functional.normalize(expected, dim=-1)
        assert out.pooled_output.shape == (32 * len(modes),)
        torch.testing.assert_close(torch.from_numpy(out.pooled_output), expected, atol=ATOL, rtol=0)


# ---- classifiers ----
@pytest.mark.parametrize(
    "arch, num_labels",
    [
        ("BertForSequenceClassification", 1),
        ("BertForSequenceClassification", 3),
        ("RobertaForSequenceClassification", 2),
        ("XLMRobertaForSequenceClassification", 1),
    ],
)
def test_classifier_matches_transformers(tmp_path: Path, arch: str, num_labels: int) -> None:
    hf_model, path = checkpoint(tmp_path, arch, num_labels=num_labels)
    inputs = random_inputs(LENGTHS, type_ids=arch.startswith("Bert"))
    tasks = ["classify", "score"] if num_labels == 1 else ["classify"]
    params = [
        PoolingParams(task=tasks[i % len(tasks)], activation=False if i % 3 == 2 else None)
        for i in range(len(inputs))
    ]
    outs, _ = run_core(make_core(path), inputs, params)
    for inp, p, out in zip(inputs, params, outs, strict=True):
        logits = hf_forward(hf_model, inp).logits[0]
        if p.activation is False:
            expected = logits
        elif num_labels == 1:
            expected = torch.sigmoid(logits)  # CrossEncoder's default for one label
        else:
            expected = torch.softmax(logits, dim=-1)
        assert out.pooled_output.shape == (num_labels,)
        torch.testing.assert_close(torch.from_numpy(out.pooled_output), expected, atol=ATOL, rtol=0)


def test_classifier_model_also_embeds(tmp_path: Path) -> None:
    hf_model, path = checkpoint(tmp_path, "RobertaForSequenceClassification", num_labels=2)
    inputs = random_inputs([7, 30])
    outs, _ = run_core(make_core(path), inputs, PoolingParams(task="embed"))
    for inp, out in zip(inputs, outs, strict=True):
        cls = hf_hidden(transformers_encoder(hf_model), inp)[0]
        expected = torch.nn.functional.normalize(cls, dim=-1)
        torch.testing.assert_close(torch.from_numpy(out.pooled_output), expected, atol=ATOL, rtol=0)


def transformers_encoder(hf_model: torch.nn.Module) -> torch.nn.Module:
    return getattr(hf_model, hf_model.base_model_prefix)


# ---- loading ----
@pytest.mark.parametrize("arch", list(ARCHS))
def test_load_weights_covers_every_parameter(tmp_path: Path, arch: str) -> None:
    hf_model, path = checkpoint(tmp_path, arch)
    ours = construct_model(hf_model.config, "cpu", torch.float32)
    assert type(ours).__name__ == arch
    loaded = ours.load_weights(iterate_weights(path))
    assert loaded == {name for name, _ in ours.named_parameters()}
    hf_numel = sum(p.numel() for p in hf_model.parameters())
    if arch in ("BertModel", "RobertaModel", "XLMRobertaModel"):  # HF's unused pooler.dense
        hf_numel -= sum(p.numel() for p in hf_model.pooler.parameters())
    assert sum(p.numel() for p in ours.parameters()) == hf_numel


@pytest.mark.parametrize(
    "hf_cls, ours_cls",
    [
        (transformers.BertForMaskedLM, bert.BertForMaskedLM),
        (transformers.XLMRobertaForMaskedLM, bert.XLMRobertaForMaskedLM),
    ],
)
def test_masked_lm_checkpoints_load_as_encoders(tmp_path: Path, hf_cls: Any, ours_cls: Any) -> None:
    """*ForMaskedLM checkpoints serve as embedding models: the LM head is skipped at load."""
    model_type = "bert" if ours_cls is bert.BertForMaskedLM else "xlm-roberta"
    config = transformers.AutoConfig.for_model(model_type, **TINY, pad_token_id=1)
    hf_model = hf_cls(config).float()
    hf_model.save_pretrained(tmp_path)
    ours = ours_cls(config)
    loaded = ours.load_weights(iterate_weights(str(tmp_path)))
    assert loaded == {name for name, _ in ours.named_parameters()}
    encoder = getattr(hf_model, hf_model.base_model_prefix)  # built without HF's pooler
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in encoder.parameters())


def rewrite(src: str, dst: Path, rename: Any = None, drop: str | None = None) -> str:
    tensors = load_file(Path(src) / "model.safetensors")
    if drop is not None:
        del tensors[drop]
    if rename is not None:
        tensors = {rename(k): v for k, v in tensors.items()}
    save_file(tensors, dst / "model.safetensors")
    (dst / "config.json").write_text((Path(src) / "config.json").read_text())
    return str(dst)


def test_bert_names_with_or_without_prefix_load_the_same(tmp_path: Path) -> None:
    """A bare BertModel (sentence-transformers) and a `bert.`-prefixed one with an MLM head."""
    hf_model, path = checkpoint(tmp_path / "bare", "BertModel")
    prefixed = tmp_path / "prefixed"
    prefixed.mkdir()
    rewrite(path, prefixed, rename=lambda k: f"bert.{k}")
    extra = load_file(prefixed / "model.safetensors")
    extra["cls.predictions.bias"] = torch.zeros(VOCAB)
    save_file(extra, prefixed / "model.safetensors")
    inputs = random_inputs([6, 11], type_ids=True)
    for folder in (path, str(prefixed)):
        outs, _ = run_core(make_core(folder), inputs, PoolingParams(task="encode"))
        for inp, out in zip(inputs, outs, strict=True):
            expected = hf_hidden(hf_model, inp)
            torch.testing.assert_close(
                torch.from_numpy(out.pooled_output), expected, atol=ATOL, rtol=0
            )


def test_classifier_pooler_is_required_and_strangers_refused(tmp_path: Path) -> None:
    _, path = checkpoint(tmp_path / "src", "BertForSequenceClassification")
    (tmp_path / "a").mkdir()
    missing = rewrite(path, tmp_path / "a", drop="bert.pooler.dense.weight")
    with pytest.raises(ValueError, match=r"missing 1 parameter.*bert\.pooler\.dense\.weight"):
        load_model(ModelConfig(model=missing), "cpu", torch.float32)
    (tmp_path / "b").mkdir()
    stranger = rewrite(path, tmp_path / "b", rename=lambda k: k.replace("classifier", "head"))
    with pytest.raises(ValueError, match=r"match no parameter.*head\.weight"):
        load_model(ModelConfig(model=stranger), "cpu", torch.float32)


# ---- per-request errors: clear messages, the engine keeps serving ----
def test_bad_requests_fail_alone_and_the_engine_keeps_serving(tmp_path: Path) -> None:
    # RoBERTa: 34 position embeddings hold 32 tokens (positions start at padding_idx + 1).
    hf_model, path = checkpoint(
        tmp_path, "RobertaForSequenceClassification", num_labels=3, max_position_embeddings=34
    )
    core = make_core(path, max_num_batched_tokens=64)
    good = random_inputs([32])[0]
    cases = [
        ({"ids": []}, PoolingParams(), "empty"),
        (random_inputs([33])[0], PoolingParams(task="encode"), "limit of 32"),
        (good, PoolingParams(dimensions=8), "Matryoshka"),
        (good, PoolingParams(task="score"), "one label"),
    ]
    for inp, params, message in cases:
        (bad,), _ = run_core(core, [inp], params)
        assert bad.finish_reason == FinishReason.ERROR and message in bad.error
        (ok,), _ = run_core(core, [good], PoolingParams(task="classify"))
        assert ok.error is None
        expected = torch.softmax(hf_forward(hf_model, good).logits[0], dim=-1)
        torch.testing.assert_close(torch.from_numpy(ok.pooled_output), expected, atol=ATOL, rtol=0)


def test_classify_needs_a_classifier(tmp_path: Path) -> None:
    _, path = checkpoint(tmp_path, "BertModel")
    (out,), _ = run_core(make_core(path), random_inputs([5]), PoolingParams(task="classify"))
    assert out.finish_reason == FinishReason.ERROR and "no classifier head" in out.error


# ---- Matryoshka ----
def test_matryoshka_dimensions_truncate_then_normalize(tmp_path: Path) -> None:
    hf_model, path = checkpoint(tmp_path, "BertModel")
    core = make_core(path, hf_overrides={"matryoshka_dimensions": [8, 16]})
    inputs = random_inputs([9, 21])
    params = [PoolingParams(dimensions=8), PoolingParams(dimensions=16, normalize=False)]
    outs, _ = run_core(core, inputs, params)
    for inp, p, out in zip(inputs, params, outs, strict=True):
        cls = hf_hidden(hf_model, inp)[0, : p.dimensions]
        expected = cls if p.normalize is False else torch.nn.functional.normalize(cls, dim=-1)
        assert out.pooled_output.shape == (p.dimensions,)
        torch.testing.assert_close(torch.from_numpy(out.pooled_output), expected, atol=ATOL, rtol=0)
    (bad,), _ = run_core(core, inputs[:1], PoolingParams(dimensions=12))
    assert bad.finish_reason == FinishReason.ERROR and "[8, 16]" in bad.error


def test_validate_pooling_params_at_the_edge() -> None:
    plain = ModelPoolingConfig(hidden_size=32)
    any_width = ModelPoolingConfig(hidden_size=32, is_matryoshka=True)
    cross = ModelPoolingConfig(hidden_size=32, num_labels=1, classifier_activation="sigmoid")
    validate_pooling_params(any_width, PoolingParams(dimensions=32))
    validate_pooling_params(cross, PoolingParams(task="score"))
    bad = [
        (plain, PoolingParams(dimensions=4), "Matryoshka"),
        (any_width, PoolingParams(dimensions=33), "exceeds the embedding size 32"),
        (any_width, PoolingParams(task="encode", dimensions=4), "task 'embed' only"),
        (plain, PoolingParams(task="classify"), "no classifier head"),
    ]
    for config, params, message in bad:
        with pytest.raises(ValueError, match=message):
            validate_pooling_params(config, params)


# ---- pooling layer ----
def test_segment_pooling_matches_per_request_loops() -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 4, 9, 2]
    hidden = torch.randn(sum(lengths), 6, generator=gen)
    seg = PoolingSegments.from_lengths(np.array(lengths), torch.device("cpu"))
    parts = hidden.split(lengths)
    for mode in ST_FLAGS:
        expected = torch.stack([st_reference(p, (mode,)) for p in parts])
        torch.testing.assert_close(pool_tokens(hidden, seg, mode), expected, atol=1e-6, rtol=0)


def test_pooler_mixes_tasks_in_one_batch() -> None:
    config = ModelPoolingConfig(
        pooling_modes=("mean",), hidden_size=4, num_labels=2, classifier_activation="softmax"
    )
    weight = torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]])
    pooler = Pooler(config, classify=lambda h: h @ weight.T)
    hidden = torch.arange(20, dtype=torch.float32).reshape(5, 4)  # requests of 2 and 3 tokens
    seg = PoolingSegments.from_lengths(np.array([2, 3]), torch.device("cpu"))
    embed, encode = PoolingParams(normalize=False), PoolingParams(task="encode")
    out = pooler(hidden, seg, [embed, encode])
    np.testing.assert_allclose(out[0], hidden[:2].mean(0).numpy())
    np.testing.assert_allclose(out[1], hidden[2:].numpy())
    out = pooler(hidden, seg, [PoolingParams(task="classify", activation=False), embed])
    np.testing.assert_allclose(out[0], [0.0, 1.0])  # first token [0, 1, 2, 3] -> logits
    assert all(o.dtype == np.float32 for o in out)


def test_pooler_results_of_a_mixed_step_are_each_requests_own() -> None:
    """Every task and option in one step, interleaved: each request gets what the pooler gives
    it alone, in its place (the results travel stacked per group of equal options)."""
    config = ModelPoolingConfig(
        pooling_modes=("mean", "cls"),
        hidden_size=4,
        num_labels=2,
        classifier_activation="softmax",
        is_matryoshka=True,
    )
    weight = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    pooler = Pooler(config, classify=lambda h: h @ weight.T)
    params = [
        PoolingParams(task="score"),
        PoolingParams(task="encode", normalize=True),
        PoolingParams(dimensions=3),
        PoolingParams(task="classify", activation=False),
        PoolingParams(),
        PoolingParams(task="encode"),
        PoolingParams(task="classify"),
        PoolingParams(normalize=False),
    ]
    lengths = [3, 1, 4, 2, 5, 3, 2, 1]
    hidden = torch.randn(sum(lengths), 4, generator=torch.Generator().manual_seed(0))
    out = pooler(hidden, PoolingSegments.from_lengths(np.array(lengths), hidden.device), params)
    assert len(out) == len(params)
    start = 0
    for n, p, result in zip(lengths, params, out, strict=True):
        seg = PoolingSegments.from_lengths(np.array([n]), hidden.device)
        (alone,) = pooler(hidden[start : start + n], seg, [p])
        start += n
        assert result.dtype == np.float32 and result.shape == alone.shape
        np.testing.assert_allclose(result, alone, rtol=0, atol=1e-6)
    assert out[1].shape == (1, 4) and out[5].shape == (3, 4)  # encode: per token
    assert out[2].shape == (3,) and out[4].shape == (8,)  # dimensions; two pooling modes
    np.testing.assert_array_equal(out[5], hidden[15:18].numpy())


# ---- sentence-transformers folders ----
@pytest.mark.skipif(not MINILM.is_dir(), reason="needs ../shared/assets/all-MiniLM-L6-v2")
def test_minilm_pooling_config() -> None:
    config = ModelConfig(model=str(MINILM)).info.pooling
    assert config.pooling_modes == ("mean",) and config.normalize
    assert config.max_input_len == 256  # sentence_bert_config.json, below the 512 positions
    assert (
        config.is_sentence_transformers and not config.is_matryoshka and not config.has_classifier
    )


def test_sentence_transformers_files_are_checked(tmp_path: Path) -> None:
    hf_model = make_hf_model("BertModel")
    path = save_checkpoint(hf_model, tmp_path, ["Transformer", "Pooling", "Dense"], {})
    with pytest.raises(ValueError, match=r"models\.Dense.*not supported"):
        _ = ModelConfig(model=path).info.pooling
    with pytest.raises(ValueError, match="no pooling mode"):
        pooling_modes_of({"pooling_mode_mean_tokens": False})
    assert pooling_modes_of({"pooling_mode": "lasttoken"}) == ("last",)
    assert pooling_modes_of({ST_FLAGS["last"]: True, ST_FLAGS["cls"]: True}) == ("cls", "last")


def test_classifier_activation_choice() -> None:
    cfg = transformers.BertConfig(num_labels=3)
    assert classifier_activation_of(cfg, 3) == "softmax"
    assert classifier_activation_of(cfg, 1) == "sigmoid"
    cfg.problem_type = "multi_label_classification"
    assert classifier_activation_of(cfg, 3) == "sigmoid"
    cfg.sbert_ce_default_activation_function = "torch.nn.modules.linear.Identity"
    assert classifier_activation_of(cfg, 1) == "none"


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
            ],
        ),
    ],
)
@pytest.mark.parametrize("arch", ["BertModel", "RobertaModel"])
def test_padded_steps_match_transformers(
    tmp_path: Path, arch: str, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An eager step's tokens padded to a repeating count (as on CUDA; forced here on CPU too):
    the padding rows change no request's hidden states, token types included."""
    from v1.worker import step_inputs

    monkeypatch.setattr(step_inputs, "PAD_TOKENS", True)
    hf_model, path = checkpoint(tmp_path, arch)
    is_bert = arch == "BertModel"
    inputs = random_inputs(LENGTHS + [33, 31, 30], type_ids=is_bert)
    core = make_core(path, device=device, dtype="float32", max_num_batched_tokens=128)
    outs, _ = run_core(core, inputs, PoolingParams(task="encode"))
    for inp, out in zip(inputs, outs, strict=True):
        expected = hf_hidden(hf_model, inp)
        torch.testing.assert_close(torch.from_numpy(out.pooled_output), expected, atol=ATOL, rtol=0)


def test_encoder_graph_offsets_cover_padding_in_short_sequences() -> None:
    from v1.worker.encoder_graphs import graph_offsets, graph_sizes

    assert graph_sizes(3000) == [1024, 2048, 3072]
    assert len(graph_sizes(65536)) == 64 and graph_sizes(200_000)[:2] == [4096, 8192]
    qsl = np.array([0, 5, 40, 700])
    out = graph_offsets(qsl, 1024, num_slots=10, max_len=128)
    # 324 padding rows as sequences of at most 128 tokens, then empty sequences.
    assert out.tolist() == [0, 5, 40, 700, 828, 956, 1024, 1024, 1024, 1024, 1024]
    assert graph_offsets(np.array([0, 1024]), 1024, 3, 512).tolist() == [0, 1024, 1024, 1024]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["BertModel", "RobertaModel"])
def test_cuda_graph_steps_match_eager_steps(tmp_path: Path, arch: str) -> None:
    """fp16 steps replayed on encoder CUDA graphs (mixed lengths, several steps, a step past
    the first graph size) give the eager steps' hidden states."""
    hf_model, path = checkpoint(tmp_path, arch)
    inputs = random_inputs(LENGTHS * 40, type_ids=arch == "BertModel")  # 5,080 tokens
    kwargs = dict(device="cuda", dtype="float16", max_num_batched_tokens=2048, max_num_seqs=96)
    graphed_core = make_core(path, **kwargs)
    graphs = graphed_core.executor.worker.model_runner.state.graphs
    assert graphs is not None and graphs.sizes == [1024, 2048]
    graphed, _ = run_core(graphed_core, inputs, PoolingParams(task="encode"))
    assert graphs.num_replays >= 3
    eager, _ = run_core(
        make_core(path, enforce_eager=True, **kwargs), inputs, PoolingParams(task="encode")
    )
    for a, b in zip(graphed, eager, strict=True):
        np.testing.assert_allclose(a.pooled_output, b.pooled_output, atol=1e-2, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["BertModel", "RobertaModel"])
@pytest.mark.parametrize("heads", [2, 4], ids=["head64", "head32"])
def test_triton_encoder_only_attention_matches_transformers(
    tmp_path: Path, arch: str, heads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Heads of 64 and 32 (bert-base's and MiniLM's) in fp16 run the Triton encoder-only
    kernel, in CUDA graphs and eagerly: hidden states match transformers' (fp32) and aten's
    flash varlen (V1_TRITON_ENCODER_ONLY=0) on lengths below, at and past its tiles."""
    from v1 import envs
    from v1.attention.ops import triton_encoder_attention as kernel

    calls: list[int] = []
    run = kernel.encoder_attention
    monkeypatch.setattr(
        kernel, "encoder_attention", lambda *a, **k: calls.append(1) or run(*a, **k)
    )
    hf_model, path = checkpoint(
        tmp_path, arch, hidden_size=128, num_attention_heads=heads, max_position_embeddings=160
    )
    inputs = random_inputs([150, 64, 65, 1, 127, 33, 32, 2] * 12, type_ids=arch == "BertModel")
    kwargs = dict(device="cuda", dtype="float16", max_num_batched_tokens=1024, max_num_seqs=64)
    outs = {}
    for name, triton_kernel, eager in [
        ("graphs", True, False),
        ("eager", True, True),
        ("flash", False, False),
    ]:
        monkeypatch.setattr(envs, "V1_TRITON_ENCODER_ONLY", triton_kernel)
        calls.clear()
        core = make_core(path, enforce_eager=eager, **kwargs)
        outs[name], _ = run_core(core, inputs, PoolingParams(task="encode"))
        assert bool(calls) == triton_kernel, name
    for i, inp in enumerate(inputs[:8]):
        expected = hf_hidden(hf_model, inp)
        got = torch.from_numpy(outs["graphs"][i].pooled_output)
        torch.testing.assert_close(got, expected, atol=3e-2, rtol=0)
    for other in ("eager", "flash"):
        for a, b in zip(outs["graphs"], outs[other], strict=True):
            np.testing.assert_allclose(a.pooled_output, b.pooled_output, atol=1e-2, rtol=0)
