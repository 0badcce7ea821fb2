"""Sampling state of the runner's slots, one module per rule, composed by `SamplingState`
(v1/sample/state.py). Each state has add(slot, request), remove(slot), flush() and stage(step)
(host arrays for the step's one packed copy; returns what builds its metadata part), and its
rules live beside it. No re-exports here: metadata.py imports the rule modules directly."""
