"""LLM.chat as vLLM's: one conversation or a list, rendered with the tokenizer's chat template
(or one given as text or a file), generated from; checked against the template rendered by hand
and the same prompt through generate()."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.conftest import CHAT_TEMPLATE, make_chat_llama_dir
from v1 import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
CONV = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello there"},
]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory):
    model_dir = make_chat_llama_dir(tmp_path_factory.mktemp("chat_llama"), CHAT_TEMPLATE)
    with LLM(model_dir, multiprocess=False, num_kv_blocks=64, block_size=16) as llm:
        yield llm


def rendered_ids(llm: LLM, text: str) -> list[int]:
    return llm.get_tokenizer()(text, add_special_tokens=False)["input_ids"]


def test_chat_renders_the_tokenizer_template_and_generates(llm: LLM) -> None:
    (out,) = llm.chat(CONV, GREEDY, use_tqdm=False)
    text = "<s>system: be brief\n<s>user: hello there\n<s>assistant:"
    expected_ids = rendered_ids(llm, text)
    assert out.prompt_token_ids == expected_ids
    (ref,) = llm.generate({"prompt_token_ids": expected_ids}, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert len(out.outputs[0].token_ids) == 6


def test_a_list_of_conversations_comes_back_in_order(llm: LLM) -> None:
    convs = [CONV, [{"role": "user", "content": "second"}], CONV]
    outs = llm.chat(convs, GREEDY, use_tqdm=False)
    assert len(outs) == 3
    assert outs[1].prompt_token_ids == rendered_ids(llm, "<s>user: second\n<s>assistant:")
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids


def test_template_options(llm: LLM, tmp_path) -> None:
    (no_gen,) = llm.chat(CONV[1:], GREEDY, use_tqdm=False, add_generation_prompt=False)
    assert no_gen.prompt_token_ids == rendered_ids(llm, "<s>user: hello there\n")
    template = "{% for m in messages %}[{{ m['role'] }}|{{ m['content'] }}|{{ tag }}]{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    for given in (template, str(path)):
        (out,) = llm.chat(
            CONV[1:],
            GREEDY,
            use_tqdm=False,
            chat_template=given,
            chat_template_kwargs={"tag": "x"},
        )
        assert out.prompt_token_ids == rendered_ids(llm, "[user|hello there|x]")


def test_bad_chats_are_value_errors_and_the_engine_keeps_serving(llm: LLM) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        llm.chat([], GREEDY)
    with pytest.raises(ValueError, match="conversation 1"):
        llm.chat([CONV, [{"content": "no role"}]], GREEDY)
    with pytest.raises(ValueError, match="chat template failed"):
        llm.chat(CONV, GREEDY, chat_template="{{ raise_exception('nope') }}")
    with pytest.raises(ValueError, match="may not set"):
        llm.chat(CONV, GREEDY, chat_template_kwargs={"messages": []})
    (out,) = llm.chat(CONV, GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 6


def test_a_model_without_a_chat_template_says_how_to_give_one(tmp_path) -> None:
    model_dir = make_chat_llama_dir(tmp_path / "plain", None)
    with LLM(model_dir, multiprocess=False, num_kv_blocks=17, block_size=16) as llm:
        if llm.get_tokenizer().chat_template:
            pytest.skip("the tokenizer builder gave this model a default chat template")
        with pytest.raises(ValueError, match="no chat template: pass chat_template="):
            llm.chat(CONV, GREEDY)
