"""`BatchProcessor`: one engine that maps a batch of input rows to output rows.

The local runner calls it directly; over Ray Data it is the callable class of `map_batches`, one
instance (one engine) per actor. Batches are column dicts ({"id": [...], "text": [...]}), the
outputs too, so either runner and either output format takes them as they are. A bad row (a
corrupt audio file, an empty text) becomes that row's "error"; the rest of the batch runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from v1.entrypoints.llm import LLM, RequestFailedError
from v1.sampling_params import SamplingParams

RESULT_COLUMNS = {
    "transcribe": ("text", "language", "duration"),
    "embed": ("embedding",),
    "generate": ("text", "token_ids"),
}
"""Each task's result columns (None in a row that failed)."""


class BatchProcessor:
    def __init__(
        self,
        task: str,
        model: str,
        engine_kwargs: dict[str, Any] | None = None,
        options: dict[str, Any] | None = None,
        multiprocess: bool | None = None,
    ) -> None:
        """`multiprocess`: run the EngineCore in its own process (LLM's default when None)."""
        self.task = task
        self.options = dict(options or {})
        self.llm = LLM(model, multiprocess=multiprocess, **(engine_kwargs or {}))
        if task == "generate":
            self.params = SamplingParams(**self.options)
        elif task == "transcribe" and "max_tokens" in self.options:
            # Tokens per 30 s window: the one transcription option that is a sampling parameter.
            max_tokens = self.options.pop("max_tokens")
            self.options["sampling_params"] = SamplingParams(temperature=0.0, max_tokens=max_tokens)

    def __call__(self, batch: dict[str, Sequence[Any]]) -> dict[str, list[Any]]:
        """`batch`: "id" and one input column ("text"; for transcribe "path" or "bytes"), and
        optionally "error" (a row already known bad: not run). Returns "id", the task's result
        columns and "error", in the batch's order: a row the engine rejects or fails gets its
        reason in "error" (None elsewhere) and None results; the other rows still run."""
        ids = [str(i) for i in batch["id"]]
        inputs = self._inputs(batch)
        errors: list[str | None] = [
            str(e) if e else None for e in batch.get("error", [None] * len(ids))
        ]
        good = [i for i, e in enumerate(errors) if e is None]
        results: list[dict[str, Any] | None] = [None] * len(ids)
        try:
            for i, result in zip(good, self._run([inputs[i] for i in good]), strict=True):
                results[i] = result
        except (ValueError, RequestFailedError):
            # One bad row fails the whole call: run the rows one by one to find it.
            for i in good:
                try:
                    (results[i],) = self._run([inputs[i]])
                except (ValueError, RequestFailedError) as e:
                    errors[i] = _reason(e)
        columns = list(RESULT_COLUMNS[self.task])
        if self.task == "transcribe":  # the columns asked for (_transcript_row)
            if self.options.get("timestamps") or self.options.get("word_timestamps"):
                columns += ["language_probability", "segments"]
            if self.options.get("word_timestamps"):
                columns.append("words")
        out: dict[str, list[Any]] = {"id": ids}
        for key in columns:
            out[key] = [r[key] if r is not None else None for r in results]
        out["error"] = errors
        return out

    def _inputs(self, batch: dict[str, Sequence[Any]]) -> list[Any]:
        if self.task == "transcribe":
            audio = batch["bytes"] if "bytes" in batch else batch["path"]
            return [bytes(a) if a is not None and not isinstance(a, str) else a for a in audio]
        return [t if t is None else str(t) for t in batch["text"]]

    def _run(self, inputs: list[Any]) -> list[dict[str, Any]]:
        """The task's results for every input; raises when any input is bad or fails."""
        if not inputs:
            return []
        if self.task == "transcribe":
            results = self.llm.transcribe(inputs, use_tqdm=False, **self.options)
            return [self._transcript_row(r) for r in results]
        if self.task == "embed":
            outputs = self.llm.embed(inputs, use_tqdm=False)
            return [{"embedding": list(o.outputs.embedding)} for o in outputs]
        outputs = self.llm.generate(inputs, self.params, use_tqdm=False)
        return [
            {"text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids)} for o in outputs
        ]

    def _transcript_row(self, r: Any) -> dict[str, Any]:
        """text, language and duration; with --timestamps / --word-timestamps also the timed
        segments, the language's probability and (word timestamps) every word."""
        row: dict[str, Any] = {
            "text": r.text,
            "language": r.language,
            "duration": float(r.duration),
        }
        if self.options.get("timestamps") or self.options.get("word_timestamps"):
            row["language_probability"] = r.language_probability
            row["segments"] = [{"start": s.start, "end": s.end, "text": s.text} for s in r.segments]
        if self.options.get("word_timestamps"):
            row["words"] = [
                {"word": w.word, "start": w.start, "end": w.end, "probability": w.probability}
                for w in r.words or []
            ]
        return row

    def shutdown(self) -> None:
        self.llm.shutdown()


def _reason(error: Exception) -> str:
    """A row's failure in one line (a batch call's "prompt 0: " prefix is meaningless here)."""
    if isinstance(error, RequestFailedError):
        failed = [o.error for o in error.outputs if getattr(o, "error", None)]
        return f"the engine failed the request: {failed[0]}" if failed else str(error)
    message = str(error).splitlines()[0] if str(error) else type(error).__name__
    return message.removeprefix("prompt 0: ")
