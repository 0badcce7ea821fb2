"""The offline API: `LLM(model).generate(...)`, `.chat`, `.embed`, `.classify`, `.score`, `.rerank`,
`.transcribe`.

Invalid input raises ValueError naming the prompt and the engine keeps serving; results come
back in input order; a failed request makes the call raise `RequestFailedError` at the end.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm.auto import tqdm

from v1 import envs
from v1.config import EngineConfig, make_engine_config, pooling_pack_limits
from v1.core.queue_depth import PoolingQueueDepth
from v1.engine.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    beam_search_output,
    make_beam_search,
    run_beam_search,
)
from v1.engine.llm_engine import LLMEngine
from v1.entrypoints.request_feed import RequestFeed
from v1.gc_policy import deferred_full_collections, paused_collections
from v1.lora_request import LoRARequest
from v1.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    RerankResult,
    ScoringOutput,
    ScoringRequestOutput,
)
from v1.pooling_params import PoolingParams
from v1.sampling_params import SamplingParams

if TYPE_CHECKING:
    from v1.engine.transcription import Transcriber, TranscriptionResult, TranscriptionStream


class RequestFailedError(RuntimeError):
    """Some requests of a batch ended with an engine error; `outputs` holds every output in
    input order (failed ones have `error` set)."""

    def __init__(self, message: str, outputs: list[Any]) -> None:
        super().__init__(message)
        self.outputs = outputs


class LLM:
    """An engine for offline batches. Keyword arguments beyond the named ones go to
    `make_engine_config` (e.g. enable_prefix_caching, gpu_memory_utilization, hf_overrides)."""

    def __init__(
        self,
        model: str,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        seed: int = 0,
        trust_remote_code: bool = False,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        multiprocess: bool | None = None,
        **engine_kwargs: Any,
    ) -> None:
        optional = {
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "num_kv_blocks": num_kv_blocks,
            "kv_cache_memory_bytes": kv_cache_memory_bytes,
            "max_model_len": max_model_len,
            "tokenizer": tokenizer,
        }
        config = make_engine_config(
            model,
            dtype=dtype,
            device=device,
            block_size=block_size,
            seed=seed,
            trust_remote_code=trust_remote_code,
            enforce_eager=enforce_eager,
            offline=True,  # auto num_scheduler_steps: bursts (nothing streams per token)
            **{k: v for k, v in optional.items() if v is not None},
            **engine_kwargs,
        )
        if multiprocess is None:
            multiprocess = envs.V1_MULTIPROCESSING
        self.config: EngineConfig = config
        self.model_info = config.model_config.info
        """What the model can do (`supported_tasks`); shared with the engine."""
        self.llm_engine = LLMEngine(config, multiprocess=multiprocess)
        self._counter = itertools.count()
        self.transcriber: Transcriber | None = None
        """Whisper models: the one transcriber of this engine (`transcribe`)."""
        if "transcription" in self.model_info.supported_tasks:
            from v1.engine.transcription import Transcriber

            self.transcriber = Transcriber(self.llm_engine)

    # ---- generation ----
    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Completions of one prompt or a list of prompts (str, TokensPrompt, TextPrompt or
        {"encoder_prompt", "decoder_prompt"}), in input order. `sampling_params`: one for all
        or one per prompt (default SamplingParams()). `lora_request`: the LoRA adapter of every
        prompt, or one per prompt (None: the base model)."""
        if "generate" not in self.model_info.supported_tasks:
            raise ValueError(
                f"{self.config.model_config.architecture} is an encoder-only model: use embed, "
                f"classify or score instead of generate"
            )
        prompts = _as_list(prompts)
        params = _per_prompt(
            sampling_params, len(prompts), SamplingParams, SamplingParams, "sampling_params"
        )
        loras = _per_prompt_loras(lora_request, len(prompts))
        return self._run(prompts, params, use_tqdm, priority, loras)

    def chat(
        self,
        messages: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Replies to one conversation (a list of {"role", "content"} messages) or a list of
        conversations, in input order, as vLLM's `LLM.chat`: each is rendered with the
        tokenizer's chat template (or `chat_template`, Jinja text or a file) and generated
        from. `add_generation_prompt` opens the assistant's turn; `continue_final_message`
        instead continues the last message; `chat_template_kwargs` reach the template."""
        from v1.entrypoints.chat_prompts import chat_prompt_ids, conversations, read_template

        if "generate" not in self.model_info.supported_tasks:
            raise ValueError(
                f"{self.config.model_config.architecture} is an encoder-only model: chat needs "
                f"a generating model"
            )
        convs = conversations(messages)
        template = read_template(chat_template)
        tokenizer = self.get_tokenizer()
        prompts = []
        for i, conv in enumerate(convs):
            try:
                ids = chat_prompt_ids(
                    tokenizer,
                    conv,
                    chat_template=template,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    chat_template_kwargs=chat_template_kwargs,
                )
            except ValueError as e:
                raise ValueError(f"conversation {i}: {e}" if len(convs) > 1 else str(e)) from e
            prompts.append({"prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(
        self,
        prompts: Any,
        params: BeamSearchParams,
        use_tqdm: bool = False,
        sampling_params: SamplingParams | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search for one prompt or a list (the prompt forms of `generate`), in input
        order: each output holds the best `params.num_return_sequences` finished beams, best
        first, scored and finished as transformers' `generate(num_beams=...)` does (the
        model's generation-config rules apply as in `generate`). Each beam forks its parent's
        decoder KV blocks in the engine (shared full blocks, the partial last block copied) and
        computes one token per step; for encoder-decoder models all beams read one
        cross-attention cache: the encoder runs once per distinct input. `sampling_params` adds rules to the greedy
        defaults (min_tokens, stop_token_ids, penalties, ...); its sampling knobs are unused.
        `lora_request`: the LoRA adapter of every prompt or one per prompt (every beam of a
        prompt runs with its adapter)."""
        if "generate" not in self.model_info.supported_tasks:
            raise ValueError(
                f"{self.config.model_config.architecture} is an encoder-only model: beam search "
                f"needs a generating model"
            )
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
        prompts = _as_list(prompts)
        loras = _per_prompt_loras(lora_request, len(prompts)) or [None] * len(prompts)
        engine = self.llm_engine
        searches = []
        for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
            try:
                searches.append(
                    make_beam_search(
                        engine, str(next(self._counter)), prompt, params, sampling_params, lora
                    )
                )
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}" if len(prompts) > 1 else str(e)) from e
        bar = tqdm(total=len(searches), desc="Beam search", disable=not use_tqdm)
        try:
            run_beam_search(searches, engine.run_core_requests, engine.abort_core_requests)
        finally:
            bar.update(len(searches))
            bar.close()
        return [beam_search_output(search, engine.tokenizer) for search in searches]

    # ---- pooling ----
    def embed(
        self,
        prompts: Any,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Embeddings (float32 lists) of one or more texts / TokensPrompts, in input order.
        `truncate_prompt_tokens=-1` truncates to the model's limit."""
        params = self._pooling_params(pooling_params, prompts, "embed", truncate_prompt_tokens)
        return self._run(
            _as_list(prompts), params, use_tqdm, None, convert=EmbeddingRequestOutput.from_base
        )

    def classify(
        self,
        prompts: Any,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities of a sequence classification model, in input order."""
        params = self._pooling_params(pooling_params, prompts, "classify", truncate_prompt_tokens)
        return self._run(
            _as_list(prompts), params, use_tqdm, None, convert=ClassificationRequestOutput.from_base
        )

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """Relevance of text pairs: one text_1 against each text_2, or pairwise for equal-length
        lists. Cross-encoders (sequence classification models) score each pair in one pass;
        embedding models return the cosine similarity of the two embeddings."""
        pairs = _score_pairs(text_1, text_2)
        if "classify" in self.model_info.supported_tasks:  # a cross-encoder
            prompts = [{"text": a, "text_pair": b} for a, b in pairs]
            params = self._pooling_params(None, prompts, "score", truncate_prompt_tokens)
            return self._run(
                prompts, params, use_tqdm, None, convert=ScoringRequestOutput.from_base
            )
        # Bi-encoder: embed every distinct text once, then cosine per pair.
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        embedded = self.embed(
            texts, use_tqdm=use_tqdm, truncate_prompt_tokens=truncate_prompt_tokens
        )
        by_text = dict(zip(texts, embedded, strict=True))
        results = []
        for a, b in pairs:
            ea, eb = by_text[a], by_text[b]
            u = np.asarray(ea.outputs.embedding, dtype=np.float32)
            v = np.asarray(eb.outputs.embedding, dtype=np.float32)
            cosine = float(np.dot(u, v)) / max(float(np.linalg.norm(u) * np.linalg.norm(v)), 1e-12)
            results.append(
                ScoringRequestOutput(
                    request_id=f"{ea.request_id}_{eb.request_id}",
                    outputs=ScoringOutput(cosine),
                    prompt_token_ids=ea.prompt_token_ids + eb.prompt_token_ids,
                    finished=True,
                )
            )
        return results

    def rerank(
        self,
        query: str,
        documents: Sequence[str],
        top_n: int | None = None,
        use_tqdm: bool = True,
    ) -> list[RerankResult]:
        """Documents ordered by relevance to `query` (best first), at most `top_n` of them."""
        if isinstance(documents, str) or not documents:
            raise ValueError("documents must be a non-empty list of strings")
        if top_n is not None and top_n < 1:
            raise ValueError(f"top_n must be >= 1, got {top_n}")
        scores = self.score(query, list(documents), use_tqdm=use_tqdm)
        results = [
            RerankResult(i, doc, s.outputs.score)
            for i, (doc, s) in enumerate(zip(documents, scores, strict=True))
        ]
        results.sort(key=lambda r: r.relevance_score, reverse=True)
        return results[:top_n] if top_n is not None else results

    # ---- speech ----
    def transcribe(
        self,
        audio: Any,
        sampling_params: SamplingParams | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
        stream: bool = False,
        **options: Any,
    ) -> list[TranscriptionResult] | TranscriptionStream:
        """Transcribes (or translates) audio with a Whisper model: one `TranscriptionResult`
        per input, in order. `stream=True` returns a `TranscriptionStream` instead: a lazy
        iterator of the segments, each as soon as its window is decoded (faster-whisper's
        `segments` generator; the engine runs only while it is iterated), whose `result` /
        `results` are what this returns otherwise.

        `audio`: a path, bytes, `(samples, sample_rate)` or a list of them. Long audio is
        decoded in 30 s windows, each starting where the last complete segment of the one
        before ended (openai-whisper's seek), prompted with the text so far, and decoded again
        hotter when it looks wrong; the windows of many files share the engine's steps.
        `options` (see `v1.engine.transcription.TranscriptionOptions`): language (default:
        detect), task ("transcribe" or "translate"), timestamps, prompt,
        condition_on_previous_text (True), temperature (fallback schedule; one number turns
        fallback off), compression_ratio_threshold (2.4), logprob_threshold (-1.0),
        no_speech_threshold (0.6), word_timestamps (False: True times every word from the
        cross-attention alignment heads, in `result.words` and each segment's `words`),
        beam_size (beam search at temperature 0, as transformers' num_beams), best_of (samples
        per window above temperature 0, the most likely kept), patience, length_penalty;
        and faster-whisper's: vad_filter and vad_parameters (Silero VAD; times stay on the
        recording's clock), batch_size (a file's VAD chunks decoded in parallel), clip_timestamps,
        hotwords, prefix, initial_prompt, hallucination_silence_threshold, multilingual,
        without_timestamps, max_initial_timestamp, suppress_tokens, suppress_blank,
        repetition_penalty, no_repeat_ngram_size. An unknown option is a ValueError. Results
        carry `language_probability`; words (word_timestamps, also with beam_size or best_of)
        carry `probability`. A progress bar (audio seconds, real-time factor) shows for
        batches and long audio unless `use_tqdm=False`. `lora_request`: the LoRA adapter every
        window runs with."""
        if self.transcriber is None:
            mc = self.config.model_config
            raise ValueError(f"transcribe() needs a Whisper model; {mc.model} is {mc.architecture}")
        run = self.transcriber.stream if stream else self.transcriber.transcribe
        return run(
            audio,
            use_tqdm=use_tqdm,
            sampling_params=sampling_params,
            lora_request=lora_request,
            **options,
        )

    # ---- misc ----
    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def shutdown(self) -> None:
        engine = self.__dict__.get("llm_engine")
        if engine is not None:
            engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown: nothing left to report to
            return

    # ---- internals ----
    def _pooling_params(
        self,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None,
        prompts: Any,
        task: str,
        truncate_prompt_tokens: int | None,
    ) -> list[PoolingParams]:
        mc = self.config.model_config
        if "embed" not in self.model_info.supported_tasks:
            raise ValueError(f"{mc.architecture} is a generative model: use generate, not {task}")
        count = len(_as_list(prompts))
        if pooling_params is None:
            pooling_params = PoolingParams(task=task)
        params = _per_prompt(pooling_params, count, PoolingParams, PoolingParams, "pooling_params")
        changes: dict[str, Any] = {}
        if truncate_prompt_tokens is not None:
            if truncate_prompt_tokens == -1:
                truncate_prompt_tokens = mc.max_encoder_len
            changes["truncate_prompt_tokens"] = truncate_prompt_tokens
        # One clone per distinct object: a batch sharing one params object (the default, or
        # one passed for all) shares its clone, as `generate` shares SamplingParams.
        clones: dict[int, PoolingParams] = {}
        for p in params:
            if id(p) not in clones:
                clones[id(p)] = p.clone(task=task, **changes)
        return [clones[id(p)] for p in params]

    def _run(
        self,
        prompts: list[Any],
        params: list[Any],
        use_tqdm: bool,
        priority: Sequence[int] | None,
        loras: list[LoRARequest | None] | None = None,
        convert: Callable[[Any], Any] | None = None,
    ) -> list[Any]:
        """Feeds the batch to the engine (see RequestFeed) and steps until done; outputs in input
        order. `convert` turns each successful output into the call's result type as it
        arrives, while later steps run on the device (not all at the end: 4096 embeddings'
        float lists cost ~70 ms of host time); failed outputs stay as they came."""
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts")
        engine = self.llm_engine
        req_ids = [str(next(self._counter)) for _ in prompts]
        items = list(zip(req_ids, prompts, params, priority or [0] * len(prompts), strict=True))
        pooling = isinstance(params[0], PoolingParams)
        if pooling:
            # Inputs of one task with a vector each, and no priorities to order them by, go to
            # the core packed: several to a core request (EngineCoreRequest.input_lens).
            packable = priority is None and all(p.task != "encode" for p in params)
            feed = RequestFeed(
                engine,
                items,
                pooling_depth=PoolingQueueDepth.of(self.config),
                pack=pooling_pack_limits(self.config) if packable else None,
            )
        else:
            # Requests enter a window at a time so that adding them overlaps the device's work
            # (pipelined steps); with priorities every request must compete at once.
            window = (
                len(prompts)
                if priority is not None
                else 2 * self.config.scheduler_config.max_num_seqs
            )
            feed = RequestFeed(engine, items, window=window, loras=loras)
        outputs = self._run_engine(
            set(req_ids), use_tqdm and len(prompts) > 1, feed, convert, pause_gc=pooling
        )
        ordered = [outputs[r] for r in req_ids]
        failed = [(i, o.error) for i, o in enumerate(ordered) if o.error is not None]
        if failed:
            details = "; ".join(f"prompt {i}: {err}" for i, err in failed)
            raise RequestFailedError(f"{len(failed)} request(s) failed: {details}", ordered)
        return ordered

    def _run_engine(
        self,
        req_ids: set[str],
        use_tqdm: bool,
        feed: RequestFeed,
        convert: Callable[[Any], Any] | None = None,
        *,
        pause_gc: bool = False,
    ) -> dict[str, Any]:
        """Steps until every request of `req_ids` has its final output. `pause_gc` (pooling
        batches): automatic cyclic collections paused, one young collection every
        PAUSED_COLLECTION_STEPS steps (`v1.gc_policy.paused_collections`)."""
        outputs: dict[str, RequestOutput | PoolingRequestOutput] = {}
        bar = tqdm(
            total=len(req_ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm
        )
        try:
            with deferred_full_collections(), _gc_pause(pause_gc) as tick:
                while len(outputs) < len(req_ids):
                    tick()
                    feed.top_up()
                    if not self.llm_engine.has_unfinished_requests():
                        missing = sorted(req_ids - outputs.keys())
                        raise RuntimeError(f"requests {missing} ended without an output")
                    for out in self.llm_engine.step():
                        if out.finished and out.request_id in req_ids:
                            # Packed embeddings come as EmbeddingRequestOutputs already.
                            if (
                                convert is not None
                                and out.error is None
                                and type(out) is PoolingRequestOutput
                            ):
                                out = convert(out)
                            outputs[out.request_id] = out
                            feed.finished(out.request_id)
                            bar.update(1)
        except BaseException:
            self.llm_engine.abort_request(sorted(feed.unfinished))
            raise
        finally:
            bar.close()
        return outputs


def _gc_pause(pause: bool) -> AbstractContextManager[Callable[[], None]]:
    """`paused_collections()` when `pause`, else a context yielding a tick that does nothing."""
    return paused_collections() if pause else nullcontext(_no_tick)


def _no_tick() -> None:
    return None


def _per_prompt_loras(lora_request: Any, num_prompts: int) -> list[LoRARequest | None] | None:
    """One LoRARequest (or None) per prompt from one for all or a list."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return None if lora_request is None else [lora_request] * num_prompts
    if not isinstance(lora_request, Sequence) or isinstance(lora_request, str):
        raise ValueError(f"lora_request must be a LoRARequest or a list, got {lora_request!r}")
    if len(lora_request) != num_prompts:
        raise ValueError(f"lora_request has {len(lora_request)} entries for {num_prompts} prompts")
    return list(lora_request)


def _as_list(prompts: Any) -> list[Any]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(p, int) for p in prompts):
        raise ValueError('pass token ids as {"prompt_token_ids": [...]}, not a bare list of ints')
    if not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a prompt or a non-empty list of prompts")
    return list(prompts)


def _per_prompt(
    params: Any, count: int, default: Callable[[], Any], kind: type, name: str
) -> list[Any]:
    """One params object per prompt: the default, one shared, or a list of `count`."""
    if params is None:
        return [default() for _ in range(count)]
    if isinstance(params, (SamplingParams, PoolingParams)):
        params = [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"{name} has {len(params)} entries for {count} prompts")
    for p in params:
        if not isinstance(p, kind):
            raise ValueError(f"{name} must be {kind.__name__}, got {type(p).__name__}")
    return params


def _score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    left = [text_1] if isinstance(text_1, str) else list(text_1)
    right = [text_2] if isinstance(text_2, str) else list(text_2)
    if not left or not right:
        raise ValueError("score needs at least one text on each side")
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise ValueError(
            f"score pairs text_1 and text_2 one to one: got {len(left)} and {len(right)} texts"
        )
    for text in left + right:
        if not isinstance(text, str):
            raise ValueError(f"score takes strings, got {type(text).__name__}")
    return list(zip(left, right, strict=True))
