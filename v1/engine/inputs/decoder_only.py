"""Decoder-only models (Llama, Qwen2, GPT-2): the prompt is the decoder prompt.

A string or {"prompt_token_ids"} is the decoder prompt; truncate_prompt_tokens keeps its LAST N
tokens (as vLLM); the generation config fills unset sampling fields (`GenerationDefaults`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from v1.core.protocol import EngineCoreRequest, now
from v1.engine.inputs.base import GenerationInputBuilder

if TYPE_CHECKING:
    from v1.sampling_params import SamplingParams


class DecoderOnlyInputBuilder(GenerationInputBuilder):
    prompt_is_decoder_prompt = True

    def build(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> EngineCoreRequest:
        ids = self.decoder_prompt(prompt, params.truncate_prompt_tokens)
        self.check_room(len(ids))
        params, eos_token_id = self.defaults.apply(params, len(ids))
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling_params=params,
            eos_token_id=eos_token_id,
            arrival_time=now() if arrival_time is None else arrival_time,
            priority=priority,
        )

    def decoder_prompt(self, prompt: Any, truncate: int | None) -> list[int]:
        ids, _ = self.singleton(
            prompt, add_special_tokens=True, what="prompt", vocab_size=self.vocab_size
        )
        if truncate is not None and len(ids) > truncate:
            ids = ids[-truncate:]
        return ids

    def decoder_prompt_len(self, prompt: Any, truncate_prompt_tokens: int | None = None) -> int:
        return len(self.decoder_prompt(prompt, truncate_prompt_tokens))
