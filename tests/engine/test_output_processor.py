"""OutputProcessor with hand-made EngineCoreOutputs: text, logprobs, n>1 merge, deltas, stops."""

from __future__ import annotations

import math

import numpy as np
import pytest

from v1.core.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason
from v1.engine.output_processor import LazySampleLogprobs, OutputProcessor, ParentRequest
from v1.outputs import Logprob, PoolingRequestOutput, RequestOutputKind
from v1.pooling_params import PoolingParams
from v1.sampling_params import SamplingParams

PROMPT = [1, 40, 41]


@pytest.fixture
def processor(tiny_tokenizer) -> OutputProcessor:
    return OutputProcessor(tiny_tokenizer)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def add(
    processor: OutputProcessor,
    req_id: str,
    params: SamplingParams | None = None,
    kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
    parent: ParentRequest | None = None,
    index: int = 0,
) -> None:
    request = EngineCoreRequest(
        request_id=req_id, prompt_token_ids=PROMPT, sampling_params=params or SamplingParams()
    )
    processor.add_request(request, "prompt text", parent, index, output_kind=kind)


def out(req_id: str, ids: list[int], finish: FinishReason | None = None, **kw) -> EngineCoreOutput:
    return EngineCoreOutput(req_id, ids, finish_reason=finish, **kw)


def test_final_only_reports_once_with_the_full_text(processor, tiny_tokenizer) -> None:
    ids = _ids(tiny_tokenizer, "hello world")
    add(processor, "a")
    results, aborts = processor.process_outputs([out("a", ids[:2])])
    assert results == [] and aborts == []
    results, _ = processor.process_outputs([out("a", ids[2:], FinishReason.LENGTH)])
    (res,) = results
    assert res.request_id == "a" and res.finished and res.prompt == "prompt text"
    assert res.prompt_token_ids == PROMPT
    (c,) = res.outputs
    assert (c.text, c.token_ids, c.finish_reason, c.stop_reason) == (
        "hello world",
        ids,
        "length",
        None,
    )
    assert c.logprobs is None and c.cumulative_logprob is None
    assert not processor.has_unfinished_requests()


def test_eos_and_stop_token_ids(processor, tiny_tokenizer) -> None:
    ids = _ids(tiny_tokenizer, "hello world")
    add(processor, "eos")
    add(processor, "stop_id")
    results, _ = processor.process_outputs(
        [
            out("eos", [*ids, 2], FinishReason.STOP),
            out("stop_id", ids, FinishReason.STOP, stop_reason=ids[-1]),
        ]
    )
    eos, stop_id = (r.outputs[0] for r in results)
    assert eos.text == "hello world" and eos.token_ids == [*ids, 2] and eos.stop_reason is None
    # The stop token stays in token_ids; its text is left out (include_stop_str_in_output=False).
    assert stop_id.token_ids == ids and stop_id.stop_reason == ids[-1]
    assert stop_id.text == tiny_tokenizer.decode(ids[:-1])


def test_logprobs_become_dicts_with_ranks_and_text(processor) -> None:
    add(processor, "a", SamplingParams(logprobs=2))
    results, _ = processor.process_outputs(
        [
            out(
                "a",
                [50, 60],
                FinishReason.LENGTH,
                # per token: [sampled, top-1, top-2]
                new_logprob_token_ids=[[50, 50, 51], [60, 61, 62]],
                new_logprobs=[[-0.1, -0.1, -2.5], [-3.0, -0.5, -1.0]],
                new_logprob_ranks=[1, 7],
            )
        ]
    )
    (c,) = results[0].outputs
    first, second = c.logprobs
    assert list(first) == [50, 51] and first[50].rank == 1 and first[51].rank == 2
    assert list(second) == [60, 61, 62]
    assert (second[60].rank, second[61].rank, second[62].rank) == (7, 1, 2)
    assert second[61].logprob == -0.5
    assert first[50].decoded_token == processor.tokenizer.decode([50])
    assert math.isclose(c.cumulative_logprob, -3.1)


def test_stop_string_finishes_and_asks_for_abort(processor, tiny_tokenizer) -> None:
    add(processor, "a", SamplingParams(stop=["lo w"]))
    ids = _ids(tiny_tokenizer, "hello world")
    results, aborts = processor.process_outputs([out("a", ids)])
    assert aborts == ["a"]
    (c,) = results[0].outputs
    assert (c.text, c.finish_reason, c.stop_reason) == ("hel", "stop", "lo w")
    # The core may still send a token for it before the abort lands: ignored.
    assert processor.process_outputs([out("a", [40])]) == ([], [])


def test_error_output_surfaces_as_finish_reason_error(processor) -> None:
    add(processor, "a")
    results, _ = processor.process_outputs(
        [out("a", [], FinishReason.ERROR, error="prompt too long")]
    )
    (res,) = results
    assert res.error == "prompt too long" and res.outputs[0].finish_reason == "error"


def test_delta_outputs_add_up_to_the_final_output(processor, tiny_tokenizer) -> None:
    ids = _ids(tiny_tokenizer, "The quick brown fox jumps")
    add(processor, "d", SamplingParams(logprobs=0), RequestOutputKind.DELTA)
    add(processor, "c", SamplingParams(logprobs=0), RequestOutputKind.CUMULATIVE)
    texts, tokens, logprobs = [], [], []
    for i, t in enumerate(ids):
        finish = FinishReason.LENGTH if i == len(ids) - 1 else None
        lp = {"new_logprob_token_ids": [[t]], "new_logprobs": [[-1.0]], "new_logprob_ranks": [3]}
        results, _ = processor.process_outputs(
            [out("d", [t], finish, **lp), out("c", [t], finish, **lp)]
        )
        delta, cumulative = results
        assert delta.finished == cumulative.finished == (finish is not None)
        texts.append(delta.outputs[0].text)
        tokens += delta.outputs[0].token_ids
        logprobs += delta.outputs[0].logprobs
        assert len(delta.outputs[0].token_ids) == 1
        assert cumulative.outputs[0].token_ids == ids[: i + 1]
        assert cumulative.outputs[0].text == "".join(texts)
    assert "".join(texts) == "The quick brown fox jumps" and tokens == ids
    assert [list(d) for d in logprobs] == [[t] for t in ids]


def test_n_children_merge_into_one_output(processor) -> None:
    params = SamplingParams(n=3, seed=7, max_tokens=4)
    parent = ParentRequest("p", params)
    assert parent.child_ids == ["0_p", "1_p", "2_p"]
    assert [parent.child_params(i).seed for i in range(3)] == [7, 8, 9]
    assert all(parent.child_params(i).n == 1 for i in range(3))
    for i, child in enumerate(parent.child_ids):
        add(processor, child, parent.child_params(i), parent=parent, index=i)
    assert processor.get_num_unfinished_requests() == 1
    results, _ = processor.process_outputs(
        [out("2_p", [40, 41], FinishReason.LENGTH), out("0_p", [42], None)]
    )
    assert results == []  # final-only: nothing until every child is done
    results, _ = processor.process_outputs(
        [out("1_p", [43], FinishReason.STOP), out("0_p", [44], FinishReason.LENGTH)]
    )
    (res,) = results
    assert res.request_id == "p" and res.finished
    assert [c.index for c in res.outputs] == [0, 1, 2]
    assert [c.token_ids for c in res.outputs] == [[42, 44], [43], [40, 41]]
    assert [c.finish_reason for c in res.outputs] == ["length", "stop", "length"]
    assert not processor.has_unfinished_requests() and not processor.parent_requests


def test_n_children_stream_deltas_per_child(processor) -> None:
    parent = ParentRequest("p", SamplingParams(n=2))
    for i, child in enumerate(parent.child_ids):
        add(processor, child, parent.child_params(i), RequestOutputKind.DELTA, parent, i)
    results, _ = processor.process_outputs(
        [out("0_p", [40]), out("1_p", [41], FinishReason.LENGTH)]
    )
    assert [(r.request_id, r.outputs[0].index, r.finished) for r in results] == [
        ("p", 0, False),
        ("p", 1, False),
    ]
    results, _ = processor.process_outputs([out("0_p", [42], FinishReason.LENGTH)])
    assert [(r.outputs[0].index, r.outputs[0].token_ids, r.finished) for r in results] == [
        (0, [42], True)
    ]


def test_abort_parent_aborts_its_children(processor) -> None:
    parent = ParentRequest("p", SamplingParams(n=2))
    for i, child in enumerate(parent.child_ids):
        add(processor, child, parent.child_params(i), parent=parent, index=i)
    add(processor, "solo")
    assert sorted(processor.abort_requests(["p", "solo", "unknown"])) == ["0_p", "1_p", "solo"]
    assert not processor.has_unfinished_requests()
    assert processor.process_outputs([out("0_p", [1], FinishReason.LENGTH)]) == ([], [])
    # Children aborted one by one: the parent goes with the last of them.
    parent = ParentRequest("q", SamplingParams(n=2))
    for i, child in enumerate(parent.child_ids):
        add(processor, child, parent.child_params(i), parent=parent, index=i)
    assert processor.abort_requests(["0_q"]) == ["0_q"] and "q" in processor.parent_requests
    assert processor.abort_requests(["1_q"]) == ["1_q"] and not processor.parent_requests


def test_duplicate_request_id_rejected(processor) -> None:
    add(processor, "a")
    with pytest.raises(ValueError, match="already in use"):
        add(processor, "a")


def test_pooling_output(processor) -> None:
    request = EngineCoreRequest(
        request_id="e", prompt_token_ids=[2, 5, 3], pooling_params=PoolingParams()
    )
    processor.add_request(request, "text")
    vector = np.array([0.5, -1.25, 3.0], dtype=np.float32)
    results, _ = processor.process_outputs([out("e", [], FinishReason.STOP, pooled_output=vector)])
    (res,) = results
    assert isinstance(res, PoolingRequestOutput) and res.finished and res.error is None
    assert res.prompt_token_ids == [2, 5, 3]
    assert res.prompt_token_ids is request.prompt_token_ids  # shared, not copied per request
    np.testing.assert_array_equal(res.outputs.data, vector)


def test_generation_output_copies_the_prompt_ids(processor, tiny_tokenizer) -> None:
    ids = _ids(tiny_tokenizer, "hello")
    request = EngineCoreRequest(
        request_id="g", prompt_token_ids=ids, sampling_params=SamplingParams(max_tokens=1)
    )
    processor.add_request(request, "hello")
    state = processor.request_states["g"]
    assert state.prompt_token_ids == ids and state.prompt_token_ids is not ids


def _logprob_steps(num_logprobs: int) -> list[EngineCoreOutput]:
    """Outputs of one request over several steps: one token, none (a prompt chunk), two."""
    steps = []
    for step, tokens in enumerate([[50], [], [60, 61], [70], [80]]):
        ids = [[t, *(t + 1 + k for k in range(num_logprobs))] for t in tokens]
        ids = [[row[0], row[0], *row[2:]] if step == 3 else row for row in ids]  # sampled = top-1
        steps.append(
            out(
                "a",
                tokens,
                FinishReason.LENGTH if step == 4 else None,
                new_logprob_token_ids=ids,
                new_logprobs=[[-0.1 * (step + 1) - 0.01 * k for k in range(len(r))] for r in ids],
                new_logprob_ranks=[step + 1 for _ in tokens],
            )
        )
    return steps


def _eager_logprobs(processor: OutputProcessor, steps: list[EngineCoreOutput]) -> list[dict]:
    """The entries built token by token as each output arrives (the reference)."""
    entries = []
    for o in steps:
        rows = zip(o.new_logprob_token_ids, o.new_logprobs, o.new_logprob_ranks, strict=True)
        for ids, lps, rank in rows:
            entry = {ids[0]: Logprob(lps[0], rank, processor.tokenizer.decode([ids[0]]))}
            for k, (tid, lp) in enumerate(zip(ids[1:], lps[1:], strict=True), start=1):
                entry.setdefault(tid, Logprob(lp, k, processor.tokenizer.decode([tid])))
            entries.append(entry)
    return entries


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("num_logprobs", [0, 2])
@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_lazy_logprobs_equal_the_per_token_entries(processor, kind, num_logprobs, lazy) -> None:
    """Logprob entries are built only when an output reports them (or, with lazy_logprobs,
    when read); every kind reports the entries (and the float sum, bit for bit) that building
    them per token gives."""
    steps = _logprob_steps(num_logprobs)
    expected = _eager_logprobs(processor, steps)
    request = EngineCoreRequest(
        request_id="a",
        prompt_token_ids=PROMPT,
        sampling_params=SamplingParams(logprobs=num_logprobs),
    )
    processor.add_request(request, "prompt text", output_kind=kind, lazy_logprobs=lazy)
    reported, num_tokens, cumulative = [], 0, 0.0
    for o in steps:
        (result,) = processor.process_outputs([o])[0] or [None]
        num_tokens += len(o.new_token_ids)
        for lps in o.new_logprobs:
            cumulative += lps[0]  # token by token, in order
        if result is None:
            assert kind == RequestOutputKind.FINAL_ONLY and not o.finished
            continue
        (c,) = result.outputs
        assert isinstance(c.logprobs, LazySampleLogprobs if lazy else list)
        if lazy:
            sampled = [lps[0] for o in steps for lps in o.new_logprobs][:num_tokens]
            assert c.logprobs.sampled_logprobs() == sampled[num_tokens - len(c.logprobs) :]
            assert c.logprobs[1:] == list(c.logprobs)[1:]
            assert not c.logprobs or c.logprobs[-1] == list(c.logprobs)[-1]
        if kind == RequestOutputKind.DELTA:
            reported += c.logprobs
        else:
            reported = c.logprobs
            assert c.logprobs == expected[:num_tokens]
        assert c.cumulative_logprob == cumulative
    assert reported == expected
    assert [next(iter(e)) for e in reported] == [t for o in steps for t in o.new_token_ids]


def test_lazy_logprobs_of_n_children(processor) -> None:
    """FINAL_ONLY children keep their logprobs raw until the parent's merged output."""
    params = SamplingParams(n=2, logprobs=0)
    parent = ParentRequest("p", params)
    for i in range(2):
        add(processor, f"{i}_p", parent.child_params(i), parent=parent, index=i)
    steps = {
        i: [
            out(
                f"{i}_p",
                [40 + i],
                new_logprob_token_ids=[[40 + i]],
                new_logprobs=[[-1.0 - i]],
                new_logprob_ranks=[i + 1],
            )
        ]
        for i in range(2)
    }
    assert processor.process_outputs([steps[0][0], steps[1][0]]) == ([], [])
    results, _ = processor.process_outputs(
        [
            out(
                "0_p",
                [50],
                FinishReason.LENGTH,
                new_logprob_token_ids=[[50]],
                new_logprobs=[[-0.5]],
                new_logprob_ranks=[3],
            ),
            out(
                "1_p",
                [51],
                FinishReason.STOP,
                new_logprob_token_ids=[[51]],
                new_logprobs=[[-0.25]],
                new_logprob_ranks=[1],
            ),
        ]
    )
    (res,) = results
    first, second = res.outputs
    dec = processor.tokenizer.decode
    assert first.logprobs == [{40: Logprob(-1.0, 1, dec([40]))}, {50: Logprob(-0.5, 3, dec([50]))}]
    assert second.logprobs == [
        {41: Logprob(-2.0, 2, dec([41]))},
        {51: Logprob(-0.25, 1, dec([51]))},
    ]
    assert (first.cumulative_logprob, second.cumulative_logprob) == (-1.5, -2.25)


def test_window_collector_reads_lazy_logprobs_as_the_entries(tiny_tokenizer) -> None:
    """Transcription windows run with lazy_logprobs: their WindowOutput (tokens, per-token
    logprobs that avg_logprob and best_of ranking use) equals the one read from entries."""
    from v1.engine.transcription.windows import WindowCollector

    windows = []
    for lazy in (False, True):
        processor = OutputProcessor(tiny_tokenizer)
        parent = ParentRequest("w", SamplingParams(n=2, logprobs=0, temperature=0.4))
        for i in range(2):
            request = EngineCoreRequest(
                request_id=f"{i}_w", prompt_token_ids=PROMPT, sampling_params=parent.child_params(i)
            )
            processor.add_request(request, None, parent, i, lazy_logprobs=lazy)
        collector = WindowCollector("audio input 0")
        for step, finish in enumerate([None, None, FinishReason.STOP]):
            outputs = [
                out(
                    f"{i}_w",
                    [40 + step + i],
                    finish,
                    new_logprob_token_ids=[[40 + step + i]],
                    new_logprobs=[[-0.3 * (step + 1) - 0.7 * i]],
                    new_logprob_ranks=[1],
                )
                for i in range(2)
            ]
            for result in processor.process_outputs(outputs)[0]:
                collector.add(result)
        windows.append(collector.result())
    eager, lazy_window = windows
    assert lazy_window == eager
    assert eager.logprobs == [-0.3, -0.6, -0.8999999999999999]  # sample 0 ranks higher
