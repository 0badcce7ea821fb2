"""Grammar matchers of the EngineCore's structured-output requests (llguidance), one per
request, advanced on every accepted token. A step's bitmask rows are computed from the matchers,
so a mask reflects all of a request's tokens: such requests never run with a token in flight
(Request.num_schedulable_tokens). No torch here; the sampler unpacks the bits on the device.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from v1.config import ModelConfig
from v1.structured_output.params import StructuredOutputsParams


class StructuredOutputManager:
    def __init__(self, model_config: ModelConfig) -> None:
        self.model_config = model_config
        self.vocab_size = model_config.vocab_size
        self._hf_tokenizer: Any = None
        self._ll_tokenizers: dict[int | None, Any] = {}
        """EOS id -> llguidance tokenizer (built once, ~1 s for a large vocabulary)."""
        self.matchers: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self.matchers)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.matchers

    def _ll_tokenizer(self, eos_token_id: int | None) -> Any:
        tokenizer = self._ll_tokenizers.get(eos_token_id)
        if tokenizer is None:
            import llguidance.hf

            from v1.tokenizer import get_tokenizer

            if self._hf_tokenizer is None:
                self._hf_tokenizer = get_tokenizer(self.model_config)
            tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer,
                n_vocab=self.vocab_size,
                eos_token=eos_token_id,
            )
            self._ll_tokenizers[eos_token_id] = tokenizer
        return tokenizer

    def compile(self, params: StructuredOutputsParams, eos_token_id: int | None) -> Any:
        """A fresh matcher for `params`; ValueError for a grammar llguidance refuses."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self._ll_tokenizer(eos_token_id), params.grammar_spec(), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs: {matcher.get_error()}")
        return matcher

    def add(self, req_id: str, matcher: Any) -> None:
        self.matchers[req_id] = matcher

    def accept(self, req_id: str, token_ids: list[int]) -> str | None:
        """Advances the request's matcher; None, or why a token broke the grammar."""
        matcher = self.matchers[req_id]
        for token in token_ids:
            if matcher.is_stopped():
                break  # the EOS after an accepted document ends the request
            if not matcher.consume_token(token):
                return f"token {token} violates the structured output grammar: " + (
                    matcher.get_error() or "rejected"
                )
        return None

    def retain(self, live_req_ids: Any) -> None:
        """Drops the matchers of requests that ended (finished, aborted, failed)."""
        for req_id in [r for r in self.matchers if r not in live_req_ids]:
            del self.matchers[req_id]

    def bitmask(self, req_ids: list[str]) -> tuple[list[str], np.ndarray | None]:
        """(the structured requests among `req_ids`, their next-token bitmask
        [k, ceil(vocab / 32)] int32: bit j of row i allows token 32 * word + j)."""
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        rows = [r for r in req_ids if r in self.matchers]
        if not rows:
            return [], None
        mask = allocate_token_bitmask(len(rows), self.vocab_size)
        for i, req_id in enumerate(rows):
            fill_next_token_bitmask(self.matchers[req_id], mask, i)
        return rows, mask
