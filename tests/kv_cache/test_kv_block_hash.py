"""Chained block hashes: canonical encoding, chaining, extra keys and the encoder hash."""

from __future__ import annotations

import hashlib

import pytest
from kv_factories import make_request

from v1.kv_cache import hash_block_tokens, request_block_hashes


def test_hash_is_deterministic_sha256() -> None:
    h = hash_block_tokens(None, [1, 2, 3], None)
    assert h == hash_block_tokens(None, [1, 2, 3], None)
    assert isinstance(h, bytes) and len(h) == hashlib.sha256().digest_size


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ((None, [1, 2, 3], None), (None, [1, 2, 4], None)),
        ((None, [1, 2, 3], None), (None, [3, 2, 1], None)),
        ((None, [1, 23], None), (None, [12, 3], None)),
        ((None, [1, 2, 3], None), (b"\x00" * 32, [1, 2, 3], None)),
        ((b"\x01" * 32, [1, 2], None), (b"\x02" * 32, [1, 2], None)),
        ((None, [1, 2], None), (None, [1, 2], ("encoder", "a"))),
        ((None, [1, 2], ("encoder", "a")), (None, [1, 2], ("encoder", "b"))),
        ((None, [1, 2], (1,)), (None, [1, 2], ("1",))),
        ((None, [1, 2], (b"ab", b"c")), (None, [1, 2], (b"a", b"bc"))),
        ((None, [1, 2], ("x", ("y",))), (None, [1, 2], (("x", "y"),))),
    ],
)
def test_any_input_difference_changes_the_hash(a: tuple, b: tuple) -> None:
    assert hash_block_tokens(*a) != hash_block_tokens(*b)


def test_unsupported_extra_key_type_is_rejected() -> None:
    with pytest.raises(TypeError, match="unsupported extra key"):
        hash_block_tokens(None, [1], (object(),))


def test_request_block_hashes_chain_full_blocks_only() -> None:
    request = make_request(prompt_len=10)
    new = request_block_hashes(request, block_size=4)
    assert len(new) == 2 and request.block_hashes == new
    first = hash_block_tokens(None, [0, 1, 2, 3], None)
    assert request.block_hashes == [first, hash_block_tokens(first, [4, 5, 6, 7], None)]
    # Nothing new until a block fills up.
    request.append_output_token_ids([100])
    assert request_block_hashes(request, block_size=4) == []
    request.append_output_token_ids([101])
    added = request_block_hashes(request, block_size=4)
    assert added == [hash_block_tokens(request.block_hashes[1], [8, 9, 100, 101], None)]
    assert len(request.block_hashes) == 3


def test_incremental_hashes_equal_one_shot_hashes() -> None:
    incremental = make_request(prompt_len=3)
    for token in range(3, 13):
        incremental.append_output_token_ids([token])
        request_block_hashes(incremental, block_size=4)
    one_shot = make_request(prompt_len=13)
    request_block_hashes(one_shot, block_size=4)
    assert incremental.block_hashes == one_shot.block_hashes
    assert len(one_shot.block_hashes) == 3


def test_encoder_hash_separates_equal_decoder_prompts() -> None:
    def hashes(**kwargs: object) -> list[bytes]:
        request = make_request(prompt_len=8, **kwargs)
        return request_block_hashes(request, block_size=4)

    audio_a = hashes(num_encoder_tokens=6, encoder_hash="audio-a")
    audio_b = hashes(num_encoder_tokens=6, encoder_hash="audio-b")
    decoder_only = hashes()
    # Every block differs: the first through its extra key, the rest through the chain.
    assert all(a != b for a, b in zip(audio_a, audio_b, strict=True))
    assert all(a != d for a, d in zip(audio_a, decoder_only, strict=True))
    assert audio_a == hashes(num_encoder_tokens=6, encoder_hash="audio-a")


def test_encoder_states_keys_are_distinct_and_never_token_block_hashes() -> None:
    from v1.kv_cache.block_hash import encoder_states_block_hashes

    a = encoder_states_block_hashes("audio-a", 94)
    b = encoder_states_block_hashes("audio-b", 94)
    assert len(set(a) | set(b)) == 188  # per input and per block
    assert a[:10] == encoder_states_block_hashes("audio-a", 10)  # a prefix of the longer list
    assert all(len(k) == 36 for k in a)  # token blocks hash to 32 bytes: no key is shared
    assert len(hash_block_tokens(None, [1], None)) == 32
