"""The frontend: input processing, output processing, LLMEngine (sync) and AsyncLLM.

Sits on the core through a client; `transcription/` runs Whisper long-form over either engine.
"""
