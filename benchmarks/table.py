"""The one table every benchmark reports into: elastic_ddp, the baseline, their ratio.

A `Row` holds the raw figure of every repetition on both sides. Cells show the median and the
min-max spread as `median [min..max]`. The ratio is elastic_ddp over the baseline, computed per
repetition when the two sides were measured in pairs (interleaved runs), otherwise from the medians.
`render_markdown` prints a GitHub table that can be pasted into docs/benchmarks.md.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

CELL_PATTERN = re.compile(r"^(?P<median>[0-9.]+(?:e[+-]?\d+)?) \[(?P<low>[0-9.]+(?:e[+-]?\d+)?)\.\."
                          r"(?P<high>[0-9.]+(?:e[+-]?\d+)?)\]$")


@dataclass
class Row:
    """One figure measured for elastic_ddp and for a baseline."""

    benchmark: str  # throughput, data path, memory, snapshot, recovery
    figure: str  # what is measured, with its unit
    elastic: list[float]
    baseline: list[float]
    baseline_name: str  # what the baseline is: "bare DDP", "stock torchrun", "sync save", ...
    paired: bool = True  # elastic[i] and baseline[i] come from the same repetition
    target: str = ""  # e.g. ">= 0.97"; empty when there is none
    target_on: str = "ratio"  # what the target bounds: the median "ratio", or the "elastic" figure itself
    note: str = ""
    ratios: list[float] = field(init=False)

    def __post_init__(self) -> None:
        if not self.elastic or not self.baseline:
            raise ValueError(f"{self.benchmark} / {self.figure}: a row needs figures on both sides")
        if self.paired and len(self.elastic) == len(self.baseline):
            self.ratios = [a / b for a, b in zip(self.elastic, self.baseline) if b]
        else:
            self.paired = False
            median_baseline = statistics.median(self.baseline)
            self.ratios = [statistics.median(self.elastic) / median_baseline] if median_baseline else []

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios) if self.ratios else math.nan

    def target_met(self) -> bool | None:
        """Whether the median of `target_on` meets `target` (">= x", "< x", ...); None without one."""
        match = re.match(r"^(>=|<=|>|<)\s*([0-9.]+)$", self.target.strip())
        if not match:
            return None
        value = self.ratio if self.target_on == "ratio" else statistics.median(self.elastic)
        bound = float(match.group(2))
        return {">=": value >= bound, "<=": value <= bound, ">": value > bound, "<": value < bound}[match.group(1)]


def format_number(value: float) -> str:
    """Three significant figures or more, never scientific for the magnitudes seen here."""
    if value == 0 or math.isnan(value):
        return "0" if value == 0 else "nan"
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    if magnitude >= 0.001:
        return f"{value:.3g}" if magnitude >= 0.01 else f"{value:.4f}"
    return f"{value:.2e}"


def format_cell(values: Sequence[float]) -> str:
    """`median [min..max]` of `values`."""
    return f"{format_number(statistics.median(values))} [{format_number(min(values))}..{format_number(max(values))}]"


def parse_cell(cell: str) -> tuple[float, float, float]:
    """(median, min, max) back from a cell written by `format_cell`."""
    match = CELL_PATTERN.match(cell.strip())
    if not match:
        raise ValueError(f"not a `median [min..max]` cell: {cell!r}")
    return float(match["median"]), float(match["low"]), float(match["high"])


HEADER = ("benchmark", "figure", "elastic_ddp", "baseline", "vs", "ratio", "target", "n")


def render_markdown(rows: Sequence[Row], unavailable: Sequence[tuple[str, str]] = ()) -> str:
    """A markdown table of `rows`, then one line per (benchmark, reason) that gave no figures."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "|".join(" --- " for _ in HEADER) + "|"]
    for row in rows:
        met = row.target_met()
        target = ("" if row.target_on == "ratio" or not row.target else "elastic_ddp ") + row.target
        target += "" if met is None else (" met" if met else " MISSED")
        ratio = format_cell(row.ratios) if row.paired and row.ratios else format_number(row.ratio)
        count = str(len(row.elastic)) if len(row.elastic) == len(row.baseline) else \
            f"{len(row.elastic)}/{len(row.baseline)}"
        cells = (row.benchmark, row.figure + (f" ({row.note})" if row.note else ""), format_cell(row.elastic),
                 format_cell(row.baseline), row.baseline_name, ratio, target, count)
        lines.append("| " + " | ".join(cells) + " |")
    for benchmark, reason in unavailable:
        lines.append(f"| {benchmark} | {reason} | | | | | | |")
    return "\n".join(lines)
