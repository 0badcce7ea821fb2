"""EncoderInputStore and the core: a request may name an encoder input sent before (beam steps)
instead of sending it again; one the core does not hold fails that request alone."""

from __future__ import annotations

import numpy as np
import pytest

from tests.core.fakes import make_engine_core
from v1.core.encoder_inputs import EncoderInputStore
from v1.core.protocol import EncoderInput, EngineCoreRequest, FinishReason
from v1.sampling_params import SamplingParams


def audio_input(content_hash: str, num_samples: int = 1000) -> EncoderInput:
    audio = np.zeros(num_samples, dtype=np.float32)
    return EncoderInput(num_encoder_tokens=10, content_hash=content_hash, audio=audio)


def test_references_resolve_to_the_last_payload_within_the_budget() -> None:
    store = EncoderInputStore(max_bytes=8000)  # two 4000-byte clips
    a, b, c = audio_input("a"), audio_input("b"), audio_input("c")
    for enc in (a, b):
        assert store.resolve(enc) is enc
    assert store.resolve(EncoderInput(num_encoder_tokens=10, content_hash="a")) is a
    store.resolve(c)  # b is the least recently used: dropped
    assert store.num_bytes == 8000
    with pytest.raises(ValueError, match="does not hold it"):
        store.resolve(EncoderInput(num_encoder_tokens=10, content_hash="b"))
    with pytest.raises(ValueError, match="does not hold it"):  # same hash, other length
        store.resolve(EncoderInput(num_encoder_tokens=11, content_hash="a"))


def test_core_runs_a_named_input_and_fails_an_unknown_one_alone() -> None:
    core = make_engine_core("encoder_decoder", num_kv_blocks=129, block_size=4)
    enc = EncoderInput(num_encoder_tokens=3, content_hash="doc", token_ids=[5, 6, 7])
    named = EncoderInput(num_encoder_tokens=3, content_hash="doc")
    unknown = EncoderInput(num_encoder_tokens=3, content_hash="other")
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for req_id, encoder_input in (("full", enc), ("named", named), ("unknown", unknown)):
        core.add_request(
            EngineCoreRequest(
                request_id=req_id,
                prompt_token_ids=[2],
                sampling_params=params,
                encoder_input=encoder_input,
            )
        )
    outs = []
    while core.has_work():
        outs.extend(core.step().outputs)
    errors = {o.request_id for o in outs if o.finish_reason == FinishReason.ERROR}
    assert errors == {"unknown"}
    tokens = {
        r: [t for o in outs if o.request_id == r for t in o.new_token_ids]
        for r in ("full", "named")
    }
    assert tokens["full"] == tokens["named"] and len(tokens["full"]) == 2
    assert core.get_stats()["num_encoder_runs"] == 1
