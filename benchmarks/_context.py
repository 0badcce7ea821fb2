"""What every workload of `offline.py` shares: the run context, random model folders, our
engine's timed runs (one per option variant) and the rows they become.

A workload builds its transformers model (random weights, real shapes), measures transformers,
frees it, then runs `run_ours` for each variant of our engine's options on the saved folder.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from _harness import Device, EngineProbe, Machine, ProbeReport, Samples, compare_counts, timed
from _report import Row


def asset(name: str) -> str:
    """../shared/assets/<name> beside the checkout, shared/assets/<name> inside it, or the
    .bench_assets/<name> copy carried to a device machine."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for base in (os.path.join(root, "..", "shared"), os.path.join(root, "shared"), "../shared"):
        path = os.path.join(base, "assets", name)
        if os.path.isdir(path):
            return os.path.normpath(path)
    return os.path.join(root, ".bench_assets", name)


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "normalizer.json",
    "vocab.txt",
)

ENCODER_DECODER_OPTIONS = ("cross_attention",)
"""Engine options that only mean something for encoder-decoder models."""


@dataclass
class Context:
    args: argparse.Namespace
    device: Device
    machine: Machine
    variants: list[dict[str, str]]
    """Our engine's option sets (issue 16's modes), one row each; [{}] = defaults."""
    store: ModelStore
    mismatches: list[str] = field(default_factory=list)
    """Output sizes that differ between the sides or from the forced size (--check fails)."""
    failures: list[str] = field(default_factory=list)
    """Variants or workloads that raised (the run exits non-zero)."""

    @property
    def tiny(self) -> bool:
        return bool(self.args.tiny)

    @property
    def repeats(self) -> int:
        return self.args.repeats

    @property
    def dtype(self) -> torch.dtype:
        return torch.float16 if self.device.is_cuda else torch.float32

    def sizes(self, full: Any, tiny: Any) -> Any:
        return tiny if self.tiny else full

    def num_inputs(self, default: int) -> int:
        return self.args.num_inputs or default

    def hf_batches(
        self, num_inputs: int, full: tuple[int, ...], tiny: tuple[int, ...]
    ) -> tuple[int, ...]:
        """transformers' batch sizes to sweep (--hf-batches, else the workload's), none larger
        than the inputs (one batch of all of them instead)."""
        if self.args.hf_batches:
            batches = tuple(int(b) for b in self.args.hf_batches.split(","))
        else:
            batches = tiny if self.tiny else full
        return tuple(dict.fromkeys(min(b, num_inputs) for b in batches))

    def engine_kwargs(self, full: dict[str, Any], tiny: dict[str, Any]) -> dict[str, Any]:
        kwargs = dict(tiny if self.tiny else full)
        if self.args.max_num_seqs:
            kwargs["max_num_seqs"] = self.args.max_num_seqs
        if getattr(self.args, "num_scheduler_steps", None):
            kwargs["num_scheduler_steps"] = self.args.num_scheduler_steps
        if not self.device.is_cuda:
            kwargs.setdefault("kv_cache_memory_bytes", 64 << 20)
        return kwargs


class ModelStore:
    """Random-weight model folders of this run (saved once, reused across workloads that share
    a model, deleted at the end)."""

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="v1bench-")
        self.paths: dict[str, str] = {}

    def save(
        self, key: str, model: torch.nn.Module, extras: Callable[[str], None] | None = None
    ) -> str:
        if key not in self.paths:
            path = os.path.join(self.root, key)
            model.save_pretrained(path)
            if extras is not None:
                extras(path)
            self.paths[key] = path
        return self.paths[key]

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def copy_tokenizer(src_dir: str, dst_dir: str) -> None:
    for name in TOKENIZER_FILES:
        src = os.path.join(src_dir, name)
        if os.path.exists(src):
            shutil.copy(src, dst_dir)


def build_model(ctx: Context, cls: type, config: Any, **kwargs: Any) -> torch.nn.Module:
    """`cls(config)` with random weights, in the run's dtype, on the run's device, eval mode."""
    torch.manual_seed(0)
    with torch.device(ctx.device.name):
        model = cls._from_config(config, dtype=ctx.dtype, **kwargs)
    return model.eval()


def variant_label(variant: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in variant.items())


@dataclass
class OursRun:
    variant: dict[str, str]
    samples: Samples | None = None
    probe: ProbeReport | None = None
    error: str | None = None


def run_ours(
    ctx: Context,
    path: str,
    engine_kwargs: dict[str, Any],
    variant: dict[str, str],
    inputs: Callable[[int], Any],
    run: Callable[[Any, Any], Any],
    measure: Callable[[Any], Samples] | None = None,
) -> OursRun:
    """Our engine on `path` with `variant`'s options. `run(llm, inputs(0))` once as the warm-up
    on full-size inputs (observed by an EngineProbe, untimed), then `run(llm, inputs(i))` timed
    for input sets 1..repeats, each built before its timer starts. Every set holds fresh inputs,
    so no run reuses another's encoder output or prefix cache. `measure(llm)` replaces the
    timed runs (it gets the warm engine)."""
    from v1 import LLM

    result = OursRun(variant)
    llm = probe = None
    variant = dict(variant)
    process = dict(multiprocess=ctx.args.multiprocess)
    if variant.pop("settings", "tuned") == "defaults":
        # What a user who knows no settings gets: the engine's own choices, its core in its
        # own process as LLM starts it (issue 35 item 1).
        engine_kwargs = {k: v for k, v in engine_kwargs.items() if k == "kv_cache_memory_bytes"}
        process = {}
    where = variant.pop("process", None)
    if where is not None:
        process = dict(multiprocess=where == "mp")
    try:
        llm = LLM(
            path,
            dtype=str(ctx.dtype).removeprefix("torch."),
            device=ctx.device.name,
            **process,
            **engine_kwargs,
            **variant,
        )
        warm_inputs = inputs(0)
        with EngineProbe(llm) as probe:
            timed(ctx.device, lambda: run(llm, warm_inputs))
        warm_inputs = None
        result.probe = probe.report()
        if measure is not None:
            result.samples = measure(llm)
        else:
            seconds = []
            for input_set in range(1, ctx.repeats + 1):
                batch = inputs(input_set)
                seconds.append(timed(ctx.device, lambda b=batch: run(llm, b))[0])
            result.samples = Samples(tuple(seconds))
    except Exception as e:  # noqa: BLE001 - one variant failing must not hide the others
        traceback.print_exc()
        result.error = f"{type(e).__name__}: {e}"
    finally:
        if llm is not None:
            llm.shutdown()
        llm = probe = None  # the probe holds the engine too: both must go before it is freed
        # LLM freezes the cyclic GC at start-up (gc.freeze), so a shut-down engine's cycles
        # (model weights, KV cache) are never collected: unfreeze to get its memory back
        # before the next variant or workload runs in this process, then freeze what is
        # left again (as LLM does) so later collections stay cheap.
        gc.unfreeze()
        ctx.device.free()
        gc.freeze()
    return result


def variants_for(ctx: Context, encoder_decoder: bool) -> list[dict[str, str]]:
    """The variants, without options that do not apply to this kind of model (deduplicated)."""
    out: list[dict[str, str]] = []
    for variant in ctx.variants:
        kept = {
            k: v for k, v in variant.items() if encoder_decoder or k not in ENCODER_DECODER_OPTIONS
        }
        if kept not in out:
            out.append(kept)
    return out


@dataclass
class Baseline:
    """transformers' measured figure for a workload (its fastest setting)."""

    samples: Samples | None
    batch: int | None
    counts: list[int] | None
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RowSpec:
    """What a workload's rows say besides the measurements."""

    name: str
    unit: str
    work: float
    """Units of work per run (audio seconds, tokens); 1.0 for time units."""
    floor_s: float | None
    expected: int | None
    """The forced output size of every input (tokens; 1 for an embedding)."""
    intro: str
    """The first note: inputs and settings."""


def ours_rows(
    ctx: Context, spec: RowSpec, baseline: Baseline | None, runs: list[OursRun]
) -> list[Row]:
    """One row per variant; output-size mismatches and failures are also kept in `ctx`."""
    rows = []
    for r in runs:
        label = f"{spec.name} [{variant_label(r.variant)}]" if r.variant else spec.name
        notes = [spec.intro]
        if r.variant.get("settings") == "defaults":
            notes.append("this row: none of the engine settings above, only LLM's defaults")
        if r.error is not None:
            ctx.failures.append(f"{label}: {r.error}")
            notes.append(f"v1-engine FAILED: {r.error}")
        notes += baseline.notes if baseline is not None else []
        if r.probe is not None:
            notes.append(f"v1-engine: {r.probe.memory_note()}")
            theirs = baseline.counts if baseline is not None and baseline.counts else None
            problems = compare_counts(r.probe.counts, theirs, spec.expected)
            if problems:
                ctx.mismatches.extend(f"{label}: {p}" for p in problems)
                notes.append("check FAILED: " + "; ".join(problems))
            else:
                side = "both sides" if theirs is not None else "v1-engine"
                notes.append(
                    f"check: {side} gave {spec.expected} outputs (tokens or embeddings) to each "
                    f"of {len(r.probe.counts)} inputs"
                )
        rows.append(
            Row(
                workload=label,
                unit=spec.unit,
                work=spec.work,
                ours=r.samples,
                hf=baseline.samples if baseline is not None else None,
                hf_batch=baseline.batch if baseline is not None else None,
                floor_s=spec.floor_s,
                notes=notes,
            )
        )
    return rows
