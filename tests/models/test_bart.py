"""BART, mBART and Marian against transformers: the model alone on the paged SDPA path (logits),
then greedy decoding through EngineCore with more prompts than max_num_seqs, a KV cache small
enough to preempt, aborts mid-decode (every self and cross block must come back), and the
generation-config rules (forced BOS/EOS, min_tokens, no_repeat_ngram_size, suppress_tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from torch import nn

from tests.utils import TINY_BART, make_tiny_tokenizer
from v1 import LLM
from v1.attention.backend import AttentionType, CommonAttentionMetadata
from v1.attention.backends.torch_sdpa import SDPAMetadataBuilder, TorchSDPABackend
from v1.config import ModelConfig, make_engine_config
from v1.core.engine_core import EngineCore
from v1.core.protocol import EncoderInput, EngineCoreRequest, FinishReason
from v1.executor.uniproc import UniProcExecutor
from v1.forward_context import ForwardContext, set_forward_context
from v1.models.bart import (
    BartForConditionalGeneration,
    MarianMTModel,
    MBartForConditionalGeneration,
    sinusoidal_table,
)
from v1.sampling_params import SamplingParams
from v1.worker.model_loader import construct_model, iterate_weights, load_model

from .harness import attention_layers

VOCAB = 128
BOS, PAD, EOS = 0, 1, 2
DECODER_START = EOS  # BART's convention
BLOCK = 4
ATOL = 1e-4

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "bart": ("bart", {"tie_word_embeddings": False}),
    "bart-tied": ("bart", {}),
    "mbart": ("mbart", {"tie_word_embeddings": False}),
    "mbart-tied-scaled": ("mbart", {"scale_embedding": True}),
    "marian": ("marian", {"tie_word_embeddings": False}),
    "marian-tied-swish": ("marian", {"activation_function": "swish"}),  # opus-mt's activation
    "marian-own-decoder-vocab": (
        "marian",
        {"share_encoder_decoder_embeddings": False, "decoder_vocab_size": 96},
    ),
}
CLASSES = {
    "bart": BartForConditionalGeneration,
    "mbart": MBartForConditionalGeneration,
    "marian": MarianMTModel,
}
# Untied heads: greedy sequences vary (a tied head keeps predicting the token it was fed).
ENGINE_VARIANTS = ["bart", "mbart", "marian"]


def tiny_config(model_type: str, **overrides: Any) -> Any:
    base = dict(
        TINY_BART,
        vocab_size=VOCAB,
        bos_token_id=BOS,
        pad_token_id=PAD,
        eos_token_id=EOS,
        decoder_start_token_id=DECODER_START,
        forced_eos_token_id=EOS,
        scale_embedding=model_type == "marian",
    )
    base.update(overrides)
    return transformers.AutoConfig.for_model(model_type, **base)


def randomize_(model: nn.Module, seed: int) -> None:
    """Every parameter random (norms and biases too, so a mis-mapped one cannot hide): linear
    weights at gain 0.5 / sqrt(fan_in) so no sub-block drowns the residual stream."""
    gen = torch.Generator().manual_seed(seed)
    emb_std = 0.2 if model.config.model_type == "marian" else 1.0  # Marian scales by sqrt(d)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "embed_positions" in name and model.config.model_type == "marian":
                continue  # the fixed sinusoidal table
            noise = torch.randn(param.shape, generator=gen)
            if param.dim() == 2 and not any(k in name for k in ("embed", "shared", "lm_head")):
                param.copy_(noise * 0.5 / param.shape[1] ** 0.5)
            elif param.dim() == 2:
                param.copy_(noise * emb_std)
            elif name.endswith("weight"):
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(0.05 * noise)
        bias = model.final_logits_bias
        bias.copy_(0.1 * torch.randn(bias.shape, generator=gen))


def make_checkpoint(
    path: Path,
    variant: str,
    seed: int = 0,
    generation: dict[str, Any] | None = None,
    **config_overrides: Any,
) -> tuple[nn.Module, str]:
    """A random `variant` saved in `path` with a generation config of the given rules."""
    model_type, overrides = VARIANTS[variant]
    cfg = tiny_config(model_type, **{**overrides, **config_overrides})
    hf_model = transformers.AutoModelForSeq2SeqLM.from_config(cfg)
    randomize_(hf_model, seed)
    hf_model.generation_config = transformers.GenerationConfig(
        bos_token_id=cfg.bos_token_id,
        pad_token_id=cfg.pad_token_id,
        eos_token_id=cfg.eos_token_id,
        decoder_start_token_id=cfg.decoder_start_token_id,
        forced_eos_token_id=cfg.eos_token_id,
        **(generation or {}),
    )
    hf_model.save_pretrained(path)
    return hf_model.eval(), str(path)


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    return request.param, *make_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def engine_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return {v: make_checkpoint(tmp_path_factory.mktemp(v), v) for v in ENGINE_VARIANTS}


def encoder_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """n prompts of 3, 7, 11, ... tokens (ids 4.., clear of the special ids)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(4, VOCAB, size=3 + 4 * i).tolist() for i in range(n)]


# ---------------------------------------------------------------------------------------------
# The model alone: packed encoder, first decoder step writing cross blocks, decode steps reading
# ---------------------------------------------------------------------------------------------


def _metadata(
    attn_type: AttentionType,
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]] | None = None,
    slot_mapping: list[int] | None = None,
    query_positions: list[int] | None = None,
) -> Any:
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    table = None
    if block_tables is not None:
        width = max(len(t) for t in block_tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=lens,
        seq_lens_cpu=lens,
        num_reqs=len(query_lens),
        num_actual_tokens=int(sum(query_lens)),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        causal=attn_type == AttentionType.DECODER,
        block_table=table,
        slot_mapping=None if slot_mapping is None else torch.tensor(slot_mapping),
        query_positions=None if query_positions is None else torch.tensor(query_positions),
    )
    return SDPAMetadataBuilder(attn_type, torch.device("cpu"), BLOCK).build(common)


class EncDecRunner:
    """Drives an encoder-decoder model as the runner does, with hand-made block tables."""

    def __init__(self, model: nn.Module, num_blocks: int = 64) -> None:
        self.model = model
        self.layers = attention_layers(model)
        for layer in self.layers.values():
            if layer.attn_type.has_kv_cache:
                shape = TorchSDPABackend.kv_cache_shape(
                    num_blocks, BLOCK, layer.num_kv_heads, layer.head_size
                )
                layer.kv_cache = torch.zeros(shape)
        self.free_blocks = list(range(num_blocks - 1, 0, -1))
        self.self_blocks: list[list[int]] = []
        self.cross_blocks: list[list[int]] = []
        self.num_tokens: list[int] = []
        self.enc_lens: list[int] = []

    def _slots(self, blocks: list[int], start: int, num: int) -> list[int]:
        while len(blocks) * BLOCK < start + num:
            blocks.append(self.free_blocks.pop())
        return [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + num)]

    def _names(self, attn_type: AttentionType) -> list[str]:
        return [n for n, layer in self.layers.items() if layer.attn_type == attn_type]

    def _decoder_step(self, chunks: list[list[int]], encoder_states: Any) -> list[torch.Tensor]:
        starts = list(self.num_tokens)
        lens = [len(c) for c in chunks]
        positions = [p for s, n in zip(starts, lens, strict=True) for p in range(s, s + n)]
        self_slots = [
            slot
            for i, (s, n) in enumerate(zip(starts, lens, strict=True))
            for slot in self._slots(self.self_blocks[i], s, n)
        ]
        self.num_tokens = [s + n for s, n in zip(starts, lens, strict=True)]
        cross_slots = None
        if encoder_states is not None:
            cross_slots = [
                slot
                for i, n in enumerate(self.enc_lens)
                for slot in self._slots(self.cross_blocks[i], 0, n)
            ]
        decoder_md = _metadata(
            AttentionType.DECODER, lens, self.num_tokens, self.self_blocks, self_slots, positions
        )
        cross_md = _metadata(
            AttentionType.ENCODER_DECODER,
            lens,
            self.enc_lens,
            self.cross_blocks,
            cross_slots,
            positions,
        )
        metadata = dict.fromkeys(self._names(AttentionType.DECODER), decoder_md)
        metadata |= dict.fromkeys(self._names(AttentionType.ENCODER_DECODER), cross_md)
        ids = torch.tensor([t for c in chunks for t in c])
        with torch.inference_mode(), set_forward_context(ForwardContext(metadata)):
            hidden = self.model(ids, torch.tensor(positions), encoder_hidden_states=encoder_states)
            logits = self.model.compute_logits(hidden)  # [T, vocab]
        return list(logits.split(lens))

    def start(self, enc_prompts: list[list[int]], dec_prompts: list[list[int]]) -> list[Any]:
        """Encode all prompts in one packed pass, then the first decoder step (writes cross)."""
        self.enc_lens = [len(p) for p in enc_prompts]
        self.self_blocks = [[] for _ in enc_prompts]
        self.cross_blocks = [[] for _ in enc_prompts]
        self.num_tokens = [0] * len(enc_prompts)
        enc_md = _metadata(AttentionType.ENCODER, self.enc_lens, self.enc_lens)
        ids = torch.tensor([t for p in enc_prompts for t in p])
        positions = torch.tensor([i for p in enc_prompts for i in range(len(p))])
        context = ForwardContext(dict.fromkeys(self._names(AttentionType.ENCODER), enc_md))
        with torch.inference_mode(), set_forward_context(context):
            encoder_states = self.model.encode(ids, positions)  # [sum(len), d_model]
        return self._decoder_step(dec_prompts, encoder_states)

    def decode(self, tokens: list[int]) -> list[torch.Tensor]:
        """One token per sequence; cross-attention only reads its blocks."""
        return [out[0] for out in self._decoder_step([[t] for t in tokens], None)]


@torch.inference_mode()
def hf_decoder_logits(
    hf_model: nn.Module, enc_prompts: list[list[int]], dec_prompts: list[list[int]]
) -> list[torch.Tensor]:
    """transformers' logits [len(dec), vocab] of each pair, in one right-padded batch (the
    decoder is causal, so its right padding changes no real row)."""

    def pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [PAD] * (width - len(r)) for r in rows])
        return ids, torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])

    input_ids, mask = pad(enc_prompts)
    decoder_ids, _ = pad(dec_prompts)
    logits = hf_model(
        input_ids=input_ids, attention_mask=mask, decoder_input_ids=decoder_ids
    ).logits.float()
    return [row[: len(dec)] for row, dec in zip(logits, dec_prompts, strict=True)]


def test_paged_logits_match_transformers(checkpoint: tuple[str, nn.Module, str]) -> None:
    """A packed first step (encoder, decoder prompts, cross K/V written), then decode steps
    that only read the cross blocks; every step's logits against transformers'."""
    variant, hf_model, path = checkpoint
    ours = load_model(ModelConfig(model=path), "cpu", torch.float32)
    assert type(ours) is CLASSES[VARIANTS[variant][0]]
    enc_prompts = encoder_prompts(3, seed=1)
    seqs = [[DECODER_START], [DECODER_START, 7, 9], [DECODER_START, 5]]
    prompt_lens = [len(s) for s in seqs]
    runner = EncDecRunner(ours)
    ours_logits = runner.start(enc_prompts, seqs)
    for logits, seq in zip(ours_logits, seqs, strict=True):
        seq.append(int(logits[-1].argmax()))
    for _ in range(3):
        step = runner.decode([seq[-1] for seq in seqs])
        for i, (logits, seq) in enumerate(zip(step, seqs, strict=True)):
            ours_logits[i] = torch.cat([ours_logits[i], logits[None]])
            seq.append(int(logits.argmax()))
    expected = hf_decoder_logits(hf_model, enc_prompts, [s[:-1] for s in seqs])
    for ours_row, hf_row, n in zip(ours_logits, expected, prompt_lens, strict=True):
        assert ours_row.shape == (n + 3, hf_model.lm_head.out_features)  # Marian: decoder vocab
        torch.testing.assert_close(ours_row, hf_row, atol=ATOL, rtol=0)


def test_load_weights_covers_every_parameter(checkpoint: tuple[str, nn.Module, str]) -> None:
    variant, hf_model, path = checkpoint
    ours = construct_model(hf_model.config, "cpu", torch.float32)
    loaded = ours.load_weights(iterate_weights(path))
    assert loaded == {name for name, _ in ours.named_parameters()}
    # As many weights as transformers (whose named_parameters lists tied ones once), less its
    # Marian sinusoidal table (a buffer here) and the `shared` copy untied models never use.
    is_marian = VARIANTS[variant][0] == "marian"
    hf_numel = hf_model.final_logits_bias.numel() + sum(
        p.numel()
        for name, p in hf_model.named_parameters()
        if not (is_marian and "embed_positions" in name)
        and not (name == "model.shared.weight" and not hf_model.config.tie_word_embeddings)
    )
    assert sum(p.numel() for p in ours.parameters()) == hf_numel


def test_tied_embeddings_are_one_parameter(checkpoint: tuple[str, nn.Module, str]) -> None:
    variant, hf_model, path = checkpoint
    ours = load_model(ModelConfig(model=path), "cpu", torch.float32)
    cfg = hf_model.config
    shared = getattr(cfg, "share_encoder_decoder_embeddings", True)
    encoder_embed = ours.model.encoder.embed_tokens.weight
    decoder_embed = ours.model.decoder.embed_tokens.weight
    assert (ours.lm_head.weight is decoder_embed) == cfg.tie_word_embeddings
    assert (encoder_embed is decoder_embed) == (cfg.tie_word_embeddings and shared)
    torch.testing.assert_close(ours.lm_head.weight, hf_model.lm_head.weight, atol=0, rtol=0)


def test_marian_positions_are_transformers_table() -> None:
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    for dim in (32, 33):
        reference = MarianSinusoidalPositionalEmbedding(50, dim).create_weight()
        assert torch.equal(sinusoidal_table(50, dim), reference)


def test_untied_checkpoint_with_only_shared_embeddings_loads(tmp_path: Path) -> None:
    """Older untied checkpoints may store the stacks' embeddings only as `model.shared`."""
    hf_model, path = make_checkpoint(tmp_path, "bart")
    weights = [
        (name, t)
        for name, t in iterate_weights(path)
        if name not in ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")
    ]
    ours = construct_model(hf_model.config, "cpu", torch.float32)
    loaded = ours.load_weights(weights)
    assert "model.encoder.embed_tokens.weight" in loaded
    torch.testing.assert_close(
        ours.model.decoder.embed_tokens.weight, hf_model.model.shared.weight, atol=0, rtol=0
    )


def test_unknown_checkpoint_tensor_is_refused(checkpoint: tuple[str, nn.Module, str]) -> None:
    _, hf_model, path = checkpoint
    ours = construct_model(hf_model.config, "cpu", torch.float32)
    weights = [*iterate_weights(path), ("model.decoder.layers.0.encoder_attn.bogus", torch.ones(1))]
    with pytest.raises(ValueError, match="bogus"):
        ours.load_weights(weights)


# ---------------------------------------------------------------------------------------------
# Through EngineCore: greedy tokens, preemption, aborts, block accounting
# ---------------------------------------------------------------------------------------------


def make_core(path: str, **overrides: Any) -> EngineCore:
    args = dict(
        device="cpu",
        max_num_seqs=3,
        block_size=BLOCK,
        num_kv_blocks=14,
        max_model_len=20,  # one longest request (5 + 8 blocks) fits the crowded cache
        max_encoder_input_len=32,
        enable_prefix_caching=False,
    )
    args.update(overrides)
    return EngineCore(make_engine_config(path, **args), UniProcExecutor)


def core_request(req_id: str, enc_ids: list[int], **params: Any) -> EngineCoreRequest:
    params = {"temperature": 0.0, "max_tokens": 12, "forced_eos_token_id": EOS, **params}
    return EngineCoreRequest(
        request_id=req_id,
        prompt_token_ids=[DECODER_START],
        sampling_params=SamplingParams(**params),
        encoder_input=EncoderInput(
            num_encoder_tokens=len(enc_ids), content_hash=f"{req_id}:{enc_ids}", token_ids=enc_ids
        ),
        eos_token_id=EOS,
    )


def drain(core: EngineCore, outputs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Steps until idle; request id -> {"tokens", "logprobs", "finish_reason", "error"}."""
    outputs = {} if outputs is None else outputs
    for _ in range(10_000):
        if not core.has_work():
            return outputs
        for out in core.step().outputs:
            entry = outputs.setdefault(
                out.request_id, {"tokens": [], "logprobs": [], "finish_reason": None}
            )
            entry["tokens"] += out.new_token_ids
            entry["logprobs"] += [row[0] for row in out.new_logprobs or []]
            entry["finish_reason"] = out.finish_reason
            entry["error"] = out.error
    raise AssertionError("the engine did not drain")


def assert_all_blocks_free(core: EngineCore) -> None:
    stats = core.get_stats()
    assert stats["num_requests"] == 0
    assert stats["num_kv_requests"] == 0
    assert stats["num_used_blocks"] == 0


@torch.inference_mode()
def hf_generate(
    hf_model: nn.Module, prompts: list[list[int]], **kwargs: Any
) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens after the decoder start (up to EOS) and their raw logprobs,
    for a right-padded batch of encoder prompts."""
    width = max(len(p) for p in prompts)
    pad = hf_model.config.pad_token_id
    input_ids = torch.tensor([p + [pad] * (width - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    out = hf_model.generate(
        input_ids,
        attention_mask=mask,
        do_sample=False,
        num_beams=1,
        max_new_tokens=kwargs.pop("max_new_tokens", 12),
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    logprobs = torch.stack(out.logits, dim=1).float().log_softmax(-1)  # [B, steps, vocab]
    results = []
    for row, row_logprobs in zip(out.sequences[:, 1:].tolist(), logprobs, strict=True):
        tokens = row[: row.index(EOS) + 1] if EOS in row else row
        results.append((tokens, [row_logprobs[i, t].item() for i, t in enumerate(tokens)]))
    return results


ENGINE_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "bart": ("bart", {}),
    "mbart-prefix-caching": ("mbart", {"enable_prefix_caching": True}),
    # Room for about one encoder output: evictions, and encoder re-runs after preemption.
    "marian-small-encoder-cache": (
        "marian",
        {"encoder_cache_size": 32, "max_num_encoder_input_tokens": 32},
    ),
}


@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_greedy_matches_transformers_under_preemption(
    case: str, engine_checkpoints: dict[str, Any]
) -> None:
    variant, engine_overrides = ENGINE_CASES[case]
    hf_model, path = engine_checkpoints[variant]
    prompts = encoder_prompts(7, seed=2)  # 3..27 tokens; 7 requests over max_num_seqs=3
    core = make_core(path, **engine_overrides)
    for i, ids in enumerate(prompts):
        core.add_request(core_request(f"r{i}", ids, logprobs=0))
    outputs = drain(core)
    all_tokens = []
    for i, (tokens, logprobs) in enumerate(hf_generate(hf_model, prompts)):
        got = outputs[f"r{i}"]
        assert got["tokens"] == tokens, f"request {i}"
        np.testing.assert_allclose(got["logprobs"], logprobs, atol=1e-4)
        assert got["finish_reason"] in (FinishReason.STOP, FinishReason.LENGTH)
        all_tokens += tokens
    assert len(set(all_tokens)) > 10, "degenerate reference: the test would prove little"
    stats = core.get_stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_encoder_runs"] >= len(prompts)
    assert_all_blocks_free(core)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_aborts_mid_decode_free_self_and_cross_blocks(
    prefix_caching: bool, engine_checkpoints: dict[str, Any]
) -> None:
    hf_model, path = engine_checkpoints["bart"]
    prompts = encoder_prompts(6, seed=3)
    core = make_core(path, num_kv_blocks=24, enable_prefix_caching=prefix_caching)
    for i, ids in enumerate(prompts):
        core.add_request(core_request(f"r{i}", ids, max_tokens=16))
    outputs: dict[str, Any] = {}
    for _ in range(4):
        for out in core.step().outputs:
            outputs.setdefault(out.request_id, {"tokens": []})["tokens"] += out.new_token_ids
    running = [r.request_id for r in core.scheduler.running]
    waiting = [r.request_id for r in core.scheduler.waiting]
    assert running and waiting
    aborted = {running[0], running[-1], waiting[-1]}
    assert any(outputs.get(r, {}).get("tokens") for r in aborted), "abort mid-decode"
    core.abort_requests(sorted(aborted))
    assert core.get_stats()["num_kv_requests"] == len(running) - 2
    outputs = drain(core, {r: {"tokens": o["tokens"], "logprobs": []} for r, o in outputs.items()})
    for i, (tokens, _) in enumerate(hf_generate(hf_model, prompts, max_new_tokens=16)):
        if f"r{i}" not in aborted:
            assert outputs[f"r{i}"]["tokens"] == tokens, f"request {i}"
    assert_all_blocks_free(core)


def test_same_encoder_input_runs_the_encoder_once(engine_checkpoints: dict[str, Any]) -> None:
    hf_model, path = engine_checkpoints["marian"]
    ids = encoder_prompts(3, seed=4)[2]
    core = make_core(path, max_num_seqs=4, num_kv_blocks=40)
    for i in range(3):
        request = core_request(f"r{i}", ids, max_tokens=6)
        request.encoder_input.content_hash = "same"
        core.add_request(request)
    outputs = drain(core)
    expected = hf_generate(hf_model, [ids], max_new_tokens=6)[0][0]
    assert all(outputs[f"r{i}"]["tokens"] == expected for i in range(3))
    assert core.get_stats()["num_encoder_runs"] == 1
    assert_all_blocks_free(core)


def test_long_decoder_prompt_is_chunked(engine_checkpoints: dict[str, Any]) -> None:
    """Cross K/V are written by the first chunk only; later chunks and decode steps read them."""
    hf_model, path = engine_checkpoints["mbart"]
    enc_prompts = encoder_prompts(2, seed=9)
    dec_prompts = [[DECODER_START, *range(10, 19)], [DECODER_START, 50]]
    core = make_core(path, max_num_batched_tokens=4, num_kv_blocks=40)
    for i, (enc, dec) in enumerate(zip(enc_prompts, dec_prompts, strict=True)):
        request = core_request(f"r{i}", enc, max_tokens=6)
        request.prompt_token_ids = dec
        core.add_request(request)
    outputs = drain(core)
    for i, (enc, dec) in enumerate(zip(enc_prompts, dec_prompts, strict=True)):
        with torch.inference_mode():
            out = hf_model.generate(
                torch.tensor([enc]),
                decoder_input_ids=torch.tensor([dec]),
                do_sample=False,
                num_beams=1,
                max_new_tokens=6,
            )[0, len(dec) :].tolist()
        assert outputs[f"r{i}"]["tokens"] == (out[: out.index(EOS) + 1] if EOS in out else out)
    assert_all_blocks_free(core)


@pytest.mark.parametrize("variant", ["bart-tied", "mbart-tied-scaled", "marian-tied-swish"])
def test_generation_rules_match_transformers(variant: str, tmp_path: Path) -> None:
    """Tied heads repeat the fed token; no_repeat_ngram_size breaks that, min_tokens and
    suppress_tokens shape the rest, forced BOS (mBART's language code) pins the first."""
    hf_model, path = make_checkpoint(tmp_path, variant, seed=5)
    forced_bos = 17 if variant.startswith("mbart") else None
    hf_rules = dict(
        no_repeat_ngram_size=2,
        min_new_tokens=6,
        suppress_tokens=[40, 41, 42],
        forced_bos_token_id=forced_bos,
    )
    our_rules = dict(
        no_repeat_ngram_size=2,
        min_tokens=6,
        suppress_tokens=[40, 41, 42],
        forced_token_ids=[[0, forced_bos]] if forced_bos is not None else None,
    )
    prompts = encoder_prompts(4, seed=6)
    core = make_core(path, num_kv_blocks=40)
    for i, ids in enumerate(prompts):
        core.add_request(core_request(f"r{i}", ids, max_tokens=12, **our_rules))
    outputs = drain(core)
    for i, (tokens, _) in enumerate(hf_generate(hf_model, prompts, max_new_tokens=12, **hf_rules)):
        assert outputs[f"r{i}"]["tokens"] == tokens, f"request {i}"
        assert len(tokens) >= 6 and not {40, 41, 42} & set(tokens)
        if forced_bos is not None:
            assert tokens[0] == forced_bos
    assert_all_blocks_free(core)


# ---------------------------------------------------------------------------------------------
# Through LLM: prompt forms and the model's generation-config defaults
# ---------------------------------------------------------------------------------------------

LLM_ARGS = dict(
    multiprocess=False,
    device="cpu",
    block_size=BLOCK,
    num_kv_blocks=33,  # one longest request (16 + 16 blocks) fits
    max_num_seqs=3,
)
LANG_CODE = 300
"""An mBART-style target-language token, forced first by the generation config."""
LLM_RULES = dict(no_repeat_ngram_size=3, min_length=5, suppress_tokens=[20, 21, 22])


def make_llm_checkpoint(
    path: Path, variant: str, **config_overrides: Any
) -> tuple[nn.Module, Any, str]:
    """A model folder with the tiny tokenizer (<pad>=0 <s>=1 </s>=2, '<s> text </s>') and a
    generation config with every rule the frontend has to turn into sampling defaults."""
    tokenizer = make_tiny_tokenizer(path, add_bos=True, add_eos=True)
    rules = dict(LLM_RULES)
    if variant.startswith("mbart"):
        rules["forced_bos_token_id"] = LANG_CODE
    special = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2)
    overrides = {"vocab_size": len(tokenizer), **special, **config_overrides}
    hf_model, _ = make_checkpoint(path, variant, seed=7, generation=rules, **overrides)
    return hf_model, tokenizer, str(path)


@pytest.mark.parametrize("variant", ["bart", "mbart"])
def test_llm_generate_applies_generation_config(variant: str, tmp_path: Path) -> None:
    hf_model, tokenizer, path = make_llm_checkpoint(tmp_path, variant)
    rng = np.random.default_rng(8)
    token_prompts = [rng.integers(4, 380, size=n).tolist() + [EOS] for n in (3, 9, 16, 24)]
    text = "The quick brown fox jumps over the lazy dog."
    decoder_text = "hello world"
    prompts = [
        *({"prompt_token_ids": ids} for ids in token_prompts),
        text,
        {"encoder_prompt": text, "decoder_prompt": decoder_text},
    ]
    params = SamplingParams(temperature=0.0, max_tokens=10)
    with LLM(path, **LLM_ARGS) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.llm_engine.get_stats()
    text_ids = tokenizer(text)["input_ids"]
    expected = hf_generate(hf_model, [*token_prompts, text_ids], max_new_tokens=10)
    decoder_ids = [2, *tokenizer(decoder_text, add_special_tokens=False)["input_ids"]]
    with torch.inference_mode():
        pair = hf_model.generate(
            torch.tensor([text_ids]),
            decoder_input_ids=torch.tensor([decoder_ids]),
            do_sample=False,
            num_beams=1,
            max_new_tokens=10,
        )[0, len(decoder_ids) :].tolist()
    expected.append((pair[: pair.index(EOS) + 1] if EOS in pair else pair, []))
    for i, (output, (tokens, _)) in enumerate(zip(outputs, expected, strict=True)):
        assert output.outputs[0].token_ids == tokens, f"prompt {i}"
    assert outputs[0].encoder_prompt_token_ids == token_prompts[0]
    assert outputs[-1].prompt_token_ids == decoder_ids
    # The rules were in force (so the comparison covered them): min_length, suppression, BOS.
    for output in outputs[:-1]:
        tokens = output.outputs[0].token_ids
        assert len(tokens) >= 4 and not set(tokens) & {20, 21, 22}
        assert (tokens[0] == LANG_CODE) == variant.startswith("mbart")
    assert outputs[-1].outputs[0].token_ids[0] != LANG_CODE  # not forced after a decoder prompt
    assert stats["num_kv_requests"] == 0 and stats["num_used_blocks"] == 0


def test_llm_encoder_prompt_over_the_limit(tmp_path: Path) -> None:
    hf_model, _, path = make_llm_checkpoint(tmp_path, "bart")
    limit = hf_model.config.max_position_embeddings
    too_long = [(7 * i) % 370 + 5 for i in range(limit + 6)] + [EOS]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    with LLM(path, **LLM_ARGS) as llm:
        with pytest.raises(ValueError, match=f"limit of {limit}"):
            llm.generate({"prompt_token_ids": too_long}, params, use_tqdm=False)
        # Truncation keeps the first tokens and the final special token.
        truncated = llm.generate(
            {"prompt_token_ids": too_long},
            params.clone(truncate_prompt_tokens=20),
            use_tqdm=False,
        )[0]
        # The engine is still serving.
        short = llm.generate({"prompt_token_ids": too_long[:10]}, params, use_tqdm=False)[0]
    kept = too_long[:19] + [EOS]
    assert truncated.encoder_prompt_token_ids == kept
    expected = hf_generate(hf_model, [kept, too_long[:10]], max_new_tokens=6)
    assert truncated.outputs[0].token_ids == expected[0][0]
    assert short.outputs[0].token_ids == expected[1][0]


def test_llm_marian_encoder_ids_use_the_source_vocabulary(tmp_path: Path) -> None:
    """Marian with its own, smaller decoder vocabulary: encoder ids past the decoder's
    vocabulary are valid source tokens, decoder prompt ids are checked against the decoder's."""
    hf_model, _, path = make_llm_checkpoint(
        tmp_path, "marian-own-decoder-vocab", tie_word_embeddings=False
    )
    source_vocab, target_vocab = hf_model.config.vocab_size, hf_model.config.decoder_vocab_size
    assert target_vocab < source_vocab
    rng = np.random.default_rng(10)
    prompts = [
        [*rng.integers(target_vocab, source_vocab, size=n).tolist(), 7, EOS] for n in (4, 11)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    with LLM(path, **LLM_ARGS) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        with pytest.raises(ValueError, match=f"encoder vocabulary \\[0, {source_vocab}\\)"):
            llm.generate({"prompt_token_ids": [5, source_vocab]}, params, use_tqdm=False)
        bad_decoder = {
            "encoder_prompt": {"prompt_token_ids": prompts[0]},
            "decoder_prompt": {"prompt_token_ids": [target_vocab]},
        }
        with pytest.raises(ValueError, match=f"decoder vocabulary \\[0, {target_vocab}\\)"):
            llm.generate(bad_decoder, params, use_tqdm=False)
        stats = llm.llm_engine.get_stats()
    expected = hf_generate(hf_model, prompts, max_new_tokens=8)
    for i, (output, (tokens, _)) in enumerate(zip(outputs, expected, strict=True)):
        assert output.encoder_prompt_token_ids == prompts[i]
        assert output.outputs[0].token_ids == tokens, f"prompt {i}"
    assert stats["num_kv_requests"] == 0 and stats["num_used_blocks"] == 0
