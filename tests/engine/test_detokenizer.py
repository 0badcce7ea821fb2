"""Incremental detokenization (DecodeStream and offset fallback) and stop strings."""

from __future__ import annotations

import random

import pytest

from tests.utils import ASSETS, make_tiny_wordpiece_tokenizer, require_asset
from v1.engine.detokenizer import (
    FastIncrementalDetokenizer,
    SlowIncrementalDetokenizer,
    make_detokenizer,
)
from v1.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def wordpiece(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_wordpiece_tokenizer(tmp_path_factory.mktemp("wordpiece"))


@pytest.fixture(scope="module", params=["byte_bpe", "wordpiece", "whisper"])
def tokenizer(request: pytest.FixtureRequest, tiny_tokenizer, wordpiece):
    if request.param == "byte_bpe":
        return tiny_tokenizer
    if request.param == "wordpiece":
        return wordpiece
    require_asset(ASSETS / "whisper-base")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ASSETS / "whisper-base"))


def _decode(tokenizer, ids: list[int], skip: bool) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def _stream(tokenizer, ids, *, prompt=(), fast=True, final_only=False, **params) -> str:
    detok = make_detokenizer(
        tokenizer, SamplingParams(**params), list(prompt), fast=fast, final_only=final_only
    )
    for t in ids:
        detok.update([t], stop_terminated=False)
    return detok.get_next_output_text(finished=True, delta=False)


@pytest.mark.parametrize("skip", [True, False], ids=["skip_special", "keep_special"])
def test_final_only_decodes_once_as_the_stream_would(tokenizer, skip: bool) -> None:
    """A request whose text is read only at its end (no stop strings) is decoded once then:
    the same text as stepping the stream, with and without a prompt to prime it."""
    rng = random.Random(2)
    vocab = len(tokenizer)
    prompt = tokenizer("the quick brown fox jumps")["input_ids"]
    for k in range(60):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        context = prompt if k % 2 else []
        kw = dict(prompt=context, skip_special_tokens=skip)
        assert _stream(tokenizer, ids, final_only=True, **kw) == _stream(tokenizer, ids, **kw), ids
    detok = make_detokenizer(tokenizer, SamplingParams(), prompt, final_only=True)
    detok.update(ids[:3], stop_terminated=False)
    assert detok.output_text == ""  # nothing decoded per step
    detok = make_detokenizer(tokenizer, SamplingParams(stop=["x"]), prompt, final_only=True)
    detok.update(ids[:3], stop_terminated=False)
    assert detok._pending == []  # stop strings need the text every step


@pytest.mark.parametrize("fast", [True, False], ids=["decode_stream", "offsets"])
@pytest.mark.parametrize("skip", [True, False], ids=["skip_special", "keep_special"])
def test_incremental_equals_full_decode(tokenizer, fast: bool, skip: bool) -> None:
    """Random ids, one at a time, give the text of one full decode; only an unfinished
    character at the very end (which the full decode shows as U+FFFD) is held back."""
    rng = random.Random(0)
    vocab = len(tokenizer)
    kind = FastIncrementalDetokenizer if fast else SlowIncrementalDetokenizer
    assert isinstance(make_detokenizer(tokenizer, None, [], fast=fast), kind)
    for _ in range(60):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        text = _stream(tokenizer, ids, fast=fast, skip_special_tokens=skip)
        full = _decode(tokenizer, ids, skip)
        assert text == full or (full.endswith(REPLACEMENT) and full.startswith(text)), ids


@pytest.mark.parametrize("fast", [True, False], ids=["decode_stream", "offsets"])
def test_prompt_context_gives_the_text_after_the_prompt(tokenizer, fast: bool) -> None:
    """Primed with the prompt, the output text is what the output adds to the prompt's text
    (e.g. a leading space, or a "##" piece joined to the prompt's last word)."""
    rng = random.Random(1)
    special = set(tokenizer.all_special_ids)
    normal = [
        i
        for i in range(len(tokenizer))
        if i not in special and REPLACEMENT not in tokenizer.decode([i])
    ]
    checked = 0
    for _ in range(40):
        prompt = tokenizer("the quick brown fox jumps")["input_ids"]
        ids = [rng.choice(normal) for _ in range(rng.randrange(1, 20))]
        before, after = _decode(tokenizer, prompt, True), _decode(tokenizer, prompt + ids, True)
        if REPLACEMENT in after or not after.startswith(before):
            continue
        assert _stream(tokenizer, ids, prompt=prompt, fast=fast) == after[len(before) :]
        checked += 1
    assert checked > 10


def test_real_words_stream_exactly(tiny_tokenizer) -> None:
    text = "Hello world! Straße, café — 東京 😀 done."
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    for fast in (True, False):
        detok = make_detokenizer(tiny_tokenizer, SamplingParams(), [1], fast=fast)
        pieces = []
        for t in ids:
            detok.update([t], False)
            pieces.append(detok.get_next_output_text(finished=False, delta=True))
        assert "".join(pieces) == detok.output_text == text
        assert all(REPLACEMENT not in p for p in pieces)  # split characters wait for their bytes


def test_no_detokenize_keeps_tokens_only(tiny_tokenizer) -> None:
    detok = make_detokenizer(tiny_tokenizer, SamplingParams(detokenize=False), [1])
    detok.update([40, 41], False)
    assert detok.token_ids == [40, 41] and detok.output_text == ""


def test_stop_terminated_token_text_left_out(tiny_tokenizer) -> None:
    ids = tiny_tokenizer("hello world", add_special_tokens=False)["input_ids"]
    detok = make_detokenizer(tiny_tokenizer, SamplingParams(), [1])
    detok.update(ids, stop_terminated=True)
    assert detok.token_ids == ids
    assert detok.output_text == _decode(tiny_tokenizer, ids[:-1], True)
    kept = make_detokenizer(tiny_tokenizer, SamplingParams(include_stop_str_in_output=True), [1])
    kept.update(ids, stop_terminated=True)
    assert kept.output_text == "hello world"


# ---- stop strings ----


def _char_tokens(tokenizer, text: str) -> list[int]:
    """One token per character, so stop strings cross token boundaries."""
    return [tokenizer(c, add_special_tokens=False)["input_ids"][0] for c in text]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(tiny_tokenizer, include: bool) -> None:
    text = "abcdefghij"
    ids = _char_tokens(tiny_tokenizer, text)
    detok = make_detokenizer(
        tiny_tokenizer, SamplingParams(stop=["def"], include_stop_str_in_output=include), [1]
    )
    hits = [detok.update([t], False) for t in ids[:6]]
    # "def" spans three tokens and completes with the 6th one ("f").
    assert hits == [None] * 5 + ["def"]
    assert detok.output_text == ("abcdef" if include else "abc")


def test_earliest_stop_string_wins(tiny_tokenizer) -> None:
    ids = tiny_tokenizer("hello world", add_special_tokens=False)["input_ids"]
    detok = make_detokenizer(tiny_tokenizer, SamplingParams(stop=["world", "lo w"]), [1])
    # Both complete in this one update; "lo w" starts first.
    assert detok.update(ids, False) == "lo w"
    assert detok.output_text == "hel"


def test_stop_string_searched_only_in_new_text(tiny_tokenizer) -> None:
    """A stop string found earlier ended the request there; text before the new chars that
    cannot complete a match is not searched again (and a match must end in the new text)."""
    detok = make_detokenizer(tiny_tokenizer, SamplingParams(stop=["xyz"]), [1])
    detok.output_text = "xyz" * 3  # an old match the new text does not complete
    detok.update(_char_tokens(tiny_tokenizer, "ab"), False)
    assert detok.output_text.endswith("ab")


def test_stop_strings_wait_for_min_tokens(tiny_tokenizer) -> None:
    ids = _char_tokens(tiny_tokenizer, "ab ab ab")
    detok = make_detokenizer(tiny_tokenizer, SamplingParams(stop=["ab"], min_tokens=4), [1])
    hits = [detok.update([t], False) for t in ids[:5]]
    # Tokens 1-4 ("ab a") are protected; "ab" next completes at token 5 ("b").
    assert hits == [None] * 4 + ["ab"]
    assert detok.output_text == "ab "


def test_streamed_text_holds_back_a_possible_stop_string(tiny_tokenizer) -> None:
    ids = _char_tokens(tiny_tokenizer, "one two three")
    detok = make_detokenizer(tiny_tokenizer, SamplingParams(stop=["two!", "xx"]), [1])
    deltas = []
    for t in ids:
        detok.update([t], False)
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
        # Never more than len(longest stop) - 1 = 3 characters behind.
        assert len(detok.output_text) - len("".join(deltas)) <= 3
        assert detok.get_next_output_text(False, delta=False) == "".join(deltas)
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    assert "".join(deltas) == "one two three"
