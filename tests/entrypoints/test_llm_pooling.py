"""The offline pooling API end to end: real all-MiniLM-L6-v2 embeddings against transformers and
the reference similarities, a tiny cross-encoder's score/rerank/classify on text pairs, and
input errors that leave the engine serving."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from tests.models.hf_reference import randomize_
from v1 import LLM, PoolingParams

MINILM = Path(__file__).resolve().parents[3] / "shared" / "assets" / "all-MiniLM-L6-v2"
needs_minilm = pytest.mark.skipif(
    not MINILM.is_dir(), reason="needs ../shared/assets/all-MiniLM-L6-v2"
)
README_TEXTS = [
    "The new movie is awesome",
    "The new movie is so great",
    "A monkey is playing drums.",
]
MORE_TEXTS = [
    "Encoder-only models pool their hidden states into one vector per input text.",
    "hi",
    "A man is eating food while a woman plays the violin in the park next to the river.",
]
WORDS = [
    "the",
    "a",
    "movie",
    "is",
    "great",
    "bad",
    "query",
    "document",
    "relevant",
    "about",
    "cats",
    "dogs",
    "play",
    "music",
]


def make_llm(path: str | Path, **kwargs: Any) -> LLM:
    kwargs = {"device": "cpu", "multiprocess": False, "max_num_batched_tokens": 32, **kwargs}
    return LLM(str(path), **kwargs)


@pytest.fixture(scope="module")
def minilm() -> LLM:
    if not MINILM.is_dir():
        pytest.skip("needs ../shared/assets/all-MiniLM-L6-v2")
    llm = make_llm(MINILM)
    yield llm
    llm.shutdown()


@torch.inference_mode()
def transformers_embeddings(texts: list[str]) -> np.ndarray:
    """sentence-transformers' recipe by hand: mean over the attention mask, then L2 norm."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(MINILM)
    model = transformers.AutoModel.from_pretrained(MINILM, dtype=torch.float32).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    mean = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(mean, dim=-1).numpy()


# ---- real MiniLM ----
@needs_minilm
def test_minilm_embeddings_match_transformers(minilm: LLM) -> None:
    texts = README_TEXTS + MORE_TEXTS  # ~50 tokens in all: several 32-token steps
    ours = np.array([o.outputs.embedding for o in minilm.embed(texts, use_tqdm=False)])
    expected = transformers_embeddings(texts)
    assert ours.shape == (len(texts), 384)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    cosines = (ours * expected).sum(1)
    assert (cosines >= 0.99999).all(), cosines


@needs_minilm
def test_minilm_reference_similarities(minilm: LLM) -> None:
    a, b, c = (np.array(o.outputs.embedding) for o in minilm.embed(README_TEXTS, use_tqdm=False))
    assert abs(float(a @ b) - 0.89392) < 1e-4
    assert abs(float(a @ c) - (-0.02990)) < 1e-4
    scores = minilm.score(README_TEXTS[0], README_TEXTS[1:], use_tqdm=False)
    np.testing.assert_allclose([s.outputs.score for s in scores], [0.89392, -0.02990], atol=1e-4)


@needs_minilm
def test_minilm_input_errors_leave_the_engine_serving(minilm: LLM) -> None:
    with pytest.raises(ValueError, match="empty"):
        minilm.embed("", use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        minilm.embed("word " * 600, use_tqdm=False)
    # Rejected at the frontend (ValueError) or, failing that, by the engine for this request.
    with pytest.raises((ValueError, RuntimeError), match="Matryoshka"):
        minilm.embed("hello", pooling_params=PoolingParams(dimensions=64), use_tqdm=False)
    (truncated,) = minilm.embed("word " * 600, truncate_prompt_tokens=-1, use_tqdm=False)
    assert len(truncated.outputs.embedding) == 384
    (ok,) = minilm.embed(README_TEXTS[0], use_tqdm=False)
    np.testing.assert_allclose(
        ok.outputs.embedding, transformers_embeddings(README_TEXTS[:1])[0], atol=1e-5
    )


@needs_minilm
def test_minilm_matryoshka_when_enabled() -> None:
    llm = make_llm(MINILM, hf_overrides={"is_matryoshka": True})
    try:
        full, short = llm.embed(
            [README_TEXTS[0]] * 2,
            pooling_params=[PoolingParams(normalize=False), PoolingParams(dimensions=64)],
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    head = np.array(full.outputs.embedding[:64])
    np.testing.assert_allclose(short.outputs.embedding, head / np.linalg.norm(head), atol=1e-5)


# ---- a tiny cross-encoder on text pairs ----
def make_cross_encoder(path: Path, num_labels: int) -> torch.nn.Module:
    """A random BertForSequenceClassification with a small WordPiece vocabulary."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *letters]
    vocab += [f"##{c}" for c in letters]
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    transformers.BertTokenizerFast(vocab_file=str(path / "vocab.txt")).save_pretrained(path)
    config = transformers.BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
        num_labels=num_labels,
        architectures=["BertForSequenceClassification"],
    )
    model = randomize_(transformers.BertForSequenceClassification(config).float()).eval()
    model.save_pretrained(path)
    return model


@torch.inference_mode()
def transformers_logits(model: torch.nn.Module, path: Path, a: str, b: str | None) -> torch.Tensor:
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return model(**tokenizer(a, b, return_tensors="pt")).logits[0]


def test_cross_encoder_score_and_rerank(tmp_path: Path) -> None:
    model = make_cross_encoder(tmp_path, num_labels=1)
    query = "query about cats"
    docs = ["the cats play music", "dogs", "a great movie about dogs and cats", "bad document"]
    llm = make_llm(tmp_path)
    try:
        scores = [s.outputs.score for s in llm.score(query, docs, use_tqdm=False)]
        ranked = llm.rerank(query, docs, top_n=3, use_tqdm=False)
        with pytest.raises((ValueError, RuntimeError), match="Matryoshka"):
            llm.embed(query, pooling_params=PoolingParams(dimensions=4), use_tqdm=False)
        again = llm.score(query, docs[0], use_tqdm=False)
    finally:
        llm.shutdown()
    # CrossEncoder's default for one label: sigmoid of the logit; pairs carry segment ids.
    expected = [float(torch.sigmoid(transformers_logits(model, tmp_path, query, d))) for d in docs]
    np.testing.assert_allclose(scores, expected, atol=1e-4)
    assert [r.index for r in ranked] == list(np.argsort(expected)[::-1][:3])
    assert again[0].outputs.score == pytest.approx(expected[0], abs=1e-4)


def test_sequence_classifier_classify(tmp_path: Path) -> None:
    model = make_cross_encoder(tmp_path, num_labels=3)
    texts = ["the movie is great", "bad", "dogs play music about the cats " * 3]
    llm = make_llm(tmp_path)
    try:
        probs = [o.outputs.probs for o in llm.classify(texts, use_tqdm=False)]
        raw = llm.classify(texts[0], pooling_params=PoolingParams(activation=False), use_tqdm=False)
    finally:
        llm.shutdown()
    for text, p in zip(texts, probs, strict=True):
        expected = torch.softmax(transformers_logits(model, tmp_path, text, None), dim=-1)
        np.testing.assert_allclose(p, expected.numpy(), atol=1e-4)
    logits = transformers_logits(model, tmp_path, texts[0], None)
    np.testing.assert_allclose(raw[0].outputs.probs, logits.numpy(), atol=1e-4)
