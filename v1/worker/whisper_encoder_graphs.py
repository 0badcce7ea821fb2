"""CUDA graphs of Whisper's encoder (log-mel included) for the small models, whose encoder steps
are bound by kernel launches: one graph per power-of-two window count up to a step's encoder
budget, replayed over a static [B, 30 s] audio buffer. A step of n windows replays its
power-of-two parts (25 = 16 + 8 + 1), the parts cuDNN's dense attention already runs in.

whisper-base on real speech (benchmarks/real_speech_profile.py, H200): the encoder's eager
launches took 3.4 ms of host time a 32-window step against ~7 ms of device time for the whole
step, and the engine's host, not the device, set the wall. Models of `d_model` past
MAX_GRAPH_D_MODEL keep the eager encoder: their steps are device-bound (large-v3's 32
windows are ~140 ms of kernels), and a graph's private memory pool would hold their ~1.5 GB
of activations for good.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from v1.attention.backend import AttentionType, power_of_two_parts
from v1.attention.ops import fa4
from v1.forward_context import ForwardContext, set_forward_context
from v1.logger import init_logger

logger = init_logger(__name__)

MAX_GRAPH_D_MODEL = 768
"""Whisper tiny (384), base (512) and small (768) get encoder graphs."""


class WhisperEncoderGraphs:
    """Graphs of `model.encode` over [B, n_samples] padded audio for B = 1, 2, 4, ... up to
    `max_windows` (one shared memory pool), each with the encoder attention metadata of B full
    windows made once at capture (equal-length windows: the metadata never changes)."""

    def __init__(
        self,
        model: Any,
        attn_metadata: Any,
        layer_names: list[str],
        device: torch.device,
        max_windows: int,
        num_positions: int,
    ) -> None:
        self.model = model
        self.attn_metadata = attn_metadata
        self.layer_names = layer_names
        self.device = device
        self.num_positions = num_positions
        self.sizes = [1 << b for b in range(max(max_windows, 1).bit_length())]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, Any]] = {}
        """size -> (graph, its audio buffer, its output, the metadata it reads)."""

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its pool
            audio = torch.zeros(size, self.model.mel.n_samples, device=self.device)
            lengths = np.full(size, self.num_positions, dtype=np.int64)
            metadata = self.attn_metadata.uncached(lengths, AttentionType.ENCODER, self.layer_names)
            with set_forward_context(ForwardContext(metadata)):
                self.model.encode(audio)  # warm-up: cuDNN plans and GEMM kernels load outside
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.model.encode(audio)
            self.graphs[size] = (graph, audio, out, metadata)
        torch.cuda.synchronize(self.device)
        logger.info("captured Whisper encoder CUDA graphs for 1-%d windows", self.sizes[-1])

    @torch.inference_mode()
    def encode(self, clips: list[torch.Tensor]) -> torch.Tensor:
        """1-D float32 clips of at most 30 s on the device -> their encoder states
        [len(clips) * num_positions, d_model], a tensor of its own (the graphs' outputs are
        overwritten by the next replay)."""
        out: torch.Tensor | None = None
        first = 0
        for size in power_of_two_parts(len(clips)):
            graph, audio, graph_out, _ = self.graphs[size]
            self.model.mel.pad_batch(clips[first : first + size], out=audio)
            graph.replay()
            if out is None:
                out = graph_out.new_empty(len(clips) * self.num_positions, graph_out.shape[-1])
            rows = slice(first * self.num_positions, (first + size) * self.num_positions)
            out[rows].copy_(graph_out)
            first += size
        assert out is not None, "no clips"
        return out


def make_whisper_encoder_graphs(
    model: Any,
    attn_metadata: Any,
    layer_names: list[str],
    config: Any,
    device: torch.device,
) -> WhisperEncoderGraphs | None:
    """Graphs for a small Whisper on CUDA in 16 bits, one GPU, no LoRA, eager steps not forced,
    FlashAttention-4 not in use (its compiled kernels are not known to capture); None
    otherwise, or where the capture fails (the eager encoder then runs as before)."""
    hf = config.model_config.hf_config
    dtype = next(model.parameters()).dtype
    if (
        device.type != "cuda"
        or config.enforce_eager
        or dtype not in (torch.float16, torch.bfloat16)
        or hf.d_model > MAX_GRAPH_D_MODEL
        or config.parallel_config.tensor_parallel_size > 1
        or config.lora_config.enable_lora
        or fa4.available(device)
    ):
        return None
    graphs = WhisperEncoderGraphs(
        model,
        attn_metadata,
        layer_names,
        device,
        config.encoder_budget_inputs,
        config.model_config.max_encoder_len,
    )
    try:
        graphs.capture()
    except RuntimeError as e:
        logger.warning("Whisper encoder graphs not captured (%s); the encoder runs eagerly", e)
        torch.cuda.synchronize(device)
        return None
    return graphs
