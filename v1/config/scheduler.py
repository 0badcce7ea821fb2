"""The token-budget scheduler's config (`SchedulerConfig`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """The token-budget scheduler's knobs."""

    max_num_seqs: int | None = None
    """Most requests in one step. None (auto): EngineConfig resolves it once
    (`resolve_max_num_seqs`, docs/decisions.md): 512 for an encoder-decoder model with absorbed
    cross-attention on a GPU (a Whisper request holds ~3 MiB of KV there) and for an
    encoder-only model on a GPU (no KV at all), else 128; the engine core then lowers an auto
    value to the requests its KV cache holds at a typical length."""
    max_num_batched_tokens: int | None = None
    """Most decoder (or encoder-only) tokens in one step. None (auto): 32,768 for an
    encoder-only model on a GPU (`AUTO_POOLING_BATCHED_TOKENS`), else 4,096; EngineConfig
    resolves it once (`resolve_max_num_batched_tokens`)."""
    max_num_encoder_input_tokens: int | None = None
    """Encoder positions one step may run (default: max(max_num_batched_tokens, the model's max
    encoder length)). Distinct from the model's max encoder length of one request."""
    encoder_cache_size: int | None = None
    """Encoder positions the encoder cache holds (default: the per-step encoder budget)."""
    policy: str = "fcfs"
    """Admission order: fcfs, or priority (lower value first, then arrival)."""
    enable_chunked_prefill: bool = True
    """Split long decoder prompts across steps."""
    async_scheduling: bool | None = None
    """Schedule and launch step N+1 before waiting for step N's results, so host work overlaps
    the device; tokens sampled by step N feed step N+1 on the device and the host reads them one
    step behind. None: on for every model kind on CUDA, off on CPU."""
    max_steps_in_flight: int | None = None
    """Pipelined scheduling depth: launched steps not yet read back (the step the device runs
    and those queued behind it). 2 overlaps one step's host work with the device; 3 also
    absorbs a slow host step (a GC pause, a batch of finishing requests) with a second queued
    step, at the cost of one more wasted row per request that ends on EOS. None (auto): 3 for
    encoder-only (pooling) models on a GPU, whose requests end in their one step (no row is
    wasted), else 2; EngineConfig resolves it (`resolve_max_steps_in_flight`)."""

    num_scheduler_steps: int | None = None
    """Decode steps one engine step runs on the device when every request it schedules is
    decoding (no admission, no prefill chunk, no grammar, no word timestamps): the host
    schedules, reads back and processes outputs once per up to this many tokens of each request,
    so a large batch's per-step host work stops bounding the device (vLLM V0's multi-step
    scheduling). A request that ends inside such a step (EOS, a stop, max_tokens) wastes the
    rest of it; max_model_len shortens it. 1: one token per engine step. None (auto): 8 for
    offline batches (`LLM`, where nothing streams per token) on a GPU, else 1 (the server streams
    every token); EngineConfig resolves it (`resolve_num_scheduler_steps`)."""

    def __post_init__(self) -> None:
        if self.num_scheduler_steps is not None and not 1 <= self.num_scheduler_steps <= 64:
            raise ValueError(
                f"num_scheduler_steps must be in [1, 64], got {self.num_scheduler_steps}"
            )
        if self.max_steps_in_flight is not None and not 2 <= self.max_steps_in_flight <= 4:
            raise ValueError(
                f"max_steps_in_flight must be in [2, 4], got {self.max_steps_in_flight} "
                "(async_scheduling=False runs steps one at a time)"
            )
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
