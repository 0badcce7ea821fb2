"""Text encoder-decoder models (BART/mBART/Marian, T5): the prompt is the encoder's input.

The decoder starts from [decoder_start_token_id] unless {"encoder_prompt", "decoder_prompt"}
sets it (prepended as transformers does). Encoder ids are checked against the encoder's
vocabulary, the decoder prompt against the decoder's (Marian's may differ).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from v1.core.protocol import EngineCoreRequest, now
from v1.engine.inputs.base import GenerationInputBuilder, check_keys, make_encoder_input, text_of

if TYPE_CHECKING:
    from v1.sampling_params import SamplingParams


class EncoderDecoderInputBuilder(GenerationInputBuilder):
    def build(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> EngineCoreRequest:
        enc_prompt, dec_prompt = self._split(prompt)
        enc_ids, _ = self.singleton(
            enc_prompt,
            add_special_tokens=True,
            what="encoder prompt",
            vocab_size=self.encoder_vocab_size,
        )
        enc_ids, _ = self.fit_encoder(enc_ids, None, params.truncate_prompt_tokens)
        dec_ids = self._decoder_prompt(dec_prompt)
        self.check_room(len(dec_ids))
        params, eos_token_id = self.defaults.apply(params, len(dec_ids))
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=dec_ids,
            sampling_params=params,
            encoder_input=make_encoder_input(enc_ids),
            eos_token_id=eos_token_id,
            arrival_time=now() if arrival_time is None else arrival_time,
            priority=priority,
        )

    def decoder_prompt_len(self, prompt: Any, truncate_prompt_tokens: int | None = None) -> int:
        """1 ([decoder_start_token_id]) unless an explicit pair gives a decoder prompt."""
        return len(self._decoder_prompt(self._split(prompt)[1]))

    def prompt_texts(self, prompt: Any) -> tuple[str | None, str | None]:
        if isinstance(prompt, dict) and "encoder_prompt" in prompt:
            return super().prompt_texts(prompt)
        return None, text_of(prompt)

    def _split(self, prompt: Any) -> tuple[Any, Any]:
        """(encoder prompt, decoder prompt or None)."""
        if isinstance(prompt, dict) and "encoder_prompt" in prompt:
            check_keys(prompt)
            enc_prompt, dec_prompt = prompt["encoder_prompt"], prompt.get("decoder_prompt")
        else:
            enc_prompt, dec_prompt = prompt, None
        if isinstance(enc_prompt, dict) and "encoder_prompt" in enc_prompt:
            raise ValueError("an encoder_prompt cannot itself be an encoder/decoder pair")
        return enc_prompt, dec_prompt

    def _decoder_prompt(self, dec_prompt: Any) -> list[int]:
        start = self.defaults.decoder_start_token_id
        if dec_prompt is None:
            return [start]
        ids, _ = self.singleton(
            dec_prompt,
            add_special_tokens=False,
            what="decoder prompt",
            vocab_size=self.vocab_size,
        )
        return ids if ids[0] == start else [start, *ids]
