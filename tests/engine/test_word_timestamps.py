"""Word timestamps with the real whisper-base: per-token times of `SamplingParams(word_timestamps=
True)` and the words of `LLM.transcribe(word_timestamps=True)` against transformers'
`return_token_timestamps` on the shared clips (within 0.1 s), openai-whisper's word splitting
against transformers' on the real tokenizer, and long-form words on the file's clock.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.engine.test_transcription import ENGINE_ARGS
from tests.utils import ASSETS, ONE_TORCH_THREAD, WHISPER_BASE, needs_assets
from v1 import LLM, SamplingParams
from v1.audio import load_audio
from v1.engine.transcription.words import split_words

AUDIO = ASSETS / "audio"
CLIPS = ["jfk.flac", "librispeech/test_audio_1.flac", "librispeech/test_audio_0.flac"]
NUM_COMPARED = 2
"""Clips compared with transformers (its generate with cross-attentions is the slow part):
JFK (pauses, punctuation) and LibriSpeech 1 (words of several tokens)."""
SR = 16_000
TOLERANCE = 0.1 + 1e-6
"""Seconds (times are multiples of 0.02 s: 0.1 s is five encoder positions)."""
pytestmark = [needs_assets(WHISPER_BASE, AUDIO), ONE_TORCH_THREAD]


@pytest.fixture(scope="module")
def clips() -> list[np.ndarray]:
    return [load_audio(AUDIO / name) for name in CLIPS]


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    """Pipelined steps (as on GPU): a request's alignment pass runs while a step launched after
    its last token is in flight (the server and CLI tests run synchronous steps)."""
    with LLM(str(WHISPER_BASE), async_scheduling=True, **ENGINE_ARGS) as llm:
        yield llm


def transformers_token_times(clips: list[np.ndarray]) -> list[tuple[list[int], list[float]]]:
    """transformers' (generated token ids, token_timestamps) of each clip: fp32 on the CPU,
    greedy, English, the attention mask giving the clip's frames (one clip per call, as DTW
    of a padded batch would also see the rows after a shorter sequence's EOS)."""
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    processor = WhisperProcessor.from_pretrained(str(WHISPER_BASE))
    model = WhisperForConditionalGeneration.from_pretrained(
        str(WHISPER_BASE), dtype=torch.float32
    ).eval()
    out = []
    for audio in clips:
        inputs = processor(audio, sampling_rate=SR, return_tensors="pt", return_attention_mask=True)
        with torch.no_grad():
            gen = model.generate(
                inputs.input_features,
                attention_mask=inputs.attention_mask,
                language="en",
                task="transcribe",
                return_token_timestamps=True,
            )
        out.append((gen["sequences"][0].tolist(), gen["token_timestamps"][0].tolist()))
    return out


def assert_token_times_match(
    outputs: list[Any], reference: list[tuple[list[int], list[float]]], eos: int
) -> None:
    """transformers' token_timestamps[k] is where its DTW path leaves text token k: our end of
    token k (the start of token k + 1). Its first entry is 0 (its DTW drops the row that
    predicts the first token), so the comparison starts at the second token."""
    for i, (out, (ref_ids, ref_times)) in enumerate(zip(outputs, reference, strict=True)):
        text = _text_ids(out.outputs[0].token_ids, eos)
        assert text == _text_ids(ref_ids, eos), i
        times = out.extras["token_times"]
        assert len(times) == len(text) + 1
        assert times == sorted(times) and times[0] >= 0.0
        np.testing.assert_allclose(times[2:], ref_times[1 : len(text)], rtol=0, atol=TOLERANCE)


@pytest.fixture(scope="module")
def reference(clips: list[np.ndarray]) -> list[tuple[list[int], list[float]]]:
    return transformers_token_times(clips[:NUM_COMPARED])


def _text_ids(ids: list[int], eos: int) -> list[int]:
    return [t for t in ids if t < eos]


def test_token_times_match_transformers(
    llm: LLM, clips: list[np.ndarray], reference: list[tuple[list[int], list[float]]]
) -> None:
    prompts = [{"prompt": "", "multi_modal_data": {"audio": (a, SR)}} for a in clips]
    params = SamplingParams(temperature=0.0, max_tokens=None, word_timestamps=True)
    outputs = llm.generate(prompts[:NUM_COMPARED], params, use_tqdm=False)
    assert_token_times_match(outputs, reference, llm.get_tokenizer().eos_token_id)
    for out, audio in zip(outputs, clips, strict=False):
        assert out.extras["token_times"][-1] <= len(audio) / SR


def test_times_come_with_the_last_output_whatever_ends_the_request(
    llm: LLM, clips: list[np.ndarray]
) -> None:
    """max_tokens and a stop token end requests as EOS does: their final output carries the
    times of every text token; a request without word_timestamps gets none."""
    prompt = {"prompt": "", "multi_modal_data": {"audio": (clips[0], SR)}}
    country = llm.get_tokenizer()(" country", add_special_tokens=False)["input_ids"]
    assert len(country) == 1
    params = [
        SamplingParams(temperature=0.0, max_tokens=5, word_timestamps=True),
        SamplingParams(
            temperature=0.0, max_tokens=None, stop_token_ids=country, word_timestamps=True
        ),
        SamplingParams(temperature=0.0, max_tokens=3),
    ]
    capped, stopped, plain = llm.generate([prompt] * 3, params, use_tqdm=False)
    assert len(capped.outputs[0].token_ids) == 5 and capped.outputs[0].finish_reason == "length"
    assert len(capped.extras["token_times"]) == 6
    ids = stopped.outputs[0].token_ids
    assert ids[-1] == country[0] and stopped.outputs[0].finish_reason == "stop"
    assert len(stopped.extras["token_times"]) == len(ids) + 1
    assert stopped.extras["token_times"] == sorted(stopped.extras["token_times"])
    assert "token_times" not in (plain.extras or {})
    assert llm.llm_engine.get_stats()["num_kv_requests"] == 0


@pytest.fixture(scope="module")
def transcribed(llm: LLM, clips: list[np.ndarray]) -> list[Any]:
    return llm.transcribe(
        [(a, SR) for a in clips], language="en", word_timestamps=True, use_tqdm=False
    )


def test_transcribe_words_match_transformers(
    llm: LLM,
    clips: list[np.ndarray],
    transcribed: list[Any],
    reference: list[tuple[list[int], list[float]]],
) -> None:
    """Each word spans its first token's start to its last token's end; transformers' times
    of those tokens (mapped through the same words) agree within 0.1 s."""
    tokenizer = llm.get_tokenizer()
    eos = tokenizer.eos_token_id
    for name, audio, result, (ref_ids, ref_times) in zip(
        CLIPS, clips, transcribed, reference, strict=False
    ):
        text = _text_ids(ref_ids, eos)
        assert result.words is not None and result.segments[0].words == result.words
        assert "".join(w.word for w in result.words) == result.text, name
        groups = split_words(text, tokenizer.decode, "en", eos)
        assert [w.word for w in result.words] == [word for word, _ in groups]
        for word, (_, indices) in zip(result.words, groups, strict=True):
            assert 0.0 <= word.start <= word.end <= len(audio) / SR
            first, last = indices[0], indices[-1]
            if last >= 1:
                assert abs(word.end - ref_times[last]) <= TOLERANCE, (name, word)
            if first >= 2:
                assert abs(word.start - ref_times[first - 1]) <= TOLERANCE, (name, word)


@pytest.mark.parametrize(
    ("text", "language"),
    [
        (' He said: "Hello (world)," and left... Didn\'t he? ¿Qué? - yes!', "en"),
        (" Mr. Quilter's manner, 2.5 times (roughly) better.", "en"),
        ("我们今天去公园。你好吗？", "zh"),
        ("こんにちは、世界！", "ja"),
    ],
)
def test_word_splitting_matches_transformers(text: str, language: str) -> None:
    from transformers import WhisperTokenizer
    from transformers.models.whisper.tokenization_whisper import _combine_tokens_into_words

    tokenizer = WhisperTokenizer.from_pretrained(str(WHISPER_BASE))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    names = {"en": "english", "zh": "chinese", "ja": "japanese"}
    words, _, indices = _combine_tokens_into_words(tokenizer, ids, names[language])
    ours = split_words(ids, tokenizer.decode, language, tokenizer.eos_token_id)
    assert ours == list(zip(words, indices, strict=True))


def test_long_form_words_are_on_the_file_clock(
    llm: LLM, clips: list[np.ndarray], transcribed: list[Any]
) -> None:
    """JFK, LibriSpeech 1, JFK, LibriSpeech 0 back to back (32 s): the first window ends
    inside the last clip, so its words come from a second window that starts later; every
    word is in time order, and the last clip's words sit where that clip was placed (its
    short-form times plus its offset)."""
    jfk, short1, short0 = clips
    alone = transcribed[2]
    audio = np.concatenate([jfk, short1, jfk, short0])
    offset = (2 * len(jfk) + len(short1)) / SR
    (result,) = llm.transcribe((audio, SR), language="en", word_timestamps=True, use_tqdm=False)
    words = result.words
    assert words and "".join(w.word for w in words) == result.text
    times = [t for w in words for t in (w.start, w.end)]
    assert times == sorted(times) and times[-1] <= len(audio) / SR
    assert len({s.seek for s in result.segments}) >= 2  # more than one window
    last_window = [s for s in result.segments if s.seek == result.segments[-1].seek]
    assert last_window[0].seek > 0
    for segment in result.segments:
        assert "".join(w.word for w in segment.words or []) == segment.text
    tail = words[-len(alone.words) :]
    assert [w.word.lower() for w in tail] == [w.word.lower() for w in alone.words]
    for ours, ref in zip(tail[1:], alone.words[1:], strict=True):
        assert abs(ours.end - (ref.end + offset)) <= 0.3, (ours, ref)


def test_preempted_requests_keep_their_times(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A tiny random Whisper (alignment heads in its 2 decoder layers), pipelined steps, a KV
    cache that cannot hold all three requests to the end: the preempted ones run their encoder
    again on resume and still report the times an unpreempted run reports."""
    import json

    from tests.utils import make_tiny_whisper_dir

    path = make_tiny_whisper_dir(tmp_path_factory.mktemp("tiny_whisper_words"))
    config_file = Path(path) / "generation_config.json"
    config = json.loads(config_file.read_text())
    config["alignment_heads"] = [[0, 1], [1, 0], [1, 3]]
    config_file.write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    prompts = [
        {
            "prompt": "",
            "multi_modal_data": {"audio": (rng.uniform(-0.3, 0.3, n).astype(np.float32), SR)},
        }
        for n in (8_000, 16_000, 24_000)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, word_timestamps=True)

    def run(**kwargs: object) -> tuple[list[Any], dict[str, Any]]:
        with LLM(path, device="cpu", multiprocess=False, async_scheduling=True, **kwargs) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            return outputs, llm.llm_engine.get_stats()

    roomy, _ = run()
    # max_num_seqs explicit: an auto value would be lowered to what the tight cache holds.
    tight, stats = run(num_kv_blocks=3 * 94 + 4, max_num_seqs=8)
    assert stats["num_preemptions"] > 0 and stats["num_used_blocks"] == 0
    for a, b in zip(roomy, tight, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        times = a.extras["token_times"]
        assert len(times) == sum(t < config["eos_token_id"] for t in a.outputs[0].token_ids) + 1
        assert b.extras["token_times"] == times
