"""LLMEngine: the synchronous frontend (tokenizer + InputProcessor + OutputProcessor + client).

`add_request` validates and queues (fanning n>1 out into child requests), `step` runs one core
step and returns the user outputs it produced. The offline `LLM` drives it.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

from v1.config import EngineConfig
from v1.core.protocol import EngineCoreOutput, EngineCoreRequest
from v1.engine.core_client import build_frontend, make_frontend_and_client
from v1.engine.input_processor import Params
from v1.engine.output_processor import AnyRequestOutput
from v1.lora_request import LoRARequest
from v1.outputs import RequestOutputKind


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        multiprocess: bool,
        tokenizer: Any = None,
    ) -> None:
        self.config = config
        self.model_config = config.model_config
        self.model_info = self.model_config.info
        """The process's model facts: the input processor and an in-process core share it."""

        # A core process starts while the frontend is built (make_frontend_and_client).
        frontend, self.engine_core = make_frontend_and_client(
            config, partial(build_frontend, config, tokenizer), multiprocess=multiprocess
        )
        self.tokenizer, self.input_processor, self.output_processor = frontend
        self._closed = False
        self._core_outputs: dict[str, EngineCoreOutput | None] = {}
        """Requests run by `run_core_requests` -> their final output (None until finished)."""
        # Start-up objects (model, tokenizer, config) never die: keep them out of the cyclic
        # GC's scans, which otherwise cost ~40% of per-request host time in large batches.
        gc.collect()
        gc.freeze()

    # ---- requests ----
    def process_request(
        self,
        request_id: str,
        prompt: Any,
        params: Params,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> list[Any]:
        """Validates one prompt without queueing it: the EngineCoreRequests it becomes (one per
        completion), run with `lora_request`'s adapter if given. Raises ValueError on invalid
        input."""
        return self.input_processor.process_all(
            request_id, prompt, params, priority=priority, lora_request=lora_request
        )

    def pretokenize(self, prompts: list[Any]) -> list[Any]:
        """`prompts` with the texts the model's input builder tokenizes tokenized in one call
        (a fast tokenizer runs a batch on its threads); `process_request` takes each result as
        it takes the prompt it came from."""
        return self.input_processor.builder.pretokenize(prompts)

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: Params,
        priority: int = 0,
        *,
        output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validates and queues one request; n > 1 runs as n child requests merged into one
        RequestOutput. Raises ValueError (nothing queued) on invalid input."""
        self.add_processed_request(
            request_id,
            prompt,
            params,
            self.process_request(request_id, prompt, params, priority, lora_request),
            output_kind=output_kind,
        )

    def add_processed_request(
        self,
        request_id: str,
        prompt: Any,
        params: Params,
        core_requests: list[Any],
        *,
        output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
        lazy_logprobs: bool = False,
    ) -> None:
        """Queues what `process_request` returned (lets a caller validate a batch first).
        `lazy_logprobs`: completions carry a `LazySampleLogprobs` view (for callers that read
        only the sampled tokens' logprobs)."""
        # One core request: OutputProcessor.add_request's own check raises the same error
        # before anything changes.
        states = self.output_processor.request_states
        if request_id in self.output_processor.parent_requests or (
            len(core_requests) > 1 and any(r.request_id in states for r in core_requests)
        ):
            raise ValueError(f"request id {request_id!r} is already in use")
        texts = self.input_processor.prompt_texts(prompt)
        self.output_processor.add_user_request(
            request_id,
            core_requests,
            params,
            texts,
            output_kind=output_kind,
            lazy_logprobs=lazy_logprobs,
        )
        for request in core_requests:
            request.streamed = output_kind != RequestOutputKind.FINAL_ONLY
            self.engine_core.add_request(request)

    def pooling_inputs(self, prompts: list[Any], params: list[Any]) -> list[Any]:
        """Validates pooling prompts that go packed (`add_packed_request`), prompt i with
        params[i]: each one's (input ids, segment ids or None), or the ValueError it fails
        with."""
        return self.input_processor.builder.pooling_inputs(prompts, params)

    def add_packed_request(
        self,
        request_id: str,
        inputs: list[tuple[str, list[int], list[int] | None]],
        params: Any,
        group_id: str | None = None,
    ) -> None:
        """Queues several pooling inputs of equal params ((user request id, input ids, segment
        ids) from `pooling_inputs`) as ONE core request that runs them apart
        (EngineCoreRequest.input_lens): each input's output comes back under its own user id.
        For batches of short inputs: the frontend and the core handle one request instead of
        each input. Raises UncheckedIdsError (naming the input, nothing queued) when an
        input's ids, left unchecked by `pooling_inputs`, are not token ids."""
        packed = self.input_processor.builder.pack(
            request_id, [(ids, types) for _, ids, types in inputs], params, group_id
        )
        self.output_processor.add_packed_request(packed, [(u, ids) for u, ids, _ in inputs])
        self.engine_core.add_request(packed)

    @property
    def core_runs_ahead(self) -> bool:
        """The core(s) step in their own process(es) (EngineCoreClient.runs_ahead)."""
        return self.engine_core.runs_ahead

    def batched_adds(self) -> AbstractContextManager[None]:
        """Requests added inside go to the core(s) together when the block ends (one message
        per core; `EngineCoreClient.batched_adds`)."""
        return self.engine_core.batched_adds()

    def abort_request(self, request_ids: list[str]) -> None:
        """Drops requests (n>1 parents included); they produce no further outputs."""
        core_ids = self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(core_ids)

    def add_core_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Queues prepared core requests (beam search steps) past the output processor: their
        final outputs are kept for `take_core_output` instead of becoming user outputs."""
        req_ids = [r.request_id for r in requests]
        if len(set(req_ids)) != len(req_ids) or any(r in self._core_outputs for r in req_ids):
            raise ValueError("core request ids must be unique")
        for request in requests:
            self._core_outputs[request.request_id] = None
            request.streamed = False  # only the final output is kept
            self.engine_core.add_request(request)

    def take_core_output(self, request_id: str) -> EngineCoreOutput | None:
        """The final output of a request from `add_core_requests` (forgotten once taken);
        None while it runs."""
        output = self._core_outputs.get(request_id)
        if output is not None:
            del self._core_outputs[request_id]
        return output

    def core_outputs_ready(self, request_ids: list[str]) -> bool:
        """Whether every one of these `add_core_requests` requests has finished."""
        return all(self._core_outputs.get(r) is not None for r in request_ids)

    def abort_core_requests(self, request_ids: list[str]) -> None:
        """Aborts requests of `add_core_requests` (held ones are released)."""
        for req_id in request_ids:
            self._core_outputs.pop(req_id, None)
        self.engine_core.abort_requests(request_ids)

    def run_core_requests(
        self, requests: list[EngineCoreRequest], release_ids: Sequence[str] = ()
    ) -> dict[str, EngineCoreOutput]:
        """Runs prepared core requests to the end and returns each one's final output. Other
        requests keep running meanwhile, but their outputs of these steps are dropped.
        `release_ids`: held requests (`hold_kv`) to release once these are queued (the beam
        steps before, which these no longer fork from)."""
        req_ids = [r.request_id for r in requests]
        self.add_core_requests(requests)
        if release_ids:
            self.engine_core.abort_requests(list(release_ids))
        outputs: dict[str, EngineCoreOutput] = {}
        try:
            while len(outputs) < len(req_ids):
                self.step()
                for req_id in req_ids:
                    output = None if req_id in outputs else self.take_core_output(req_id)
                    if output is not None:
                        outputs[req_id] = output
        except BaseException:
            self.abort_core_requests([r for r in req_ids if r not in outputs])
            raise
        return outputs

    def _take_core_outputs(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Keeps the final outputs of `run_core_requests`' requests; returns the others."""
        rest = []
        for out in outputs:
            if out.request_id not in self._core_outputs:
                rest.append(out)
            elif out.finished:
                self._core_outputs[out.request_id] = out
        return rest

    # ---- running ----
    def step(self) -> list[AnyRequestOutput]:
        """One core step: the outputs it produced (per each request's output kind)."""
        outputs = self.engine_core.get_output()
        core_outputs = outputs.outputs
        if self._core_outputs:
            core_outputs = self._take_core_outputs(core_outputs)
        results, reqs_to_abort = self.output_processor.process_outputs(core_outputs)
        if reqs_to_abort:
            self.engine_core.abort_requests(reqs_to_abort)
        return results

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def get_stats(self) -> dict[str, Any]:
        """The core's scheduler and KV cache counters (EngineCore.get_stats)."""
        return self.engine_core.call_utility("get_stats")

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.engine_core.shutdown()
            gc.unfreeze()  # see EngineCore.shutdown
