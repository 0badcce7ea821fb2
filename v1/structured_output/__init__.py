"""Structured outputs (JSON object / JSON schema) through llguidance.

`params` defines what a request asks for (it crosses the process boundary inside SamplingParams);
`manager` lives in the EngineCore: one grammar matcher per request, advanced on each accepted
token, and the token bitmask of the scheduled requests that the sampler applies.
"""

from v1.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
