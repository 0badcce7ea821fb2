"""EngineCore: owns the scheduler and the executor; one `step` = schedule -> execute -> update.

The in-process class below is what every client drives; the multiprocess wrapper (busy loop,
I/O threads, handshake) lives in `v1.core.engine_core_proc`.
"""

from __future__ import annotations

import dataclasses
import gc
from collections import deque
from typing import Any

from v1.config import TYPICAL_DECODER_TOKENS, EngineConfig, kv_bounded_max_num_seqs
from v1.core.admission import check_engine_capacity, check_request
from v1.core.encoder_inputs import EncoderInputStore, with_content_hash
from v1.core.errors import WorkerDeadError
from v1.core.executor import ExecutorFactory
from v1.core.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    now,
)
from v1.core.request import Request, RequestStatus
from v1.core.sched_output import SchedulerOutput
from v1.core.scheduler import Scheduler
from v1.core.step_trace import StepTrace
from v1.core.structured_output import StructuredOutputManager
from v1.kv_cache.capacity import num_blocks_needed, num_usable_blocks
from v1.kv_cache.sizing import get_kv_cache_config
from v1.logger import init_logger

logger = init_logger(__name__)


class EngineCore:
    UTILITY_METHODS = ("get_stats", "reset_prefix_cache", "is_healthy", "get_config_info")

    def __init__(
        self,
        config: EngineConfig,
        executor_factory: ExecutorFactory,
    ) -> None:
        """`executor_factory`: the Executor class (or a callable making one) to run the model,
        chosen above the core (v1.executor.executor_class, or a fake in tests)."""
        self.config = config
        self.model_info = config.model_config.info
        """The process's model facts (shared with an in-process frontend and the runner)."""
        self.executor = executor_factory(config)
        try:
            specs = self.executor.get_kv_cache_specs()
            num_blocks = config.cache_config.num_kv_blocks
            available = (
                None if num_blocks is not None else self.executor.determine_available_kv_bytes()
            )
            self.kv_cache_config = get_kv_cache_config(
                specs, available_bytes=available, num_blocks=num_blocks
            )
            check_engine_capacity(config, self.model_info, self.kv_cache_config)
            self.executor.initialize_kv_cache(self.kv_cache_config)
        except BaseException:
            self.executor.shutdown()  # its worker processes too
            raise
        config = self._bound_max_num_seqs(config)
        self.config = config
        self.scheduler = Scheduler(config, self.kv_cache_config)
        self.max_model_len = config.model_config.effective_max_model_len
        self._pending_outputs: list[EngineCoreOutput] = []
        self.encoder_inputs = EncoderInputStore()
        """Encoder payloads by content hash, for requests that send only the hash (beams)."""
        self._batch_queue: deque[tuple[SchedulerOutput, Any]] | None = (
            deque() if config.use_async_scheduling else None
        )
        """Launched steps not read back yet (pipelined scheduling), oldest first."""
        self.max_steps_in_flight = config.scheduler_config.max_steps_in_flight
        self._blocked_adds: list[EngineCoreRequest] = []
        """Requests whose id is in a launched step (see add_request)."""
        self._pooling_config = self._load_pooling_config()
        """Pooling limits checked at admission (None: generating model, or unreadable)."""
        self.structured_outputs = StructuredOutputManager(config.model_config)
        self._queue_times: dict[str, float] = {}
        """Seconds from arrival to the first scheduled step, until the first output carries it."""
        self._prompt_logprobs: dict[str, tuple[list[list[int]], list[list[float]]]] = {}
        """Prompt logprobs of requests whose first token is not out yet, by prompt position."""
        self._trace = StepTrace.from_env()
        gc.collect()
        gc.freeze()  # start-up objects live forever: keep them out of cyclic GC scans
        if not self.kv_cache_config.groups:
            logger.info("EngineCore ready: no KV cache (encoder-only)")
        else:
            logger.info(
                "EngineCore ready: %d KV blocks of %d tokens, %d KV groups",
                self.kv_cache_config.num_blocks,
                self.kv_cache_config.block_size,
                len(self.kv_cache_config.groups),
            )

    def _bound_max_num_seqs(self, config: EngineConfig) -> EngineConfig:
        """An auto max_num_seqs lowered to the requests of a typical length the KV cache holds
        (`kv_bounded_max_num_seqs`); the chosen value is logged."""
        sc = config.scheduler_config
        if not config.auto_max_num_seqs or not self.kv_cache_config.groups:
            return config
        mc = config.model_config
        tokens = min(TYPICAL_DECODER_TOKENS, mc.effective_max_model_len)
        encoder_tokens = mc.max_encoder_len if self.model_info.has_cross_attention else 0
        per_request = max(1, num_blocks_needed(self.kv_cache_config, tokens, encoder_tokens))
        fits = num_usable_blocks(self.kv_cache_config) // per_request
        chosen = kv_bounded_max_num_seqs(config, fits)
        logger.info(
            "max_num_seqs=%d (auto: up to %d; the KV cache holds %d requests of %d tokens%s)",
            chosen,
            sc.max_num_seqs,
            fits,
            tokens,
            f" + {encoder_tokens} encoder positions" if encoder_tokens else "",
        )
        if chosen == sc.max_num_seqs:
            return config
        return dataclasses.replace(
            config, scheduler_config=dataclasses.replace(sc, max_num_seqs=chosen)
        )

    # ---- requests ----
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request. Problems the frontend should have caught end the request with an
        error output instead of raising, so the core survives any input."""
        if self._batch_queue and any(
            request.request_id in so.num_scheduled_tokens for so, _ in self._batch_queue
        ):
            # The id's previous (aborted) request is still in a launched step: its results
            # must not be taken for this one's, so it enters once that step is read back.
            self._blocked_adds.append(request)
            return
        try:
            if request.encoder_input is not None:
                # Audio sent unhashed: a core process's input thread hashed it already.
                enc = with_content_hash(request.encoder_input)
                request.encoder_input = self.encoder_inputs.resolve(enc)
            self._check_request(request)
            matcher = self._compile_grammar(request)
            self.scheduler.add_request(
                Request.from_engine_core_request(request, self.max_model_len)
            )
            if matcher is not None:
                self.structured_outputs.add(request.request_id, matcher)
            if request.sampling_params is not None and (
                request.sampling_params.prompt_logprobs is not None
            ):
                # Rows per prompt token after the first, filled by the prefill chunks; sent
                # with the first token even when the request ends on it (max_tokens=1) or
                # has a one-token prompt (an encoder-decoder's decoder start token).
                rows = max(len(request.prompt_token_ids) - 1, 0)
                self._prompt_logprobs[request.request_id] = ([[]] * rows, [[]] * rows)
        except ValueError as e:
            if request.fork_from is not None and request.last_fork:
                self.scheduler.release_held(request.fork_from)  # it still was the last fork
            self._pending_outputs.append(
                EngineCoreOutput(
                    request.request_id, [], finish_reason=FinishReason.ERROR, error=str(e)
                )
            )

    def _check_request(self, request: EngineCoreRequest) -> None:
        """Admission (v1.core.admission): a request that could never run, or whose numbers do
        not fit the step tensors, fails alone here instead of hanging or failing a step."""
        check_request(request, self.config, self.model_info, self.max_model_len)
        if request.pooling_params is not None:
            self._check_pooling_request(request)

    def _compile_grammar(self, request: EngineCoreRequest) -> Any:
        params = request.sampling_params
        if params is None or params.structured_outputs is None:
            return None
        return self.structured_outputs.compile(params.structured_outputs, request.eos_token_id)

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's next step, with the grammar bitmask of its structured requests."""
        so = self.scheduler.schedule()
        if self._trace is not None:
            self._trace.record(so, len(self.scheduler.waiting))
        if so.scheduled_new_reqs:
            self._record_queue_times(so)
        if len(self.structured_outputs):
            so.structured_output_req_ids, so.grammar_bitmask = self.structured_outputs.bitmask(
                list(so.num_scheduled_tokens)
            )
        return so

    def _record_queue_times(self, so: SchedulerOutput) -> None:
        t = now()
        for data in so.scheduled_new_reqs:
            request = self.scheduler.requests[data.req_id]
            if request.num_preemptions == 0 and request.arrival_time > 0:
                self._queue_times[data.req_id] = max(t - request.arrival_time, 0.0)

    def _update_from_output(self, so: SchedulerOutput, runner_output: Any) -> EngineCoreOutputs:
        """The scheduler's update, then the grammar matchers advance on the accepted tokens; a
        token that breaks its grammar (it cannot, under the mask) fails that request alone."""
        outputs = self.scheduler.update_from_output(so, runner_output)
        if self._queue_times:
            for out in outputs.outputs:
                out.queue_time = self._queue_times.pop(out.request_id, None)
            live = self.scheduler.requests
            for req_id in [r for r in self._queue_times if r not in live]:
                del self._queue_times[req_id]
        if runner_output.prompt_logprobs or self._prompt_logprobs:
            self._attach_prompt_logprobs(runner_output, outputs.outputs)
        grammars = self.structured_outputs
        if len(grammars):
            for out in outputs.outputs:
                if out.request_id not in grammars or out.finished:
                    continue
                error = grammars.accept(out.request_id, out.new_token_ids)
                if error is not None:
                    self._fail_step([out.request_id], error, self._pending_outputs)
            grammars.retain(self.scheduler.requests)
        return outputs

    def _attach_prompt_logprobs(self, runner_output: Any, outputs: list[EngineCoreOutput]) -> None:
        """Collects each chunk's prompt logprobs (by prompt position: a chunk computed again
        after a preemption overwrites its own rows) and sends them whole with the request's
        first token."""
        requests = self.scheduler.requests
        for req_id, (start, ids, values) in runner_output.prompt_logprobs.items():
            rows = self._prompt_logprobs.get(req_id)  # registered by add_request
            if rows is None:
                continue
            rows[0][start - 1 : start - 1 + len(ids)] = ids
            rows[1][start - 1 : start - 1 + len(values)] = values
        for out in outputs:
            if out.new_token_ids and out.request_id in self._prompt_logprobs:
                ids, values = self._prompt_logprobs.pop(out.request_id)
                out.prompt_logprob_token_ids, out.prompt_logprobs = ids, values
        for req_id in [r for r in self._prompt_logprobs if r not in requests]:
            del self._prompt_logprobs[req_id]

    def _check_pooling_request(self, request: EngineCoreRequest) -> None:
        """The core boundary's pooling checks (a custom frontend may send anything)."""
        if self._pooling_config is None:
            return  # the model folder's pooling files could not be read; the runner checks
        lens = request.input_lens
        num_tokens = max(lens) if lens else len(request.prompt_token_ids)
        if num_tokens > self._pooling_config.max_input_len:
            raise ValueError(
                f"input of {num_tokens} tokens exceeds the model's limit of "
                f"{self._pooling_config.max_input_len}"
            )
        self.model_info.check_pooling_params(request.pooling_params)

    def _load_pooling_config(self) -> Any:
        """Pooling limits of an encoder-only model, read from its folder's JSON files once per
        process (ModelInfo.pooling), so bad pooling requests fail alone at admission instead
        of failing a whole step."""
        try:
            return self.model_info.pooling
        except OSError as e:
            logger.warning("pooling config unavailable (%s); limits checked by the runner only", e)
            return None

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        if len(self.structured_outputs):
            self.structured_outputs.retain(self.scheduler.requests)

    def has_work(self) -> bool:
        return (
            self.scheduler.has_requests()
            or bool(self._pending_outputs)
            or bool(self._batch_queue)
            or bool(self._blocked_adds)
        )

    # ---- the step ----
    def step(self) -> EngineCoreOutputs:
        if self._batch_queue is not None:
            return self._step_pipelined(self._batch_queue)
        pending, self._pending_outputs = self._pending_outputs, []
        if not self.scheduler.has_requests():
            if self.scheduler.has_finished_requests:
                # Let the runner drop finished requests even when nothing else runs.
                self.executor.execute_model(self.scheduler.schedule())
            return EngineCoreOutputs(outputs=pending, timestamp=now())
        scheduler_output = self._schedule()
        try:
            runner_output = self.executor.execute_model(scheduler_output)
        except WorkerDeadError:
            raise  # the engine is dead: every request fails with EngineDeadError
        except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the core
            logger.exception(
                "model step failed; failing its %d requests",
                len(scheduler_output.num_scheduled_tokens),
            )
            return self._fail_step(
                scheduler_output.num_scheduled_tokens, f"{type(e).__name__}: {e}", pending
            )
        outputs = self._update_from_output(scheduler_output, runner_output)
        outputs.outputs = pending + outputs.outputs
        return outputs

    def _step_pipelined(self, queue: deque[tuple[SchedulerOutput, Any]]) -> EngineCoreOutputs:
        """Keeps up to `max_steps_in_flight` steps launched: schedule and launch step N+1, then
        read back the oldest (step N at the default depth of 2), so scheduling, input
        preparation and output handling overlap the device. A generating request's token sampled
        in step N is a placeholder when N+1 is scheduled (the runner feeds it from the device);
        if N ends the request, its rows in the later launched steps are wasted and dropped when
        those are read back."""
        pending, self._pending_outputs = self._pending_outputs, []
        scheduler = self.scheduler
        launched = False
        depth = self.max_steps_in_flight
        if len(queue) < depth and (
            scheduler.has_unscheduled_requests() or scheduler.has_finished_requests
        ):
            so = self._schedule()
            if so.total_num_scheduled_tokens == 0:
                self.executor.execute_model(so)  # only lets the runner drop finished requests
            else:
                try:
                    queue.append((so, self.executor.execute_model_async(so)))
                    launched = True
                except WorkerDeadError:
                    raise
                except Exception as e:  # noqa: BLE001 - a failed step fails its requests
                    logger.exception("model step failed to launch")
                    return self._fail_step(
                        so.num_scheduled_tokens, f"{type(e).__name__}: {e}", pending
                    )
        if not queue or (launched and len(queue) < depth and scheduler.has_unscheduled_requests()):
            return EngineCoreOutputs(outputs=pending, timestamp=now())  # launch more first
        so, deferred = queue.popleft()
        try:
            runner_output = deferred.get_output()
        except WorkerDeadError:
            raise  # the engine is dead: every request fails with EngineDeadError
        except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the core
            logger.exception(
                "model step failed; failing its %d requests", len(so.num_scheduled_tokens)
            )
            outputs = self._fail_step(so.num_scheduled_tokens, f"{type(e).__name__}: {e}", pending)
        else:
            outputs = self._update_from_output(so, runner_output)
            outputs.outputs = pending + outputs.outputs
        if self._blocked_adds:
            blocked, self._blocked_adds = self._blocked_adds, []
            for request in blocked:
                self.add_request(request)  # blocked again if still in a launched step
        return outputs

    def _fail_step(
        self, req_ids: Any, message: str, pending: list[EngineCoreOutput]
    ) -> EngineCoreOutputs:
        failed = self.scheduler.finish_requests(list(req_ids), RequestStatus.FINISHED_ERROR)
        for request in failed:
            pending.append(
                EngineCoreOutput(
                    request.request_id, [], finish_reason=FinishReason.ERROR, error=message
                )
            )
        return EngineCoreOutputs(outputs=pending, timestamp=now())

    # ---- utilities ----
    def get_stats(self) -> dict[str, Any]:
        stats = self.scheduler.make_stats()
        return {f: getattr(stats, f) for f in stats.__struct_fields__} | {
            "num_requests": len(self.scheduler.requests),
            "num_kv_requests": self.scheduler.kv_cache_manager.num_requests,
            "cross_cache_lookups": self.scheduler.kv_cache_manager.cross_cache_lookups,
            "cross_cache_hits": self.scheduler.kv_cache_manager.cross_cache_hits,
        }

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def is_healthy(self) -> bool:
        return True

    def get_config_info(self) -> dict[str, Any]:
        return {
            "num_kv_blocks": self.kv_cache_config.num_blocks,
            "block_size": self.kv_cache_config.block_size,
            "max_model_len": self.max_model_len,
        }

    def call_utility(self, method: str, args: list[Any]) -> Any:
        if method not in self.UTILITY_METHODS:
            raise ValueError(f"unknown utility method {method!r}")
        return getattr(self, method)(*args)

    def shutdown(self) -> None:
        if self._trace is not None:
            self._trace.close()
        self.executor.shutdown()
        # Start-up froze this engine's objects out of cyclic GC; give them back so that a
        # process that builds engine after engine (tests, benchmarks) frees each one's memory.
        gc.unfreeze()
