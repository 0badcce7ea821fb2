"""Structured outputs (JSON schema or object, regex, choice, grammar): what a request asks for, torch-free
(`params`; it crosses the process boundary inside SamplingParams). The grammar matchers that
enforce it live in the EngineCore (v1/core/structured_output.py).
"""

from v1.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
