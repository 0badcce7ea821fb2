"""GPU end to end: CUDA graphs replay mixed steps (first steps of short prompts beside decodes,
small prefill chunks, recompute after preemption) with transformers' greedy tokens, graphs on
and off: Whisper (no decoder step of a <= 16-token prompt runs eagerly, first steps included),
BART with multi-token decoder prompts, Llama with chunked prefill.

Marked `gpu`; skipped without CUDA. fp32 with IEEE dots so greedy ties cannot flip.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from worker_factories import (
    EOS,
    bart_inputs,
    decoder_request,
    drain,
    llama_prompts,
    make_core,
    make_tiny_bart_dir,
    max_tokens_of,
    runner_of,
)

from tests.utils import ASSETS, make_tiny_llama_dir, needs_assets

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DEVICE = "cuda"
EAGER = pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda_graphs"])


def until_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def record_replays(graphs: Any) -> list[tuple[int, ...]]:
    """Wraps the manager's `run`: the query lengths of every replayed step, in order."""
    replays: list[tuple[int, ...]] = []
    run = graphs.run

    def recording_run(step: Any) -> torch.Tensor:
        replays.append(tuple(int(n) for n in step.num_scheduled))
        return run(step)

    graphs.run = recording_run
    return replays


def run_engine(path: str, requests: list[Any], enforce_eager: bool, **overrides: Any):
    """(request id -> tokens, the graph manager or None, query lengths of replayed steps)."""
    core = make_core(path, device=DEVICE, enforce_eager=enforce_eager, **overrides)
    try:
        graphs = runner_of(core).cuda_graphs
        assert (graphs is None) == enforce_eager
        replays = [] if graphs is None else record_replays(graphs)
        tokens = drain(core, requests)
        assert graphs is None or graphs.num_replays == len(replays)
        return tokens, graphs, replays
    finally:
        core.shutdown()


def mixes_first_steps_with_decodes(replays: list[tuple[int, ...]]) -> bool:
    return any(max(q) > 1 and min(q) == 1 for q in replays)


@EAGER
def test_llama_chunks_and_first_steps_replay(tmp_path, enforce_eager: bool) -> None:
    from transformers import AutoModelForCausalLM

    path = make_tiny_llama_dir(tmp_path)
    prompts = llama_prompts(10)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()
    expected = []
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt], device=DEVICE)
        out = model.generate(ids, max_new_tokens=max_tokens_of(i), do_sample=False)
        expected.append(until_eos(out[0, len(prompt) :].tolist(), EOS))
    requests = [decoder_request(i, p) for i, p in enumerate(prompts)]
    # Budget 16: every step fits a graph (prompts chunked to <= 16 tokens), few blocks: recompute.
    tokens, graphs, replays = run_engine(
        path,
        requests,
        enforce_eager,
        num_kv_blocks=8,
        max_model_len=112,  # the longest request the crowded cache holds
        max_num_seqs=4,
        max_num_batched_tokens=16,
    )
    assert [tokens[r.request_id] for r in requests] == expected
    if graphs is not None:
        assert graphs.num_eager_steps == 0 and graphs.num_mixed_replays > 0
        assert mixes_first_steps_with_decodes(replays)


@EAGER
def test_bart_multi_token_decoder_prompts_replay(tmp_path, enforce_eager: bool) -> None:
    from transformers import BartForConditionalGeneration

    path = make_tiny_bart_dir(tmp_path)
    inputs = bart_inputs(9)
    model = BartForConditionalGeneration.from_pretrained(path).to(DEVICE).eval()
    expected = []
    for i, (encoder, decoder) in enumerate(inputs):
        out = model.generate(
            torch.tensor([encoder], device=DEVICE),
            decoder_input_ids=torch.tensor([decoder], device=DEVICE),
            max_new_tokens=max_tokens_of(i),
            do_sample=False,
        )
        expected.append(until_eos(out[0, len(decoder) :].tolist(), EOS))
    requests = [decoder_request(i, dec, enc) for i, (enc, dec) in enumerate(inputs)]
    tokens, graphs, replays = run_engine(
        path,
        requests,
        enforce_eager,
        num_kv_blocks=9,
        max_model_len=64,  # one longest request (4 + 4 blocks) fits the crowded cache
        max_encoder_input_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=16,
    )
    assert [tokens[r.request_id] for r in requests] == expected
    if graphs is not None:
        assert graphs.num_eager_steps == 0 and graphs.num_mixed_replays > 0
        assert mixes_first_steps_with_decodes(replays)


WINDOW = 1500


@needs_assets(ASSETS / "whisper-base")
def test_whisper_first_steps_replay(tmp_path) -> None:
    """Graphs on and off in one test: graphed tokens must equal the eager ones exactly, and
    both transformers' (on CPU: if only that fails, look upstream of the graphs, e.g. the GPU
    log-mel features)."""
    from tests.models.test_whisper import hf_generate, make_tiny_whisper_dir, make_waves
    from v1.config import make_engine_config
    from v1.engine.inputs.whisper import WhisperInputBuilder
    from v1.sampling_params import SamplingParams
    from v1.tokenizer import get_tokenizer

    path = make_tiny_whisper_dir(tmp_path / "whisper")
    waves = make_waves(8, seed=5)
    # <|startoftranscript|><|en|><|transcribe|><|notimestamps|>
    prompt = [50258, 50259, 50359, 50363]
    overrides = dict(
        num_kv_blocks=2048,
        max_num_seqs=4,
        # Two audio windows a step: new requests join while others decode.
        max_num_encoder_input_tokens=2 * WINDOW,
        encoder_cache_size=8 * WINDOW,
    )
    model_config = make_engine_config(path, device=DEVICE, **overrides).model_config
    builder = WhisperInputBuilder(model_config, get_tokenizer(model_config))
    requests = []
    for i, wave in enumerate(waves):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens_of(i))
        inputs = {"language": "en", "multi_modal_data": {"audio": (wave, 16_000)}}
        requests.append(builder.build(f"r{i}", inputs, params))
    assert requests[0].prompt_token_ids == prompt
    eager, _, _ = run_engine(path, requests, True, **overrides)
    graphed, graphs, replays = run_engine(path, requests, False, **overrides)

    # Every decoder step replayed, first steps (4-token prompts) beside decodes included.
    assert graphs.num_eager_steps == 0
    assert sum(4 in q for q in replays) >= len(requests) // 2
    assert mixes_first_steps_with_decodes(replays)
    assert graphed == eager
    hf = hf_generate(path, waves, prompt, max(map(max_tokens_of, range(8))), timestamps=False)
    for i, (theirs, _) in enumerate(hf):
        assert eager[f"r{i}"] == theirs[: max_tokens_of(i)], f"request {i}"
    assert len({tuple(t) for t in eager.values()}) > 1, "outputs ignore the audio"
