"""The parts of `ServingCompletions` (v1/entrypoints/openai/serving_completions.py), one layer
each: `job` (a validated request and its accounting), `checks` and `structured` (request fields
checked and converted), `prompts` (prompts tokenized, sampling parameters built), `responses`
(the non-streaming bodies, echo and prompt logprobs), `streams` (the server-sent chunks)."""
