"""Quantization applied to a model from outside its code (this package never imports v1.models):
fp8 rows (fp8_rows.py, also the fp8 KV cache's quantizer), fp8 Linears (fp8.py), fp8
checkpoints (fp8_checkpoint.py) and which Linears stay 16-bit (fp8_recipes.py).
"""
