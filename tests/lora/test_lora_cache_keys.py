"""The core keys caches by adapter: a LoRA request's encoder content hash and its first
prefix-cache block differ from the base model's and from another adapter's, equal for equal
adapters."""

from __future__ import annotations

from v1.core.protocol import EncoderInput, EngineCoreRequest
from v1.core.request import Request
from v1.kv_cache import request_block_hashes
from v1.lora_request import LoRARequest
from v1.sampling_params import SamplingParams


def _request(lora: LoRARequest | None, encoder: bool) -> Request:
    core = EngineCoreRequest(
        request_id="r",
        prompt_token_ids=list(range(8)),
        sampling_params=SamplingParams(max_tokens=1),
        encoder_input=EncoderInput(num_encoder_tokens=3, content_hash="h", token_ids=[1, 2, 3])
        if encoder
        else None,
        lora_request=lora,
    )
    request = Request.from_engine_core_request(core, max_model_len=64)
    request_block_hashes(request, block_size=4)
    return request


def test_block_and_encoder_keys_differ_per_adapter() -> None:
    a, a_again = LoRARequest("a", 1, "/a"), LoRARequest("a", 1, "/a")
    b = LoRARequest("b", 2, "/b")
    for encoder in (False, True):
        base, ra, ra2, rb = (_request(x, encoder) for x in (None, a, a_again, b))
        assert ra.block_hashes == ra2.block_hashes
        assert len({tuple(r.block_hashes) for r in (base, ra, rb)}) == 3
        assert base.lora_int_id == 0 and ra.lora_int_id == 1
        if encoder:
            assert len({r.encoder_hash for r in (base, ra, rb)}) == 3
            assert ra.encoder_hash == ra2.encoder_hash
