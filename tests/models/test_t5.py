"""T5 v1.0, v1.1 (flan-T5) and mT5 through EngineCore against transformers' greedy `generate`
(tokens and logprobs) under preemption and small token/encoder budgets, their weight loading
(aliases, tied and untied heads), and T5EncoderModel through the encoder-only path."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import (
    MT5Config,
    MT5ForConditionalGeneration,
    T5Config,
    T5ForConditionalGeneration,
)
from transformers import T5EncoderModel as HFT5EncoderModel

from tests.utils import make_tiny_tokenizer
from v1.config import make_engine_config
from v1.core.engine_core import EngineCore
from v1.core.protocol import EncoderInput, EngineCoreOutput, EngineCoreRequest, FinishReason
from v1.executor.uniproc import UniProcExecutor
from v1.models import t5
from v1.pooling_params import PoolingParams
from v1.sampling_params import SamplingParams
from v1.worker.model_loader import construct_model, iterate_weights

TINY_T5 = dict(
    vocab_size=128,
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_decoder_layers=2,
    num_heads=4,
    relative_attention_num_buckets=16,
    relative_attention_max_distance=24,
    decoder_start_token_id=0,
    pad_token_id=0,
    eos_token_id=1,
)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Ops on 32-wide models are far too small for intra-op threads, which only add overhead
    (a lot of it on a busy machine)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@dataclass(frozen=True)
class Variant:
    config_cls: type
    model_cls: type
    untied_head: bool
    seed: int
    """Seed and initializer_factor picked so that greedy outputs do not collapse into one
    repeated token."""
    overrides: dict[str, Any] = field(default_factory=dict)


VARIANTS = {
    "t5-v1.0": Variant(
        T5Config,
        T5ForConditionalGeneration,
        untied_head=False,
        seed=2,
        overrides=dict(feed_forward_proj="relu", initializer_factor=5.0),
    ),
    "flan-t5-v1.1": Variant(
        T5Config,
        T5ForConditionalGeneration,
        untied_head=True,
        seed=0,
        overrides=dict(feed_forward_proj="gated-gelu", initializer_factor=5.0),
    ),
    # Heads * d_kv (64) != d_model, and a deeper encoder than decoder.
    "mt5": Variant(
        MT5Config,
        MT5ForConditionalGeneration,
        untied_head=True,
        seed=2,
        overrides=dict(initializer_factor=5.0, d_kv=16, num_layers=3),
    ),
}

ENCODER_INPUTS = [
    [5, 17, 3, 60, 42, 7, 7, 20, 64, 2],
    [11],
    list(range(2, 40)),
    [50, 8, 30, 31, 32, 4, 9],
    [90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100, 101, 102, 103, 4, 5, 6, 7, 8, 9, 10, 12, 13],
    [5, 17, 3, 60, 42, 7, 7, 20, 64, 2],  # the first input again: same content hash
]
MAX_TOKENS = [16, 8, 16, 12, 14, 16]
STOP_AT_EOS = 3
"""This request stops at a chosen EOS token (the others ignore EOS)."""


BIAS_GAIN = 20.0
"""Random q.k scores are large enough to saturate softmax on their own, which would make the
relative bias irrelevant (and a wrong bias undetectable); scaled up, the bias decides."""


def write_checkpoint(path: Path, variant: Variant) -> Any:
    """Save a random model as a real checkpoint would look (v1.0: tied, every embedding alias
    stored; v1.1/mT5: `tie_word_embeddings: false` and a head of its own) and return
    transformers' model loaded from it."""
    cfg = variant.config_cls(**{**TINY_T5, **variant.overrides})
    cfg.architectures = [variant.model_cls.__name__]
    torch.manual_seed(variant.seed)
    model = variant.model_cls(cfg)
    state = {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}
    for name in state:
        if name.endswith("relative_attention_bias.weight"):
            state[name] = state[name] * BIAS_GAIN
    if variant.untied_head:
        gen = torch.Generator().manual_seed(variant.seed)
        state["lm_head.weight"] = torch.randn(state["lm_head.weight"].shape, generator=gen)
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(path)
    config_json = json.loads((path / "config.json").read_text())
    config_json["tie_word_embeddings"] = not variant.untied_head
    config_json.pop("scale_decoder_outputs", None)  # as checkpoints from before transformers 5
    (path / "config.json").write_text(json.dumps(config_json))
    hf_model = variant.model_cls.from_pretrained(path).eval()
    tied = hf_model.lm_head.weight.data_ptr() == hf_model.shared.weight.data_ptr()
    assert tied != variant.untied_head
    for stack in (hf_model.encoder, hf_model.decoder):
        assert bias_direction_changes_logits(hf_model, stack)
    return hf_model


@torch.inference_mode()
def bias_direction_changes_logits(hf_model: Any, stack: Any) -> bool:
    """Whether flipping one stack's bidirectional buckets changes transformers' logits: the
    checkpoint can tell a correct relative bias from a wrong one."""
    inputs = dict(
        input_ids=torch.tensor([ENCODER_INPUTS[4]]),
        decoder_input_ids=torch.tensor([[0] + [5, 9] * 6]),
        use_cache=False,
    )
    attn = stack.block[0].layer[0].SelfAttention
    before = hf_model(**inputs).logits
    attn.is_decoder = not attn.is_decoder  # transformers buckets bidirectionally iff not
    try:
        after = hf_model(**inputs).logits
    finally:
        attn.is_decoder = not attn.is_decoder
    return bool((before - after).abs().max() > 1.0)


@dataclass
class Reference:
    token_ids: list[int]
    logprobs: list[float]
    eos_token_id: int | None


@torch.inference_mode()
def hf_greedy(hf_model: Any, encoder_ids: list[int], max_tokens: int, eos: int | None) -> Reference:
    """transformers' greedy generation: the tokens after decoder_start and their logprobs."""
    hf_model.generation_config.eos_token_id = eos
    out = hf_model.generate(
        torch.tensor([encoder_ids]),
        max_new_tokens=max_tokens,
        do_sample=False,
        num_beams=1,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, 1:].tolist()
    logprobs = [
        float(torch.log_softmax(step[0].float(), -1)[t])
        for step, t in zip(out.logits, tokens, strict=True)
    ]
    return Reference(tokens, logprobs, eos)


def references(hf_model: Any) -> list[Reference]:
    computed: dict[tuple[int, ...], Reference] = {}  # equal inputs: one generate call
    refs = []
    for ids, n in zip(ENCODER_INPUTS, MAX_TOKENS, strict=True):
        if (*ids, n) not in computed:
            computed[(*ids, n)] = hf_greedy(hf_model, ids, n, eos=None)
        refs.append(computed[(*ids, n)])
    # A stop token the model reaches mid-sequence: transformers ends at its first occurrence.
    eos = refs[STOP_AT_EOS].token_ids[4]
    refs[STOP_AT_EOS] = hf_greedy(
        hf_model, ENCODER_INPUTS[STOP_AT_EOS], MAX_TOKENS[STOP_AT_EOS], eos
    )
    assert len(refs[STOP_AT_EOS].token_ids) <= 5
    return refs


class Checkpoints:
    """Variant name -> (variant, transformers model, folder) and its references, each built
    once per module on first use."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.tmp_path_factory = tmp_path_factory
        self.built: dict[str, tuple[Variant, Any, str]] = {}
        self.refs: dict[str, list[Reference]] = {}

    def get(self, name: str) -> tuple[Variant, Any, str]:
        if name not in self.built:
            variant, path = VARIANTS[name], self.tmp_path_factory.mktemp(name)
            self.built[name] = (variant, write_checkpoint(path, variant), str(path))
        return self.built[name]

    def references(self, name: str) -> list[Reference]:
        if name not in self.refs:
            self.refs[name] = references(self.get(name)[1])
        return self.refs[name]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tmp_path_factory)


@pytest.fixture(params=list(VARIANTS))
def variant_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def checkpoint(checkpoints: Checkpoints, variant_name: str) -> tuple[Variant, Any, str]:
    return checkpoints.get(variant_name)


@pytest.fixture
def hf_refs(checkpoints: Checkpoints, variant_name: str) -> list[Reference]:
    return checkpoints.references(variant_name)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The offline API detokenizes; the ids it decodes need not mean anything."""
    path = tmp_path_factory.mktemp("tokenizer")
    make_tiny_tokenizer(path)
    return str(path)


def make_core(path: str, **overrides: Any) -> EngineCore:
    kwargs = dict(
        device="cpu",
        num_kv_blocks=18,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=8,
        max_num_encoder_input_tokens=48,
    )
    return EngineCore(make_engine_config(path, **{**kwargs, **overrides}), UniProcExecutor)


def drain(core: EngineCore, max_steps: int = 2000) -> dict[str, list[EngineCoreOutput]]:
    outputs: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(max_steps):
        if not core.has_work():
            return outputs
        for out in core.step().outputs:
            assert out.error is None, out.error
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("the engine did not finish its requests")


def generation_request(i: int, ref: Reference, decoder_start: int) -> EngineCoreRequest:
    ids = ENCODER_INPUTS[i]
    return EngineCoreRequest(
        request_id=f"req-{i}",
        prompt_token_ids=[decoder_start],
        sampling_params=SamplingParams(
            temperature=0,
            max_tokens=MAX_TOKENS[i],
            ignore_eos=ref.eos_token_id is None,
            logprobs=0,
        ),
        encoder_input=EncoderInput(
            num_encoder_tokens=len(ids), content_hash=f"ids:{ids}", token_ids=ids
        ),
        eos_token_id=ref.eos_token_id,
    )


def test_greedy_matches_transformers_under_preemption(
    checkpoint: tuple[Variant, Any, str], hf_refs: list[Reference]
) -> None:
    variant, hf_model, path = checkpoint
    refs = hf_refs
    # Greedy outputs that vary: a position-blind bias would not reproduce them.
    assert max(len(set(r.token_ids)) for r in refs) >= 8
    # One longest request (24 decoder tokens + 40 encoder positions: 6 + 10 blocks) fits.
    core = make_core(path, max_model_len=24, max_encoder_input_len=40)
    decoder_start = hf_model.config.decoder_start_token_id
    for i, ref in enumerate(refs):
        core.add_request(generation_request(i, ref, decoder_start))
    outputs = drain(core)

    for i, ref in enumerate(refs):
        outs = outputs[f"req-{i}"]
        tokens = [t for o in outs for t in o.new_token_ids]
        assert tokens == ref.token_ids, f"request {i}"
        logprobs = [lp[0] for o in outs for lp in (o.new_logprobs or [])]
        np.testing.assert_allclose(logprobs, ref.logprobs, atol=1e-3, rtol=0)
        expected = FinishReason.LENGTH if ref.eos_token_id is None else FinishReason.STOP
        assert outs[-1].finish_reason == expected
    stats = core.get_stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_used_blocks"] == 0 and stats["num_kv_requests"] == 0
    assert stats["num_requests"] == 0


def test_llm_generate_matches_transformers(checkpoints: Checkpoints, tokenizer_dir: str) -> None:
    """Token-id prompts through the offline API are encoder prompts; every request runs in
    one batch here (ample blocks and budget), unlike the crowded EngineCore run."""
    from v1 import LLM

    _, _, path = checkpoints.get("flan-t5-v1.1")
    hf_refs = checkpoints.references("flan-t5-v1.1")
    llm = LLM(
        path,
        tokenizer=tokenizer_dir,
        multiprocess=False,
        device="cpu",
        num_kv_blocks=64,
        block_size=4,
        max_model_len=64,  # one longest request (16 + 16 blocks) fits
        max_encoder_input_len=64,
    )
    try:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
        outputs = llm.generate(
            [{"prompt_token_ids": ids} for ids in ENCODER_INPUTS], params, use_tqdm=False
        )
    finally:
        llm.shutdown()
    for i, (out, ref) in enumerate(zip(outputs, hf_refs, strict=True)):
        tokens = list(out.outputs[0].token_ids)
        if ref.eos_token_id is None:
            assert tokens == ref.token_ids, f"request {i}"
        else:  # transformers stopped at the EOS this request ignores
            assert tokens[: len(ref.token_ids)] == ref.token_ids


def test_load_weights_covers_every_parameter(checkpoint: tuple[Variant, Any, str]) -> None:
    variant, hf_model, path = checkpoint
    ours = construct_model(hf_model.config, "cpu", torch.float32)
    assert type(ours).__name__ == variant.model_cls.__name__
    loaded = ours.load_weights(iterate_weights(path))
    assert loaded == {name for name, _ in ours.named_parameters()}
    assert ours.lm_head.tied != variant.untied_head
    assert (ours.lm_head.weight is ours.shared.weight) != variant.untied_head
    torch.testing.assert_close(ours.lm_head.weight, hf_model.lm_head.weight, atol=0, rtol=0)
    ours_numel = sum(p.numel() for p in ours.parameters())
    assert ours_numel == sum(p.numel() for p in hf_model.parameters())
    # Only v1.0 scales the decoder output by d_model**-0.5 before its (tied) head.
    assert (ours.output_scale is not None) == (not variant.untied_head)


def test_unknown_checkpoint_tensor_is_refused(checkpoint: tuple[Variant, Any, str]) -> None:
    variant, hf_model, path = checkpoint
    ours = construct_model(hf_model.config, "cpu", torch.float32)
    weights = [
        *iterate_weights(path),
        # Old checkpoints carry this unused table: ignored.
        (
            "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",
            torch.zeros(16, 4),
        ),
    ]
    ours.load_weights(weights)
    with pytest.raises(ValueError, match="match no parameter"):
        ours.load_weights(
            [*weights, ("decoder.block.0.layer.1.EncDecAttention.x.weight", torch.zeros(1))]
        )


def test_fp16_clamp_keeps_activations_finite() -> None:
    x = torch.tensor([1.0, float("inf"), -float("inf"), -3.0], dtype=torch.float16)
    out = t5._clamp_fp16(x)
    limit = torch.finfo(torch.float16).max - 1000
    assert torch.isfinite(out).all()
    assert out.tolist() == [
        1.0,
        pytest.approx(limit, rel=1e-3),
        pytest.approx(-limit, rel=1e-3),
        -3.0,
    ]
    y = torch.tensor([1.0, float("inf")], dtype=torch.float32)
    assert t5._clamp_fp16(y) is y  # other dtypes are left alone, as in transformers


# ---- T5EncoderModel (encoder-only: sentence-t5 style embeddings) ----

SENTENCE_T5_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {
        "idx": 2,
        "name": "2",
        "path": "2_Normalize",
        "type": "sentence_transformers.models.Normalize",
    },
]
EMBED_INPUTS = [[5, 17, 3, 60, 42, 7, 7, 20, 64, 2], [11], list(range(2, 40)), [50, 8, 30, 31]]


@pytest.fixture(scope="module")
def encoder_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, str]:
    """A sentence-t5-like folder: T5EncoderModel weights, mean pooling, L2 normalization."""
    path = tmp_path_factory.mktemp("t5-encoder")
    cfg = T5Config(**{**TINY_T5, "feed_forward_proj": "gated-gelu", "initializer_factor": 5.0})
    torch.manual_seed(3)
    hf_model = HFT5EncoderModel(cfg).eval()
    with torch.no_grad():
        hf_model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight *= BIAS_GAIN
    hf_model.save_pretrained(path)
    (path / "modules.json").write_text(json.dumps(SENTENCE_T5_MODULES))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": cfg.d_model, "pooling_mode_mean_tokens": True})
    )
    return hf_model, str(path)


@torch.inference_mode()
def hf_hidden_states(hf_model: Any, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).last_hidden_state[0]  # [len, d_model]


def run_pooling(path: str, task: str) -> list[np.ndarray]:
    core = make_core(path, max_num_seqs=3, max_num_batched_tokens=64)
    for i, ids in enumerate(EMBED_INPUTS):
        core.add_request(
            EngineCoreRequest(
                request_id=f"emb-{i}",
                prompt_token_ids=ids,
                pooling_params=PoolingParams(task=task),
            )
        )
    outputs = drain(core)
    assert core.get_stats()["num_requests"] == 0
    return [np.asarray(outputs[f"emb-{i}"][-1].pooled_output) for i in range(len(EMBED_INPUTS))]


def test_encoder_model_hidden_states_match_transformers(
    encoder_checkpoint: tuple[Any, str],
) -> None:
    hf_model, path = encoder_checkpoint
    hidden = run_pooling(path, "encode")
    for ids, ours in zip(EMBED_INPUTS, hidden, strict=True):
        np.testing.assert_allclose(ours, hf_hidden_states(hf_model, ids).numpy(), atol=1e-4, rtol=0)


def test_encoder_model_mean_pooled_embeddings(encoder_checkpoint: tuple[Any, str]) -> None:
    hf_model, path = encoder_checkpoint
    embeddings = run_pooling(path, "embed")
    for ids, ours in zip(EMBED_INPUTS, embeddings, strict=True):
        expected = torch.nn.functional.normalize(hf_hidden_states(hf_model, ids).mean(0), dim=-1)
        np.testing.assert_allclose(ours, expected.numpy(), atol=1e-5, rtol=0)


def test_encoder_model_loads_from_a_full_t5_checkpoint(
    checkpoint: tuple[Variant, Any, str],
) -> None:
    """The decoder and head of a full checkpoint are skipped; the encoder loads whole."""
    variant, hf_model, path = checkpoint
    ours = construct_model(hf_model.config, "cpu", torch.float32, architecture="T5EncoderModel")
    loaded = ours.load_weights(iterate_weights(path))
    assert loaded == {name for name, _ in ours.named_parameters()}
    table = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    for name in (table, "shared.weight"):
        assert torch.equal(ours.get_parameter(name), hf_model.get_parameter(name))
