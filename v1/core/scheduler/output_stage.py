"""`OutputStage`: applies a step's ModelRunnerOutput: appends sampled tokens up to a stop, ends
pooling requests with their result, finishes and releases what ended. Rows of requests aborted
or preempted while the step ran (and maybe admitted again since) are dropped.
"""

from __future__ import annotations

from v1.core.protocol import EngineCoreOutput, EngineCoreOutputs, FinishReason, now
from v1.core.request import Request, RequestStatus
from v1.core.sched_output import ModelRunnerOutput, SchedulerOutput
from v1.core.scheduler.resources import RequestResources


class OutputStage:
    def __init__(
        self, running: list[Request], resources: RequestResources, max_model_len: int
    ) -> None:
        self.running = running
        self.resources = resources
        self.requests = resources.requests
        self.max_model_len = max_model_len

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        outputs: list[EngineCoreOutput] = []
        requests = self.requests
        running = RequestStatus.RUNNING
        sampled_token_ids = runner_output.sampled_token_ids
        logprobs = runner_output.logprobs
        logprob_token_ids = runner_output.logprob_token_ids
        logprob_ranks = runner_output.logprob_ranks
        extras = runner_output.extras
        req_ids = list(scheduler_output.num_scheduled_tokens)
        pooled: list[Request] = []
        """Pooling requests of the step: each ends with its result."""
        index = None  # the runner's rows follow the schedule's order (checked once per step)
        if req_ids != runner_output.req_ids:
            index = {req_id: i for i, req_id in enumerate(runner_output.req_ids)}
        step_id = scheduler_output.step_id
        if runner_output.failed:
            self._fail(runner_output.failed, outputs)
        for row, req_id in enumerate(req_ids):
            request = requests.get(req_id)
            if request is None or request.status != running or request.admitted_step > step_id:
                continue  # aborted or preempted while the step ran (and maybe admitted again)
            i = row if index is None else index[req_id]
            if request.pooling_params is not None:
                outputs.append(_pooled_output(request, runner_output, i))
                pooled.append(request)
                continue
            new_ids = sampled_token_ids[i]
            if not new_ids:
                continue  # a prefill chunk that did not reach the end of the prompt
            num_placeholders = request.num_output_placeholders - len(new_ids)
            request.num_output_placeholders = num_placeholders if num_placeholders > 0 else 0
            new_ids = self._append_and_check_stop(request, new_ids)
            status = request.status
            lp_token_ids = lp_values = lp_ranks = None
            if logprobs is not None and logprobs[i] is not None:
                # The first len(new_ids) rows; the runner's lists themselves when they hold no
                # more (nothing writes to them after the step).
                n = len(new_ids)
                lp_token_ids = logprob_token_ids[i]  # type: ignore[index]
                lp_values = logprobs[i]
                lp_ranks = logprob_ranks[i]  # type: ignore[index]
                if len(lp_token_ids) != n:
                    lp_token_ids = lp_token_ids[:n]
                if len(lp_values) != n:
                    lp_values = lp_values[:n]
                if len(lp_ranks) != n:
                    lp_ranks = lp_ranks[:n]
            # EngineCoreOutput's fields in order (positional: it is built per request and step).
            out = EngineCoreOutput(
                req_id,
                new_ids,
                lp_token_ids,
                lp_values,
                lp_ranks,
                None,
                None if status == running else RequestStatus.finish_reason(status),
                request.stop_reason,
                None,
                request.num_cached_tokens if request.num_cached_tokens > 0 else 0,
            )
            if extras:
                request_extras = extras.get(req_id)
                if request_extras:
                    out.extras = request_extras
            outputs.append(out)
            if status != running:
                self.running.remove(request)
                self.resources.release(request)
        if pooled:
            self._finish_all(pooled)
        return EngineCoreOutputs(outputs=outputs, timestamp=now())

    def _fail(self, failed: dict[str, str], outputs: list[EngineCoreOutput]) -> None:
        """Requests the runner failed alone (their rows are dropped below): each ends with
        finish reason error and its message; blocks and encoder entries are freed."""
        for req_id, error in failed.items():
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted meanwhile (a new admission runs it again)
            request.status = RequestStatus.FINISHED_ERROR
            self.running.remove(request)
            self.resources.free(request)
            outputs.append(
                EngineCoreOutput(req_id, [], finish_reason=FinishReason.ERROR, error=error)
            )

    def _append_and_check_stop(self, request: Request, new_ids: list[int]) -> list[int]:
        """Appends the sampled tokens up to the first that ends the request (its status says
        why); returns those accepted (`new_ids` itself when all are: nothing writes to the
        runner's lists after the step)."""
        params = request.sampling_params
        output_token_ids = request.output_token_ids
        all_token_ids = request.all_token_ids
        num_accepted = 0
        for token in new_ids:
            output_token_ids.append(token)  # request.append_output_token_ids, per token
            all_token_ids.append(token)
            num_accepted += 1
            if len(output_token_ids) >= params.min_tokens:
                if token == request.eos_token_id and not params.ignore_eos:
                    request.status = RequestStatus.FINISHED_STOPPED
                    break
                if params.stop_token_ids and token in params.stop_token_ids:
                    request.status = RequestStatus.FINISHED_STOPPED
                    request.stop_reason = token
                    break
            if (
                len(output_token_ids) >= request.max_tokens
                or len(all_token_ids) >= self.max_model_len
            ):
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
                break
        return new_ids if num_accepted == len(new_ids) else new_ids[:num_accepted]

    def _finish_all(self, requests: list[Request]) -> None:
        """Finished `requests`, all running, leave `running` in one pass: a pooling step ends
        ~100 requests at once, where a list.remove each scans `running` again."""
        done = set(map(id, requests))
        self.running[:] = [r for r in self.running if id(r) not in done]
        for request in requests:
            self.resources.release(request)


def _pooled_output(
    request: Request, runner_output: ModelRunnerOutput, row: int
) -> EngineCoreOutput:
    """A pooling request ends with its step: its result, finished (released by the caller)."""
    request.status = RequestStatus.FINISHED_STOPPED
    pooler_output = runner_output.pooler_output
    result = pooler_output[row] if pooler_output else None
    return EngineCoreOutput(
        request.request_id, [], pooled_output=result, finish_reason=FinishReason.STOP
    )
