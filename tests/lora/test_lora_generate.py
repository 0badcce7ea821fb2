"""Multi-LoRA generation through `LLM.generate`: every request of a batch mixing the base model
and two adapters (ranks 4 and 8) gets PEFT's greedy tokens for its own adapter."""

from __future__ import annotations

from tests.lora.conftest import peft_greedy
from v1 import LLM, LoRARequest, SamplingParams

NUM_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


def _engine(model: str, **kw: object) -> LLM:
    return LLM(
        model,
        multiprocess=False,
        num_kv_blocks=128,
        block_size=4,
        max_model_len=64,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        **kw,
    )


def test_llama_mixed_batch_matches_peft(llama_dir: str, llama_adapters: list[str]) -> None:
    from transformers import LlamaForCausalLM

    loras = [LoRARequest("a4", 1, llama_adapters[0]), LoRARequest("b8", 2, llama_adapters[1])]
    prompts = [[1, 5, 9, 13, 17, 2, 8], [1, 40, 41, 42], [1, 5, 9, 13, 17, 2, 8], [1, 7, 7]]
    per_prompt = [None, loras[0], loras[1], loras[0]]
    with _engine(llama_dir) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=per_prompt
        )
        # Prefix caching on: a second run of the same prompt under another adapter must not
        # reuse the first one's blocks.
        again = llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, lora_request=[loras[1]])
    got = [o.outputs[0].token_ids for o in outs]
    for prompt, lora, tokens in zip(prompts, per_prompt, got, strict=True):
        path = None if lora is None else lora.lora_path
        assert tokens == peft_greedy(
            LlamaForCausalLM, llama_dir, path, NUM_TOKENS, input_ids=prompt
        )
    assert got[0] != got[2]  # the adapters change the outputs
    assert again[0].outputs[0].token_ids == got[2]


def test_bart_mixed_batch_matches_peft(bart_dir: str, bart_adapters: list[str]) -> None:
    import torch
    from transformers import AutoTokenizer, BartForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(bart_dir)
    texts = ["hello world", "a b c d e", "hello world", "the quick fox"]
    loras = [LoRARequest("a4", 1, bart_adapters[0]), LoRARequest("b8", 2, bart_adapters[1])]
    per_prompt = [None, loras[0], loras[1], loras[1]]
    with _engine(bart_dir) as llm:
        outs = llm.generate(texts, GREEDY, lora_request=per_prompt)
    start = BartForConditionalGeneration.from_pretrained(bart_dir).config.decoder_start_token_id
    got = [o.outputs[0].token_ids for o in outs]
    for text, lora, tokens in zip(texts, per_prompt, got, strict=True):
        ids = torch.tensor([tok(text)["input_ids"]])
        want = peft_greedy(
            BartForConditionalGeneration,
            bart_dir,
            None if lora is None else lora.lora_path,
            NUM_TOKENS,
            input_ids=ids,
            decoder_input_ids=[start],
        )
        assert tokens == want, (text, lora)
    # Same text, base vs adapter: distinct encoder runs (the encoder output is keyed by adapter).
    assert got[0] != got[2]


def test_t5_mixed_batch_matches_peft(t5_dir: str, t5_adapters: list[str]) -> None:
    import torch
    from transformers import AutoTokenizer, T5ForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(t5_dir)
    texts = ["hello world", "a b c d e", "hello world"]
    loras = [LoRARequest("a4", 1, t5_adapters[0]), LoRARequest("b8", 2, t5_adapters[1])]
    per_prompt = [None, loras[0], loras[1]]
    with _engine(t5_dir, max_encoder_input_len=64) as llm:
        outs = llm.generate(texts, GREEDY, lora_request=per_prompt)
    start = T5ForConditionalGeneration.from_pretrained(t5_dir).config.decoder_start_token_id
    got = [o.outputs[0].token_ids for o in outs]
    for text, lora, tokens in zip(texts, per_prompt, got, strict=True):
        want = peft_greedy(
            T5ForConditionalGeneration,
            t5_dir,
            None if lora is None else lora.lora_path,
            NUM_TOKENS,
            input_ids=torch.tensor([tok(text)["input_ids"]]),
            decoder_input_ids=[start],
        )
        assert tokens == want, (text, lora)
    assert got[0] != got[2]
