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


def _generate(path: str, prompts: list[list[int]], **kwargs) -> list[list[int]]:
    from v1 import LLM, SamplingParams

    llm = LLM(path, device="cpu", dtype="float32", multiprocess=False, **kwargs)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=8),
            use_tqdm=False,
        )
        assert llm.llm_engine.get_stats()["num_kv_requests"] == 0
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


def test_padded_steps_generate_the_same_tokens(tmp_path, monkeypatch) -> None:
    """Llama prefill steps and BART encoder runs of 67-300 tokens, padded (as on CUDA) and not:
    the same greedy tokens, every KV block freed."""
    from tests.utils import make_tiny_bart_dir, make_tiny_llama_dir
    from v1.worker import step_inputs

    llama = make_tiny_llama_dir(tmp_path / "llama")
    bart = make_tiny_bart_dir(
        tmp_path / "bart",
        bart_tokenizer=False,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        max_position_embeddings=128,
        forced_eos_token_id=None,
    )
    prompts = [[1] + [(7 * i + 3 * j) % 200 + 4 for j in range(20 + 13 * i)] for i in range(6)]
    for path in (llama, bart):
        monkeypatch.setattr(step_inputs, "PAD_TOKENS", False)
        plain = _generate(path, prompts, max_num_batched_tokens=300)
        monkeypatch.setattr(step_inputs, "PAD_TOKENS", True)
        assert _generate(path, prompts, max_num_batched_tokens=300) == plain
