"""Attention kernels (Triton on GPU) and the plain-torch references they are tested against."""
