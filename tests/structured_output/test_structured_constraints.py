"""Constrained decoding through `v1.LLM` with StructuredOutputsParams(choice / regex / json /
json_object / grammar), for a decoder-only (tiny Llama) and an encoder-decoder (tiny BART)
model: every output meets its constraint, greedy and sampled.

BART's generation config forces BOS as the first token and EOS at the length limit; neither may
break a grammar: the forced tokens yield, so json_object outputs either parse (and end with
finish_reason "stop") or honestly end with "length".
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.utils import make_tiny_bart_dir, make_tiny_llama_dir
from v1 import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams

ENGINE = dict(multiprocess=False, num_kv_blocks=256, block_size=4, max_model_len=64)
CHOICES = ["yes", "no", "maybe so"]
REGEX = r"[0-9]{3}-[a-z]{2,4}"
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["a", "b"]},
    },
    "required": ["id", "ok", "tag"],
    "additionalProperties": False,
}
LARK = 'start: "x" NUM ";"\nNUM: /[0-9]{1,5}/'
GBNF = 'root ::= "(" [a-c]+ ")"'


@pytest.fixture(scope="module", params=["llama", "bart"])
def llm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp(request.param)
    path = make_tiny_llama_dir(root) if request.param == "llama" else make_tiny_bart_dir(root)
    with LLM(path, **ENGINE) as llm:
        yield llm


def _run(llm: LLM, structured: StructuredOutputsParams, max_tokens: int = 40) -> list:
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=structured)]
    params += [
        SamplingParams(
            temperature=1.0, seed=i, max_tokens=max_tokens, structured_outputs=structured
        )
        for i in range(5)
    ]
    outs = llm.generate(["Hello world", *["The quick brown fox"] * 5], params)
    return [o.outputs[0] for o in outs]


def test_choice_regex_json_grammar(llm: LLM) -> None:
    for c in _run(llm, StructuredOutputsParams(choice=CHOICES)):
        assert c.text in CHOICES and c.finish_reason == "stop"
    for c in _run(llm, StructuredOutputsParams(regex=REGEX)):
        assert re.fullmatch(REGEX, c.text) and c.finish_reason == "stop", c.text
    for c in _run(llm, StructuredOutputsParams(json=SCHEMA)):
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    for c in _run(llm, StructuredOutputsParams(grammar=LARK)):
        assert re.fullmatch(r"x[0-9]{1,5};", c.text) and c.finish_reason == "stop", c.text
    for c in _run(llm, StructuredOutputsParams(grammar=GBNF)):
        assert c.finish_reason in ("stop", "length"), c.text
        if c.finish_reason == "stop":
            assert re.fullmatch(r"\([a-c]+\)", c.text), c.text
        else:
            assert re.fullmatch(r"\([a-c]*", c.text), c.text


def test_json_object_never_cut_by_forced_tokens(llm: LLM) -> None:
    """Before forced tokens yielded, BART's forced EOS at the length limit ended unfinished
    JSON with finish_reason "stop"; now a "stop" output always parses."""
    outs = _run(llm, StructuredOutputsParams(json_object=True), max_tokens=24)
    outs += [
        o.outputs[0]
        for o in llm.generate(
            ["A", "B c d", "e f"] * 4,
            [
                SamplingParams(
                    temperature=1.0,
                    seed=100 + i,
                    max_tokens=24,
                    structured_outputs=StructuredOutputsParams(json_object=True),
                )
                for i in range(12)
            ],
        )
    ]
    stopped = [c for c in outs if c.finish_reason == "stop"]
    for c in stopped:
        assert isinstance(json.loads(c.text), dict), c.text
        assert not c.text.startswith("<s>")
    for c in outs:
        if c.finish_reason != "stop":
            assert c.finish_reason == "length" and len(c.token_ids) == 24
    assert len(stopped) >= len(outs) // 2


def test_bad_constraints_and_beam_search_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(choice=CHOICES, regex=REGEX)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="regex"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="([")))
    with pytest.raises(ValueError, match="grammar"):
        llm.generate(
            ["x"], SamplingParams(structured_outputs=StructuredOutputsParams(grammar="start: foo"))
        )
    with pytest.raises(ValueError, match="beam search"):
        llm.beam_search(
            ["x"],
            BeamSearchParams(beam_width=2, max_tokens=4),
            sampling_params=SamplingParams(
                structured_outputs=StructuredOutputsParams(choice=CHOICES)
            ),
        )
    # The engine survives the refusals.
    (out,) = llm.generate(["x"], SamplingParams(max_tokens=2, temperature=0))
    assert len(out.outputs[0].token_ids) >= 1


def test_whisper_forced_prefix_yields_to_the_grammar(tmp_path_factory) -> None:
    """Whisper (tiny, random): the decoder prompt's forced start tokens and the Whisper sampling
    rules run with a grammar, which still decides every generated token: choice and regex
    outputs meet their constraint, greedy and sampled."""
    import numpy as np

    from tests.utils import make_tiny_whisper_dir

    path = make_tiny_whisper_dir(tmp_path_factory.mktemp("whisper"))
    rng = np.random.default_rng(0)
    prompts = [
        {
            "prompt": "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>",
            "multi_modal_data": {"audio": (rng.standard_normal(16000).astype(np.float32), 16000)},
        }
        for _ in range(3)
    ]
    with LLM(path, device="cpu", multiprocess=False, num_kv_blocks=512, block_size=4) as llm:
        for structured, check in (
            (StructuredOutputsParams(choice=CHOICES), lambda t: t in CHOICES),
            (StructuredOutputsParams(regex=REGEX), lambda t: re.fullmatch(REGEX, t)),
        ):
            params = [
                SamplingParams(temperature=t, seed=i, max_tokens=24, structured_outputs=structured)
                for i, t in enumerate((0.0, 1.0, 1.0))
            ]
            for out in llm.generate(prompts, params, use_tqdm=False):
                c = out.outputs[0]
                assert check(c.text) and c.finish_reason == "stop", c.text
