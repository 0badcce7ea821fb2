"""v1/outputs.py: the embedding output keeps the engine's float32 array and makes its float list
at first read."""

from __future__ import annotations

import numpy as np
import pytest

from v1.outputs import EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput


def test_embedding_output_from_an_array_keeps_it_and_lists_it_once() -> None:
    data = np.array([0.5, -1.25, 3.0], dtype=np.float32)
    out = EmbeddingOutput.from_base(PoolingOutput(data))
    assert out.data is data  # no copy, no float list yet
    assert out._embedding is None
    values = out.embedding
    assert values == [0.5, -1.25, 3.0] and all(type(v) is float for v in values)
    assert out.embedding is values  # made once
    assert out.hidden_size == 3


def test_embedding_output_from_a_list_and_equality() -> None:
    out = EmbeddingOutput([1.0, 2.0])
    assert out.embedding == [1.0, 2.0]
    assert out.data.dtype == np.float32 and out.data.tolist() == [1.0, 2.0]
    assert out == EmbeddingOutput(np.array([1.0, 2.0], dtype=np.float32))
    assert out != EmbeddingOutput([1.0, 3.0])
    assert repr(out) == "EmbeddingOutput(embedding=[1.0, 2.0])"


def test_embedding_output_rejects_a_matrix() -> None:
    with pytest.raises(ValueError, match="one vector"):
        EmbeddingOutput.from_base(PoolingOutput(np.zeros((2, 3), dtype=np.float32)))


def test_embedding_request_output_from_base() -> None:
    base = PoolingRequestOutput("r", PoolingOutput(np.ones(4, np.float32)), [1, 2], True)
    out = EmbeddingRequestOutput.from_base(base)
    assert out.request_id == "r" and out.prompt_token_ids == [1, 2] and out.finished
    assert out.outputs.embedding == [1.0] * 4


def test_pooling_request_outputs_keep_every_field_when_converted() -> None:
    """The typed outputs of embed / classify / score keep the error and the queue time (the
    queue time was dropped by the conversion before)."""
    from v1.outputs import ClassificationRequestOutput, ScoringRequestOutput

    for cls, data in (
        (EmbeddingRequestOutput, np.ones(2, np.float32)),
        (ClassificationRequestOutput, np.array([0.25, 0.75], np.float32)),
        (ScoringRequestOutput, np.array([0.5], np.float32)),
    ):
        base = PoolingRequestOutput("r", PoolingOutput(data), [7], True, "bad input", 0.25)
        out = cls.from_base(base)
        assert type(out) is cls and type(out.outputs) is cls.output_type
        assert (out.request_id, out.prompt_token_ids, out.finished) == ("r", [7], True)
        assert (out.error, out.queue_time, out.finish_reason) == ("bad input", 0.25, "error")
