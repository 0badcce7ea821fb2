"""Model protocols (v1/models/interfaces.py): what each model-kind state calls is checked once
when the EngineCore loads the model; a model without it fails there, naming what it lacks."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.models.test_bert import make_core as make_bert_core
from tests.models.test_bert import make_hf_model, save_checkpoint
from tests.utils import make_tiny_llama_dir
from v1.config import make_engine_config
from v1.core.engine_core import EngineCore
from v1.executor.uniproc import UniProcExecutor
from v1.models import registry
from v1.models.interfaces import (
    SupportsClassify,
    SupportsEncode,
    SupportsLogits,
    SupportsWhisper,
    protocol_members,
    require,
)


def test_protocol_members_include_the_extended_protocols() -> None:
    assert protocol_members(SupportsLogits) == ["compute_logits"]
    assert protocol_members(SupportsClassify) == ["classify"]
    assert protocol_members(SupportsWhisper) == ["alignment_attention", "compute_logits", "encode"]


def test_require_names_every_missing_member() -> None:
    class Half:
        def encode(self) -> None:
            return None

    require(Half(), (SupportsEncode,), "a test")
    with pytest.raises(TypeError) as e:
        require(Half(), (SupportsEncode, SupportsLogits, SupportsClassify), "a test")
    assert str(e.value) == (
        "Half cannot be served by a test: it lacks classify, compute_logits (required by "
        "SupportsEncode, SupportsLogits, SupportsClassify in v1/models/interfaces.py)"
    )


@pytest.mark.parametrize("arch", registry.supported_architectures())
def test_registered_models_have_their_methods(arch: str) -> None:
    """The methods (instance attributes are set in __init__) each kind's protocols name."""
    cls = registry.get_model_class(arch)
    spec = registry.get_model_spec(arch)
    if spec.kind == registry.ModelKind.ENCODER_ONLY:
        protocols: tuple[type, ...] = (SupportsClassify,) if spec.has_classifier(arch) else ()
    elif spec.speech_tasks:
        protocols = (SupportsWhisper,)
    elif spec.kind == registry.ModelKind.ENCODER_DECODER:
        protocols = (SupportsLogits, SupportsEncode)
    else:
        protocols = (SupportsLogits,)
    for protocol in protocols:
        for name in protocol_members(protocol):
            if callable(getattr(protocol, name, None)):
                assert callable(getattr(cls, name, None)), f"{arch} has no {name}"


# ---- at load, through the EngineCore ----


def forward_only(cls: type[nn.Module]) -> type[nn.Module]:
    """A model class that serves `cls`'s checkpoints with its forward and nothing else."""

    class ForwardOnly(nn.Module):
        def __init__(self, hf_config: Any) -> None:
            super().__init__()
            self.inner = cls(hf_config)

        def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            return self.inner(*args, **kwargs)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            return {f"inner.{name}" for name in self.inner.load_weights(weights)}

    return ForwardOnly


@pytest.fixture
def forward_only_models(monkeypatch: pytest.MonkeyPatch) -> None:
    real = registry.get_model_class
    monkeypatch.setattr(
        "v1.worker.model_loader.get_model_class", lambda arch: forward_only(real(arch))
    )


@pytest.mark.usefixtures("forward_only_models")
def test_a_causal_lm_without_compute_logits_fails_at_load(tmp_path: Path) -> None:
    path = make_tiny_llama_dir(tmp_path)
    with pytest.raises(
        TypeError,
        match=r"ForwardOnly cannot be served by DecoderOnlyState: "
        r"it lacks compute_logits \(required by SupportsLogits",
    ):
        EngineCore(make_engine_config(path, device="cpu", dtype="float32"), UniProcExecutor)


@pytest.mark.usefixtures("forward_only_models")
def test_a_classifier_without_classify_fails_at_load(tmp_path: Path) -> None:
    path = save_checkpoint(make_hf_model("BertForSequenceClassification"), tmp_path / "cls")
    with pytest.raises(TypeError, match=r"EncoderOnlyState \(a classifier\): it lacks classify"):
        make_bert_core(path)
    # An embedding model needs no head: the same wrapper loads.
    path = save_checkpoint(make_hf_model("BertModel"), tmp_path / "embed")
    core = make_bert_core(path)
    assert type(core.executor.worker.model_runner.model).__name__ == "ForwardOnly"
    core.shutdown()
