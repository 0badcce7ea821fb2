"""`BatchProcessor`: one engine that maps a batch of input rows to output rows.

The local runner calls it directly; over Ray Data it is the callable class of `map_batches`, one
instance (one engine) per actor. Batches are column dicts ({"id": [...], "text": [...]}), the
outputs too, so either runner and either output format takes them as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from v1.entrypoints.llm import LLM
from v1.sampling_params import SamplingParams


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
        """`batch`: "id" and one input column ("text"; for transcribe "path" or "bytes").
        Returns "id" and the task's result columns, in the batch's order."""
        ids = [str(i) for i in batch["id"]]
        if self.task == "transcribe":
            audio = batch["bytes"] if "bytes" in batch else batch["path"]
            results = self.llm.transcribe(
                [bytes(a) if not isinstance(a, str) else a for a in audio],
                use_tqdm=False,
                **self.options,
            )
            columns: dict[str, list[Any]] = {
                "id": ids,
                "text": [r.text for r in results],
                "language": [r.language for r in results],
                "duration": [float(r.duration) for r in results],
            }
            if self.options.get("timestamps") or self.options.get("word_timestamps"):
                # Asked for (--timestamps / --word-timestamps): timed segments, the language's
                # probability and, with word timestamps, every word.
                columns["language_probability"] = [r.language_probability for r in results]
                columns["segments"] = [
                    [{"start": s.start, "end": s.end, "text": s.text} for s in r.segments]
                    for r in results
                ]
            if self.options.get("word_timestamps"):
                columns["words"] = [
                    [
                        {
                            "word": w.word,
                            "start": w.start,
                            "end": w.end,
                            "probability": w.probability,
                        }
                        for w in r.words or []
                    ]
                    for r in results
                ]
            return columns
        texts = [str(t) for t in batch["text"]]
        if self.task == "embed":
            outputs = self.llm.embed(texts, use_tqdm=False)
            return {"id": ids, "embedding": [list(o.outputs.embedding) for o in outputs]}
        outputs = self.llm.generate(texts, self.params, use_tqdm=False)
        return {
            "id": ids,
            "text": [o.outputs[0].text for o in outputs],
            "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        }

    def shutdown(self) -> None:
        self.llm.shutdown()
