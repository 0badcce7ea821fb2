"""Rows of `offline.py`'s result table and their markdown / JSON forms.

A row holds seconds (per run, or per step for time units) and turns them into the unit shown:
throughput units (RTFx, tok/s) are `work / seconds`, time units (ms/step, us/step) are scaled
seconds. "v1/floor" is floor seconds / our median seconds: the fraction of the device floor
we reach (1.0 = at the floor).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from _harness import Samples

TIME_UNITS = {"ms/step": 1e3, "us/step": 1e6}


@dataclass
class Row:
    workload: str
    unit: str
    work: float
    """Units of work per run (audio seconds, tokens); unused for time units."""
    ours: Samples | None
    hf: Samples | None = None
    hf_batch: int | None = None
    floor_s: float | None = None
    """Seconds per run (or per step) at the device floor."""
    notes: list[str] = field(default_factory=list)

    @property
    def is_time(self) -> bool:
        return self.unit in TIME_UNITS

    def value(self, seconds: float) -> float:
        return seconds * TIME_UNITS[self.unit] if self.is_time else self.work / seconds

    def cell(self, samples: Samples | None) -> str:
        if samples is None:
            return "-"
        lo, hi = sorted((self.value(samples.min), self.value(samples.max)))
        return f"{_num(self.value(samples.median))} [{_num(lo)}-{_num(hi)}]"

    @property
    def ratio(self) -> float | None:
        """Ours over transformers, > 1 when ours is better."""
        if self.ours is None or self.hf is None:
            return None
        return self.hf.median / self.ours.median

    @property
    def of_floor(self) -> float | None:
        if self.ours is None or self.floor_s is None:
            return None
        return self.floor_s / self.ours.median

    def markdown(self) -> str:
        hf = self.cell(self.hf)
        if self.hf is not None and self.hf_batch is not None:
            hf += f" (batch {self.hf_batch})"
        ratio = f"{self.ratio:.2f}x" if self.ratio is not None else "-"
        floor = _num(self.value(self.floor_s)) if self.floor_s else "-"
        of_floor = f"{self.of_floor:.0%}" if self.of_floor is not None else "-"
        cells = [self.workload, self.unit, self.cell(self.ours), hf, ratio, floor, of_floor]
        return "| " + " | ".join(cells) + " |"

    def to_json(self) -> dict[str, Any]:
        def stats(s: Samples | None) -> dict[str, Any] | None:
            if s is None:
                return None
            return {
                "seconds": list(s.seconds),
                "median": self.value(s.median),
                "min": self.value(s.min),
                "max": self.value(s.max),
            }

        return {
            "workload": self.workload,
            "unit": self.unit,
            "work": self.work,
            "ours": stats(self.ours),
            "transformers": stats(self.hf),
            "transformers_batch": self.hf_batch,
            "ratio": self.ratio,
            "floor": self.value(self.floor_s) if self.floor_s else None,
            "ours_of_floor": self.of_floor,
            "notes": self.notes,
        }


TABLE_HEADER = (
    "| workload | unit | v1-engine median [min-max] | transformers best [min-max] (batch) "
    "| ratio | floor | v1/floor |\n|---|---|---:|---:|---:|---:|---:|"
)


def markdown_table(rows: list[Row]) -> str:
    return "\n".join([TABLE_HEADER, *(r.markdown() for r in rows)])


def notes_markdown(rows: list[Row]) -> str:
    lines = []
    for r in rows:
        for note in r.notes:
            lines.append(f"- {r.workload}: {note}")
    return "\n".join(lines)


def _num(x: float) -> str:
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:,.1f}"
    return f"{x:,.2f}"
