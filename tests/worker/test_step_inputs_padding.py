"""Eager CUDA steps pad their token count to a repeating bucket (`padded_num_tokens`)."""

from __future__ import annotations

from v1.worker.step_inputs import MIN_PADDED_TOKENS, padded_num_tokens


def test_padded_token_counts_repeat_and_waste_little() -> None:
    counts = {padded_num_tokens(n) for n in range(1, 70_000)}
    for n in range(1, 70_000):
        padded = padded_num_tokens(n)
        assert n <= padded <= n + max(n // 32, 0) + 1
        if n <= MIN_PADDED_TOKENS:
            assert padded == n
    # ~32 counts per doubling above the minimum, not one per token count.
    assert len(counts) < MIN_PADDED_TOKENS + 32 * 11
    assert padded_num_tokens(31_000) == padded_num_tokens(31_100) == 31_232
