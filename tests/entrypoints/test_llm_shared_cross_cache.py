"""One cross-attention cache per encoder input: n>1 children, the beams of a beam search and
requests repeating the same audio attach to one set of cross blocks and one encoder run (tiny
random Whisper through `LLM`); every block is free at the end, the entry kept as evictable
cache."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from tests.utils import ONE_TORCH_THREAD, WHISPER_BASE, make_tiny_whisper_dir
from v1 import LLM, BeamSearchParams, SamplingParams
from v1.kv_cache.capacity import cdiv
from v1.kv_cache.single_type import CrossAttentionManager

pytestmark = [
    pytest.mark.skipif(
        not WHISPER_BASE.is_dir(), reason=f"needs the real whisper-base folder at {WHISPER_BASE}"
    ),
    ONE_TORCH_THREAD,
]
SR = 16_000
BLOCK_SIZE = 16
ENCODER_LEN = 1500


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_whisper_dir(tmp_path_factory.mktemp("tiny_whisper"))


@pytest.fixture
def llm(whisper_dir: str) -> Iterator[LLM]:
    llm = LLM(
        whisper_dir,
        device="cpu",
        multiprocess=False,
        block_size=BLOCK_SIZE,
        num_kv_blocks=1024,
    )
    yield llm
    llm.shutdown()


def audio_prompt(seed: int = 0) -> dict:
    wave = np.random.default_rng(seed).standard_normal(SR * 3).astype(np.float32) * 0.1
    return {"prompt": "", "multi_modal_data": {"audio": (wave, SR)}}


class CrossCacheProbe:
    """Watches the in-process core: the most cross blocks and cross entries held at once."""

    def __init__(self, llm: LLM) -> None:
        self.core = llm.llm_engine.engine_core.engine_core
        kv = self.core.scheduler.kv_cache_manager
        self.kv = kv
        (self.cross,) = [m for m in kv.managers if isinstance(m, CrossAttentionManager)]
        self.max_cross_blocks = 0
        self.max_entries = 0
        step = self.core.step

        def watched_step():  # noqa: ANN202 - wraps EngineCore.step as is
            out = step()
            held = {b.block_id for blocks in self.cross.req_to_blocks.values() for b in blocks}
            self.max_cross_blocks = max(self.max_cross_blocks, len(held))
            self.max_entries = max(self.max_entries, len(self.cross.live))
            return out

        self.core.step = watched_step

    def stats(self) -> dict:
        return self.core.get_stats()

    def assert_all_free(self) -> None:
        stats = self.stats()
        assert stats["num_kv_requests"] == 0 and stats["num_requests"] == 0
        assert self.kv.num_free_blocks == self.kv.num_total_blocks
        # The freed entry stays findable (evictable cache): one entry's worth of blocks.
        cached = [k for k in self.kv.block_pool.cached_block_hash_to_block if k[0] == 1]
        assert len(cached) == cdiv(ENCODER_LEN, BLOCK_SIZE)


def test_children_beams_and_repeats_share_one_cross_cache(llm: LLM) -> None:
    one_entry = cdiv(ENCODER_LEN, BLOCK_SIZE)
    probe = CrossCacheProbe(llm)

    # n=4 children.
    (out,) = llm.generate(
        audio_prompt(), SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=6)
    )
    assert len(out.outputs) == 4
    stats = probe.stats()
    assert stats["num_encoder_runs"] == 1 and stats["num_cross_cache_hits"] == 3
    assert probe.max_entries == 1 and probe.max_cross_blocks == one_entry
    probe.assert_all_free()

    # A 4-beam search over another clip: every step's beams read one entry.
    (result,) = llm.beam_search(audio_prompt(1), BeamSearchParams(beam_width=4, max_tokens=6))
    assert len(result.sequences) == 4
    stats = probe.stats()
    assert stats["num_encoder_runs"] == 2
    assert probe.max_entries == 1 and probe.max_cross_blocks == one_entry
    probe.kv.reset_prefix_cache()

    # 8 requests with the same (third) audio.
    outputs = llm.generate([audio_prompt(2)] * 8, SamplingParams(temperature=0, max_tokens=6))
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == 1
    assert probe.stats()["num_encoder_runs"] == 3
    assert probe.max_entries == 1 and probe.max_cross_blocks == one_entry
    probe.assert_all_free()


def test_preempted_and_aborted_readers_keep_counts_exact(whisper_dir: str) -> None:
    """A cache too small for every reader's self-attention: readers get preempted and resumed
    (attaching again), and an abort mid-run; nothing leaks and the encoder runs once."""
    path = whisper_dir
    one_entry = cdiv(ENCODER_LEN, BLOCK_SIZE)
    with LLM(
        path,
        device="cpu",
        multiprocess=False,
        block_size=BLOCK_SIZE,
        num_kv_blocks=one_entry + 8,
        max_model_len=64,
        max_num_seqs=16,  # explicit: an auto value is lowered to what the cache holds
    ) as llm:
        probe = CrossCacheProbe(llm)
        engine = llm.llm_engine
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        for i in range(4):
            engine.add_request(f"r{i}", audio_prompt(), params)
        engine.step()
        engine.step()
        engine.abort_request(["r3"])
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                finished[out.request_id] = out
        assert sorted(finished) == ["r0", "r1", "r2"]
        assert all(len(o.outputs[0].token_ids) == 40 for o in finished.values())
        stats = probe.stats()
        assert stats["num_preemptions"] > 0
        assert stats["num_encoder_runs"] == 1 and probe.max_entries == 1
        probe.assert_all_free()
