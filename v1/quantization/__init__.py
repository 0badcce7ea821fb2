"""Quantization applied to a model from outside its code: fp8 weights and activations (fp8.py).

Caches in fp8 (kv_cache_dtype="fp8") use the same row quantizer, from the attention ops.
"""
