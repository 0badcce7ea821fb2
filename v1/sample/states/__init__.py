"""Sampling state of the runner's slots, one module per rule, composed by `SamplingState`
(v1/sample/state.py). Each state has add(slot, request) / remove(slot) / flush() and
stage(step) (host arrays for the step's one packed copy, then a fill of its metadata fields)."""

from v1.sample.states.params import ParamsState, step_seed
from v1.sample.states.penalties import PenaltiesState
from v1.sample.states.slots import SlotRequest, StepRows, TokenIdTable
from v1.sample.states.token_tables import TokenTablesState
from v1.sample.states.whisper_timestamps import WhisperTimestampsState

__all__ = [
    "ParamsState",
    "PenaltiesState",
    "SlotRequest",
    "StepRows",
    "TokenIdTable",
    "TokenTablesState",
    "WhisperTimestampsState",
    "step_seed",
]
