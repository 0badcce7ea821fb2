"""`cross_attention="auto"`: per-layer K/V or absorbed cross-attention, decided once at start-up.

The rule (docs/architecture.md, "Cross-attention modes", keeps it and the measurements behind it):
on CPU, per_layer (compute-bound: absorbed attends over d_model-wide rows, H x d / D times the
FLOPs); on a GPU, absorbed, except with an fp8 KV cache where only the Triton kernel takes the
fp8 states (fp32 models, GPUs before sm_89): its fp8 path is slower than its 16-bit one
(large-v3 1,284 RTFx absorbed vs 1,610 per_layer, both fp8, session 5). The CUDA kernel's fp8
path beats per-layer fp8 K/V (session 10, H100, fp8 weights: large-v3 2,242 vs 1,995 RTFx,
turbo 5,023 vs 4,872). Measured on an H100 with the absorbed kernel of 2026-11-23 (session
5): absorbed beat per_layer on every workload tried, at the same batch and where per-layer K/V
capped the batch: whisper-large-v3 1,753 vs 1,657 RTFx (256 clips) and 1,774 vs 1,648 (512
clips: absorbed ran all 512 at once, per_layer 286), large-v3-turbo 3,179 vs 2,782 RTFx,
bart-large 37,663 vs 33,192 tok/s. (The kernel before that cost ~1.3x per request-step what
per-layer K/V did, and the rule then kept per_layer wherever 64 requests fit.)
"""

from __future__ import annotations

from v1.config import EngineConfig


def choose_cross_attention(
    config: EngineConfig,
    has_cross_attention: bool,
    device_type: str,
    fast_fp8_states: bool = False,
) -> str:
    """per_layer or absorbed for `config.cache_config.cross_attention` ("auto" resolved);
    `fast_fp8_states`: the CUDA kernel takes fp8 encoder states on this GPU and model."""
    mode = config.cache_config.cross_attention
    if mode != "auto":
        return mode
    if device_type != "cuda" or not has_cross_attention:
        return "per_layer"
    if config.cache_config.fp8_kv_cache and not fast_fp8_states:
        return "per_layer"
    return "absorbed"
