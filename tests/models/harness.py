"""Run a v1 model the way the engine does: packed tokens, paged KV cache, torch SDPA backend.

`PagedRunner` owns one KV cache per Attention layer and a block table per sequence; each
`step` takes new tokens for some sequences (a whole prompt, a chunk, or one decode token) and
returns their logits, so prefill, decode and mixed steps all go through the same path.
"""

from __future__ import annotations

import random

import torch
from torch import nn

from v1.attention.backend import AttentionType, CommonAttentionMetadata
from v1.attention.backends.torch_sdpa import SDPAMetadataBuilder, TorchSDPABackend
from v1.attention.layer import Attention
from v1.forward_context import ForwardContext, set_forward_context


def attention_layers(model: nn.Module) -> dict[str, Attention]:
    return {m.layer_name: m for m in model.modules() if isinstance(m, Attention)}


def small_whisper_config(encoder_layers: int):
    """A small Whisper (d_model 384, 6 heads, one decoder layer) with full-size 30 s windows
    and vocabulary: the shapes the GPU encoder tests run."""
    from transformers import WhisperConfig

    return WhisperConfig(
        d_model=384,
        encoder_layers=encoder_layers,
        decoder_layers=1,
        encoder_attention_heads=6,
        decoder_attention_heads=6,
        encoder_ffn_dim=1536,
        decoder_ffn_dim=1536,
        num_mel_bins=80,
        vocab_size=51865,
        architectures=["WhisperForConditionalGeneration"],
    )


def uniform_encoder_context(model: nn.Module, num_windows: int, length: int) -> ForwardContext:
    """The forward context of `model`'s encoder self-attention over `num_windows` windows of
    `length` positions each, on CUDA, with the Triton backend's metadata (equal lengths: one
    dense batch through cuDNN attention)."""
    from v1.attention.backends.triton import TritonMetadataBuilder

    starts = torch.arange(0, (num_windows + 1) * length, length, dtype=torch.int32)
    lengths = torch.full((num_windows,), length, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=starts.cuda(),
        query_start_loc_cpu=starts,
        seq_lens=lengths.cuda(),
        seq_lens_cpu=lengths,
        num_reqs=num_windows,
        num_actual_tokens=num_windows * length,
        max_query_len=length,
        max_seq_len=length,
        causal=False,
    )
    builder = TritonMetadataBuilder(AttentionType.ENCODER, torch.device("cuda"), 16)
    metadata = builder.build(common)
    names = [n for n, m in attention_layers(model).items() if m.attn_type == AttentionType.ENCODER]
    return ForwardContext(dict.fromkeys(names, metadata))


class PagedRunner:
    def __init__(
        self, model: nn.Module, block_size: int = 4, num_blocks: int = 128, seed: int = 0
    ) -> None:
        self.model = model
        self.block_size = block_size
        param = next(model.parameters())
        self.device, dtype = param.device, param.dtype
        self.layers = attention_layers(model)
        assert self.layers, "model has no Attention layers"
        for layer in self.layers.values():
            shape = TorchSDPABackend.kv_cache_shape(
                num_blocks, block_size, layer.num_kv_heads, layer.head_size
            )
            layer.kv_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        # Shuffled free blocks (block 0 is the null block), so block tables are not contiguous.
        self.free_blocks = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.builder = SDPAMetadataBuilder(AttentionType.DECODER, self.device, block_size)
        self.num_computed: list[int] = []
        self.block_tables: list[list[int]] = []

    def add_sequences(self, num_seqs: int) -> list[int]:
        first = len(self.num_computed)
        self.num_computed += [0] * num_seqs
        self.block_tables += [[] for _ in range(num_seqs)]
        return list(range(first, first + num_seqs))

    def _slot(self, seq: int, pos: int) -> int:
        table = self.block_tables[seq]
        while len(table) <= pos // self.block_size:
            table.append(self.free_blocks.pop())
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """chunks: sequence index -> its new tokens this step. Returns sequence index ->
        logits [len(chunk), vocab] of those tokens."""
        seqs = list(chunks)
        token_ids, positions, slots, seq_lens, starts = [], [], [], [], [0]
        for seq in seqs:
            start = self.num_computed[seq]
            for j, token in enumerate(chunks[seq]):
                token_ids.append(token)
                positions.append(start + j)
                slots.append(self._slot(seq, start + j))
            seq_lens.append(start + len(chunks[seq]))
            starts.append(starts[-1] + len(chunks[seq]))
        max_blocks = max(len(self.block_tables[s]) for s in seqs)
        block_table = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
        for row, seq in enumerate(seqs):
            table = self.block_tables[seq]
            block_table[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
        query_start_loc = torch.tensor(starts, dtype=torch.int32)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        positions_t = torch.tensor(positions, dtype=torch.int64)
        common = CommonAttentionMetadata(
            query_start_loc=query_start_loc.to(self.device),
            query_start_loc_cpu=query_start_loc,
            seq_lens=seq_lens_t.to(self.device),
            seq_lens_cpu=seq_lens_t,
            num_reqs=len(seqs),
            num_actual_tokens=len(token_ids),
            max_query_len=max(len(c) for c in chunks.values()),
            max_seq_len=max(seq_lens),
            causal=True,
            block_table=block_table.to(self.device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            query_positions=positions_t.to(self.device),
        )
        metadata = self.builder.build(common)  # one KV group: every layer shares it
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        with (
            torch.inference_mode(),
            set_forward_context(ForwardContext({name: metadata for name in self.layers})),
        ):
            hidden_states = self.model(input_ids, positions_t.to(self.device))  # [T, hidden]
            logits = self.model.compute_logits(hidden_states)  # [T, vocab]
        for seq in seqs:
            self.num_computed[seq] += len(chunks[seq])
        return dict(zip(seqs, logits.split([len(chunks[s]) for s in seqs]), strict=True))

    def prefill(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """New sequences, whole prompts in one step: logits [len(prompt), vocab] each."""
        seqs = self.add_sequences(len(prompts))
        out = self.step(dict(zip(seqs, prompts, strict=True)))
        return [out[s] for s in seqs]

    def decode(self, tokens: list[int], seqs: list[int] | None = None) -> list[torch.Tensor]:
        """One token for each of `seqs` (default: all): their logits [vocab]."""
        seqs = list(range(len(self.num_computed))) if seqs is None else seqs
        out = self.step({s: [t] for s, t in zip(seqs, tokens, strict=True)})
        return [out[s][0] for s in seqs]
