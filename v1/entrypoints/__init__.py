"""Entry points over the engine: the offline `LLM`, the `v1` CLI, the OpenAI-compatible server.

Nothing here runs a model itself; everything goes through LLMEngine or AsyncLLM.
"""
