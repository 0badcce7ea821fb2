"""Fast by default: max_num_seqs and num_scheduler_steps left unset resolve once, in the config
layer, to what the tuned benchmark rows use where it is safe (docs/decisions.md): Whisper on a
GPU gets 512 sequences and decode bursts of 8 (auto bursts skip streamed requests, so the
server's streams still get every token), decoder-only and CPU keep 128; the engine core lowers
an auto max_num_seqs to what its KV cache holds. The GPU values give the same greedy
transcripts on CPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.core.fakes import make_request
from tests.utils import WHISPER_BASE, make_tiny_llama_dir, make_tiny_whisper_dir
from v1 import LLM, SamplingParams
from v1.config import EngineConfig, kv_bounded_max_num_seqs, make_engine_config
from v1.core.scheduler import Scheduler
from v1.kv_cache.sizing import get_kv_cache_config


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    if not WHISPER_BASE.is_dir():
        pytest.skip(f"needs {WHISPER_BASE}")
    return make_tiny_whisper_dir(tmp_path_factory.mktemp("whisper"))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("llama"))


def _steps(config: EngineConfig) -> tuple[int | None, int | None]:
    sc = config.scheduler_config
    return sc.max_num_seqs, sc.num_scheduler_steps


def test_offline_whisper_on_gpu_gets_the_tuned_values(whisper_dir: str) -> None:
    offline = make_engine_config(whisper_dir, device="cuda", offline=True)
    assert offline.cross_attention_mode == "absorbed"
    assert _steps(offline) == (512, 8)
    assert offline.auto_max_num_seqs
    server = make_engine_config(whisper_dir, device="cuda")
    assert _steps(server) == (512, 8) and server.auto_num_scheduler_steps
    per_layer = make_engine_config(
        whisper_dir, device="cuda", offline=True, cross_attention="per_layer"
    )
    assert _steps(per_layer) == (128, 8)


def test_whisper_on_gpu_encodes_up_to_twice_the_windows_a_step(whisper_dir: str) -> None:
    """The tuned rows' 32 windows a step offline on a GPU; the server is sized for 32 too but
    runs the model's 16 while few windows wait (a first token waits for its window's step); CPU
    keeps 16; an explicit budget wins everywhere."""
    windows = lambda budget, config: budget // config.model_config.max_encoder_len  # noqa: E731

    def budgets(config: EngineConfig) -> tuple[int, int]:
        return (
            windows(config.encoder_budget, config),
            windows(config.encoder_step_budget, config),
        )

    assert budgets(make_engine_config(whisper_dir, device="cuda", offline=True)) == (32, 32)
    assert budgets(make_engine_config(whisper_dir, device="cuda")) == (32, 16)
    assert budgets(make_engine_config(whisper_dir, device="cpu", offline=True)) == (16, 16)
    assert budgets(make_engine_config(whisper_dir, device="cpu")) == (16, 16)
    for offline in (True, False):
        explicit = make_engine_config(
            whisper_dir, device="cuda", offline=offline, max_num_encoder_input_tokens=1500 * 4
        )
        assert budgets(explicit) == (4, 4)


def test_server_widens_its_encoder_step_under_a_backlog(whisper_dir: str) -> None:
    """The server's scheduler encodes 16 windows a step while at most 16 wait and 32 while more
    do (those would wait a step each); the sizes the runner and cache get are the 32."""
    server = make_engine_config(whisper_dir, device="cuda")
    window = server.model_config.max_encoder_len
    assert server.encoder_cache_size == 2 * 32 * window

    def widths(config: EngineConfig, num_waiting: int) -> int:
        scheduler = Scheduler(config, get_kv_cache_config({}, num_blocks=1))
        for i in range(num_waiting):
            scheduler.waiting.add(make_request(f"r{i}", encoder_len=window))
        return scheduler._encoder_tokens() // window

    assert widths(server, 0) == 16 and widths(server, 16) == 16
    assert widths(server, 17) == 32 and widths(server, 300) == 32
    assert widths(make_engine_config(whisper_dir, device="cuda", offline=True), 1) == 32


def test_cpu_and_decoder_only_keep_small_values(whisper_dir: str, llama_dir: str) -> None:
    assert _steps(make_engine_config(whisper_dir, device="cpu", offline=True)) == (128, 1)
    assert _steps(make_engine_config(llama_dir, device="cuda", offline=True)) == (128, 8)
    assert _steps(make_engine_config(llama_dir, device="cuda")) == (128, 8)


def test_explicit_values_win_and_survive_the_process_boundary(whisper_dir: str) -> None:
    config = make_engine_config(
        whisper_dir, device="cuda", offline=True, max_num_seqs=64, num_scheduler_steps=2
    )
    assert _steps(config) == (64, 2) and not config.auto_max_num_seqs
    assert not config.auto_num_scheduler_steps
    assert kv_bounded_max_num_seqs(config, requests_that_fit=3) == 64  # the user's value stays
    auto = make_engine_config(whisper_dir, device="cuda", offline=True)
    again = EngineConfig.from_json(auto.to_json())
    assert _steps(again) == (512, 8) and again.auto_max_num_seqs and again.offline
    assert again.auto_num_scheduler_steps
    assert kv_bounded_max_num_seqs(again, requests_that_fit=300) == 300
    assert kv_bounded_max_num_seqs(again, requests_that_fit=0) == 1
    assert kv_bounded_max_num_seqs(again, requests_that_fit=9000) == 512
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        make_engine_config(whisper_dir, num_scheduler_steps=0)


def test_llm_defaults_and_kv_bound(whisper_dir: str) -> None:
    """LLM on CPU: the defaults are the old ones; an auto max_num_seqs is lowered to what a
    small KV cache holds (logged), an explicit one is not."""
    with LLM(whisper_dir, device="cpu", multiprocess=False, num_kv_blocks=240) as llm:
        assert llm.config.offline and _steps(llm.config) == (128, 1)
        core_config = llm.llm_engine.engine_core.engine_core.config
        # 239 usable blocks of 16; a request of 256 tokens + 1500 encoder positions needs 110
        assert core_config.scheduler_config.max_num_seqs == 2
    with LLM(whisper_dir, device="cpu", multiprocess=False, max_num_seqs=7) as llm:
        assert llm.llm_engine.engine_core.engine_core.config.scheduler_config.max_num_seqs == 7


def test_gpu_defaults_give_the_same_greedy_transcripts(whisper_dir: str) -> None:
    """The values auto picks on a GPU (512 sequences, bursts of 8) against the old defaults
    (128, one token per step), run on CPU: identical greedy transcripts."""
    rng = torch.Generator().manual_seed(3)
    clips = [(torch.randn(16000 * (1 + i), generator=rng).numpy() * 0.1, 16000) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12)
    texts = []
    for seqs, steps in ((128, 1), (512, 8)):
        with LLM(
            whisper_dir,
            device="cpu",
            multiprocess=False,
            async_scheduling=True,
            max_num_seqs=seqs,
            max_model_len=64,
            num_scheduler_steps=steps,
        ) as llm:
            outs = llm.transcribe(clips, params, language="en", temperature=0.0)
            texts.append([(o.text, [s.text for s in o.segments]) for o in outs])
    assert texts[0] == texts[1]
    assert any(text for text, _ in texts[0])
