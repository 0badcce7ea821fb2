"""Structured outputs (llguidance grammar masks) and logit_bias through `v1.LLM`.

A tiny random Llama writes gibberish on its own; under a JSON schema whose strings and numbers
are bounded every completion must end (EOS only once the document is complete) and validate,
greedy and at temperature 1.0, with synchronous and pipelined steps alike.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from tests.utils import make_tiny_llama_dir
from v1 import LLM, SamplingParams
from v1.structured_output import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["a", "b"]},
    },
    "required": ["name", "age", "ok", "tag"],
    "additionalProperties": False,
}
"""Every valid document is short: max_tokens=100 always reaches EOS."""


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("llama"))


def _schema_params(**kwargs: object) -> SamplingParams:
    return SamplingParams(
        max_tokens=100, structured_outputs=StructuredOutputsParams(json=SCHEMA), **kwargs
    )


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_json_schema_output_validates(llama_dir: str, async_scheduling: bool) -> None:
    with LLM(
        llama_dir,
        multiprocess=False,
        num_kv_blocks=80,
        block_size=4,
        max_model_len=128,
        async_scheduling=async_scheduling,
    ) as llm:
        prompts = ["Hello world", "The quick brown", "A journey", "Plain text beside"]
        params = [
            _schema_params(temperature=0),
            _schema_params(temperature=1.0, seed=3),
            _schema_params(temperature=1.0),
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),  # unconstrained
        ]
        outs = llm.generate(prompts, params)
        for out in outs[:3]:
            completion = out.outputs[0]
            assert completion.finish_reason == "stop", completion.text
            jsonschema.validate(json.loads(completion.text), SCHEMA)
        # The unconstrained neighbour is untouched by its neighbours' masks.
        alone = llm.generate([prompts[3]], [params[3]])[0].outputs[0]
        assert outs[3].outputs[0].token_ids == alone.token_ids
        assert len(alone.token_ids) == 12
        with pytest.raises(ValueError):
            json.loads(alone.text)  # the model's own text is no JSON: the grammar did the work


def test_json_object_with_logit_bias(llama_dir: str) -> None:
    """json_object gives any JSON object; a +100 bias on "}" makes it the empty one, and the
    grammar then allows only EOS."""
    with LLM(
        llama_dir, multiprocess=False, num_kv_blocks=80, block_size=4, max_model_len=128
    ) as llm:
        tokenizer = llm.get_tokenizer()
        close = tokenizer.convert_tokens_to_ids("}")
        for temperature in (0.0, 1.0):
            params = SamplingParams(
                temperature=temperature,
                max_tokens=40,
                logit_bias={close: 100.0},
                structured_outputs=StructuredOutputsParams(json_object=True),
            )
            completion = llm.generate(["Hello"], params)[0].outputs[0]
            assert completion.finish_reason == "stop"
            assert json.loads(completion.text) == {}


def test_logit_bias_moves_sampling(llama_dir: str) -> None:
    with LLM(
        llama_dir, multiprocess=False, num_kv_blocks=80, block_size=4, max_model_len=128
    ) as llm:
        base = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        plain = llm.generate(["Hello world"], base)[0].outputs[0].token_ids
        first = plain[0]
        banned = llm.generate(["Hello world"], base.clone(logit_bias={first: -100.0}))
        assert first not in banned[0].outputs[0].token_ids
        forced = llm.generate(["Hello world"], base.clone(logit_bias={7: 100.0, first: -5.0}))
        assert forced[0].outputs[0].token_ids == [7] * 6
        # The bias left with its request: the same slot now samples as before.
        assert llm.generate(["Hello world"], base)[0].outputs[0].token_ids == plain


def test_bad_structured_and_bias_params(llama_dir: str) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 101.0})
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(json="{}"))
    with LLM(
        llama_dir, multiprocess=False, num_kv_blocks=80, block_size=4, max_model_len=128
    ) as llm:
        bad_schema = StructuredOutputsParams(json={"type": "no-such-type"})
        with pytest.raises(ValueError, match="JSON schema"):
            llm.generate(["Hello"], SamplingParams(structured_outputs=bad_schema))
        with pytest.raises(ValueError, match="not valid JSON"):
            llm.generate(
                ["Hello"],
                SamplingParams(structured_outputs=StructuredOutputsParams(json="{oops")),
            )
        with pytest.raises(ValueError, match="vocabulary"):
            llm.generate(["Hello"], SamplingParams(logit_bias={10**6: 1.0}))
        # The engine is fine afterwards.
        assert llm.generate(["Hello"], SamplingParams(max_tokens=3, ignore_eos=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_structured_outputs_and_bias_on_gpu(llama_dir: str) -> None:
    """The masks on the device, with pipelined steps and CUDA graphs (the GPU defaults):
    structured rows sit out one launch while the unconstrained neighbour keeps the pipeline."""
    with LLM(llama_dir, device="cuda", num_kv_blocks=256, block_size=16, max_model_len=128) as llm:
        prompts = ["Hello world", "The quick brown", "Plain text beside", "Biased"]
        params = [
            _schema_params(temperature=0),
            _schema_params(temperature=1.0, seed=3),
            SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
            SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, logit_bias={7: 100.0}),
        ]
        outs = llm.generate(prompts, params)
        for out in outs[:2]:
            assert out.outputs[0].finish_reason == "stop"
            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
        assert len(outs[2].outputs[0].token_ids) == 32
        assert outs[3].outputs[0].token_ids == [7] * 8
