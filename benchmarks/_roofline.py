"""FLOPs and minimal bytes of each benchmark workload, for its device floor:
floor = max(FLOPs / measured GEMM rate, bytes / measured copy bandwidth).

Counting rules (b = bytes per element of weights and caches, fp16: 2):
- FLOPs: 2 per multiply-add of every linear layer, 4 * q_len * kv_len * d per attention layer
  (scores and P @ V); the LM head only on positions that sample a token; norms, activations,
  softmax and the sampler are not counted (they are small and not GEMMs).
- Bytes, the least any engine must move with every request of the workload in one batch:
  encoder weights read once; decoder weights (LM head included) read once per decoder forward
  (one forward per generated token); per decoder forward, every request's cross-attention K/V
  (2 * layers * S * d) and self-attention K/V so far read once; cross K/V written once; encoder
  activations read and written once per layer (2 * tokens * d); inputs read once. Decoder
  activations (batch * d per layer) are negligible and left out.
The floor is for fp16 weights and per-layer cross K/V: modes that move fewer bytes (absorbed
cross-attention, fp8) can beat it, which is their point.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Cost:
    flops: float
    bytes: float

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.bytes + other.bytes)


@dataclass(frozen=True)
class EncDecShape:
    """Whisper (mel_bins > 0: conv stem over 2 * enc_len mel frames) or BART."""

    d: int
    enc_layers: int
    dec_layers: int
    ffn: int
    vocab: int
    enc_len: int
    """Encoder positions of one input (Whisper: 1500; BART: the input length)."""
    mel_bins: int = 0


@dataclass(frozen=True)
class DecoderShape:
    """Llama: grouped-query attention, gated MLP (3 matrices)."""

    d: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int


@dataclass(frozen=True)
class EncoderShape:
    """BERT: post-LN encoder, 2-matrix MLP."""

    d: int
    layers: int
    ffn: int


def _triangle(n: int) -> int:
    """1 + 2 + ... + n: keys attended over n consecutive causal positions."""
    return n * (n + 1) // 2


def enc_dec_cost(
    s: EncDecShape, num_inputs: int, prompt_len: int, new_tokens: int, b: int = 2
) -> Cost:
    """Encode every input once, then decode `prompt_len` prompt positions and `new_tokens`
    sampled tokens (new_tokens forwards, the first over the whole prompt)."""
    d, S, Le, Ld, F, V = s.d, s.enc_len, s.enc_layers, s.dec_layers, s.ffn, s.vocab
    enc_lin = 4 * d * d + 2 * d * F  # q, k, v, o + fc1, fc2
    dec_lin = 4 * d * d + 2 * d * d + 2 * d * F  # self q, k, v, o + cross q, o + fc1, fc2
    cross_kv = 2 * d * d  # cross k, v projections, applied once to the encoder output
    conv = (s.mel_bins * 3 * d + 3 * d * d) if s.mel_bins else 0
    frames = 2 * S

    enc_flops = Le * (2 * S * enc_lin + 4 * S * S * d)
    if s.mel_bins:
        enc_flops += 2 * frames * s.mel_bins * 3 * d + 2 * S * 3 * d * d
    positions = prompt_len + new_tokens - 1
    dec_flops = Ld * (positions * (2 * dec_lin + 4 * S * d) + 4 * d * _triangle(positions))
    per_input_flops = enc_flops + Ld * 2 * S * cross_kv + dec_flops + new_tokens * 2 * d * V

    kv_row = Ld * 2 * d * b  # one position of K and V over all decoder layers
    self_kv_read = new_tokens * prompt_len + new_tokens * (new_tokens - 1) // 2
    input_bytes = s.mel_bins * frames * b if s.mel_bins else S * 4
    num_bytes = (
        (Le * enc_lin + conv + Ld * cross_kv) * b  # encoder + cross-K/V weights, once
        + new_tokens * (Ld * dec_lin + V * d) * b  # decoder weights + LM head per forward
        + num_inputs
        * (
            input_bytes
            + Le * 2 * S * d * b  # encoder activations in and out per layer
            + S * kv_row  # cross K/V written once
            + new_tokens * S * kv_row  # cross K/V read per forward
            + (self_kv_read + positions) * kv_row  # self K/V read so far + written
        )
    )
    return Cost(num_inputs * per_input_flops, num_bytes)


def enc_dec_step_cost(s: EncDecShape, batch: int, position: int, b: int = 2) -> Cost:
    """One decode step: `batch` requests each add one token at `position` (0-based), attending
    position + 1 self keys and all S cross keys."""
    d, S, Ld, F, V = s.d, s.enc_len, s.dec_layers, s.ffn, s.vocab
    dec_lin = 6 * d * d + 2 * d * F
    flops = batch * (Ld * (2 * dec_lin + 4 * (position + 1) * d + 4 * S * d) + 2 * d * V)
    kv_row = Ld * 2 * d * b
    num_bytes = (Ld * dec_lin + V * d) * b + batch * (S + position + 1) * kv_row
    return Cost(flops, num_bytes)


def decoder_cost(
    s: DecoderShape, num_inputs: int, prompt_len: int, new_tokens: int, b: int = 2
) -> Cost:
    """Prefill `prompt_len` tokens, then `new_tokens` forwards in all (the prefill samples the
    first token)."""
    d, L, F, V = s.d, s.layers, s.ffn, s.vocab
    kvd = s.kv_heads * (d // s.heads)
    lin = 2 * d * d + 2 * d * kvd + 3 * d * F  # q, o + k, v + gate, up, down
    positions = prompt_len + new_tokens - 1
    per_input_flops = (
        L * (positions * 2 * lin + 4 * d * _triangle(positions)) + new_tokens * 2 * d * V
    )
    kv_row = L * 2 * kvd * b
    kv_read = new_tokens * prompt_len + new_tokens * (new_tokens - 1) // 2
    num_bytes = new_tokens * (L * lin + V * d) * b + num_inputs * (kv_read + positions) * kv_row
    return Cost(num_inputs * per_input_flops, num_bytes)


def encoder_cost(s: EncoderShape, lengths: Sequence[int], b: int = 2) -> Cost:
    """One bidirectional pass over each input; weights once, embedding rows gathered, hidden
    states in and out per layer, one pooled fp32 vector out per input."""
    d, L, F = s.d, s.layers, s.ffn
    lin = 4 * d * d + 2 * d * F
    tokens = sum(lengths)
    flops = L * (2 * tokens * lin + 4 * d * sum(n * n for n in lengths))
    num_bytes = L * lin * b + tokens * d * b + L * 2 * tokens * d * b + len(lengths) * d * 4
    return Cost(flops, num_bytes)
