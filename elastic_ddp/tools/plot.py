"""The picture of a run: loss and throughput against step and time, world size as a band.

    from elastic_ddp.runlog.run_history import load_history
    from elastic_ddp.tools.plot import render_plot
    render_plot(load_history("runs/job1"), "job1.png")

Left column against the global step, right column against wall-clock time since the run started.
Rows: loss (with the held-out loss of the evaluations, and their accuracy on a right-hand 0..1 axis
of the step column when there is one), throughput (coloured by world size), and the world size as a
band with the snapshots as ticks. Failures and joins are vertical lines on the time axes with the
time without training shaded; on the step axes, the work each failure rolled back is hatched and
the rolled-back part of the curves is drawn faint, so the trajectory that survived reads as one
unbroken line.

Needs matplotlib (`pip install 'elastic_ddp[report]'`); PlotUnavailable says so when it is missing.
The image is always PLOT_SIZE_PX (no tight bounding box), so tools and tests can rely on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elastic_ddp.runlog.run_history import RunHistory, Transition
from elastic_ddp.tools.report import summarise
from elastic_ddp.tools.text import format_bytes, format_clock, format_duration, plural

PLOT_DPI = 100
PLOT_SIZE_PX = (1600, 1000)

LOSS_COLOR = "#1b3a6b"
ROLLED_BACK_COLOR = "#9aa3ad"
# Markers on the held-out lines: evaluations are few and far between, and each point is a measurement.
EVAL_LOSS_STYLE = {"color": "#00a5cf", "marker": "D", "markersize": 4, "linewidth": 1.4}
EVAL_ACCURACY_STYLE = {"color": "#d81b60", "marker": "s", "markersize": 4, "linewidth": 1.4}
KIND_COLORS = {"node lost": "#c62828", "node drained": "#8e24aa", "restart": "#ef6c00", "node joined": "#1565c0",
               "relaunch after finish": "#6d6d6d"}
MAX_MARKED_POINTS = 400
NICE_SECONDS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400,
                172800, 604800)
LABEL_MIN_FRACTION = 0.09  # of the x range: narrower world-size segments get no label
LABEL_WIDTH = 0.25  # of the x range, about: transition labels that would overlap are stacked
WORLD_PALETTE = ["#2e7d32", "#6a1b9a", "#00838f", "#f9a825", "#ad1457", "#4e342e", "#283593", "#558b2f"]


class PlotUnavailable(Exception):
    """matplotlib is not installed, so the report can give its text only."""


def _matplotlib():
    try:
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
        from matplotlib.ticker import FuncFormatter, MultipleLocator
    except ImportError as exc:
        raise PlotUnavailable("matplotlib is not installed: pip install 'elastic_ddp[report]' "
                              "(or pass --no-plot)") from exc
    return Figure, Line2D, Patch, FuncFormatter, MultipleLocator


def render_plot(history: RunHistory, output: str | Path) -> Path:
    """Draw `history` into the PNG `output` (PLOT_SIZE_PX pixels); return its path."""
    Figure, Line2D, Patch, FuncFormatter, MultipleLocator = _matplotlib()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure = Figure(figsize=(PLOT_SIZE_PX[0] / PLOT_DPI, PLOT_SIZE_PX[1] / PLOT_DPI), dpi=PLOT_DPI)
    plot = _RunPlot(history, world_colors(history))
    # The accuracy axis at the right of the step column needs room for its ticks and label.
    grid = figure.add_gridspec(3, 2, height_ratios=[3.2, 2.6, 0.7], hspace=0.08,
                               wspace=0.2 if plot.has_accuracy else 0.12, left=0.06, right=0.985, top=0.86,
                               bottom=0.12)
    axes = {}
    for column, axis_kind in enumerate(("step", "time")):
        loss = figure.add_subplot(grid[0, column])
        throughput = figure.add_subplot(grid[1, column], sharex=loss)
        band = figure.add_subplot(grid[2, column], sharex=loss)
        axes[axis_kind] = (loss, throughput, band)

    plot.draw_step_column(*axes["step"], step_format=FuncFormatter(lambda value, _: f"{value:,.0f}"))
    plot.draw_time_column(*axes["time"], clock=FuncFormatter(lambda value, _: format_clock(value)),
                          locator=MultipleLocator)
    _titles(figure, history)
    _legend(figure, plot, Line2D, Patch)
    figure.savefig(output, dpi=PLOT_DPI, facecolor="white")
    return output


def _tick_interval(duration: float) -> float:
    """A round number of seconds that puts 4 to 10 ticks on the time axis."""
    return next((seconds for seconds in NICE_SECONDS if duration / seconds <= 8), NICE_SECONDS[-1])


def world_colors(history: RunHistory) -> dict[int | None, str]:
    sizes = sorted({i.world_size for i in history.incarnations if i.world_size is not None})
    colors: dict[int | None, str] = {size: WORLD_PALETTE[index % len(WORLD_PALETTE)]
                                     for index, size in enumerate(sizes)}
    colors[None] = "#777777"
    return colors


class _RunPlot:
    """The series of one run, split per incarnation, with the rolled-back points marked."""

    def __init__(self, history: RunHistory, colors: dict[int | None, str]):
        self.history = history
        self.colors = colors
        self.started = history.started
        self.transitions = history.transitions
        incarnations = history.incarnations
        self.max_step = max(incarnation.final_step for incarnation in incarnations)
        self.duration = max(1e-9, history.ended - history.started)
        # A point is rolled back when a later incarnation resumed from an earlier step.
        resume_after: dict[int, float] = {}
        lowest = float("inf")
        for incarnation in reversed(incarnations):
            resume_after[incarnation.incarnation] = lowest
            lowest = min(lowest, incarnation.resumed_from_step)
        self.kept_until = resume_after
        # Markers help read a few dozen points and turn thousands into a smear.
        self.markers = {"marker": "o", "markersize": 2.5} if len(history.progress) <= MAX_MARKED_POINTS else {}
        self._labels: dict[int, list[tuple[tuple[float, float], int]]] = {}
        self.series = [{**part, "color": colors.get(part["incarnation"].world_size, colors[None])}
                       for part in self._split(history.progress)]
        self.evaluations = self._split(history.evaluations)
        self.has_accuracy = any(event.get("accuracy") is not None for event in history.evaluations)

    def _split(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`events` per incarnation (in start order), each part's `kept` and `rolled_back` ones."""
        parts = []
        for incarnation in self.history.incarnations:
            points = [p for p in events if p["incarnation"] == incarnation.incarnation]
            limit = self.kept_until[incarnation.incarnation]
            parts.append({"incarnation": incarnation, "kept": [p for p in points if p["global_step"] <= limit],
                          "rolled_back": [p for p in points if p["global_step"] > limit]})
        return parts

    # ---------------------------------------------------------------------------------- columns

    def draw_step_column(self, loss_axis, throughput_axis, band_axis, step_format) -> None:
        for series in self.series:
            for key, style in (("rolled_back", {"color": ROLLED_BACK_COLOR, "linestyle": "--", "alpha": 0.9}),
                               ("kept", {"color": LOSS_COLOR})):
                points = series[key]
                steps = [p["global_step"] for p in points]
                loss_axis.plot(steps, [p["loss"] for p in points], linewidth=1.6, **style)
                throughput_axis.plot(steps, [p["samples_per_second"] for p in points], linewidth=1.0,
                                     color=series["color"] if key == "kept" else ROLLED_BACK_COLOR,
                                     alpha=1.0 if key == "kept" else 0.7, **self.markers)
        self._draw_held_out(loss_axis, lambda event: event["global_step"], "loss", EVAL_LOSS_STYLE)
        if self.has_accuracy:
            self._draw_held_out(self._accuracy_axis(loss_axis), lambda event: event["global_step"], "accuracy",
                                EVAL_ACCURACY_STYLE)
        for transition in self.transitions:
            self._mark_lost_work(transition, (loss_axis, throughput_axis, band_axis))
        max_step = max(1, self.max_step)
        for incarnation in self.history.incarnations:  # the world of the surviving trajectory
            start = incarnation.resumed_from_step
            end = min(incarnation.final_step, self.kept_until[incarnation.incarnation])
            if end > start:
                self._band_segment(band_axis, start, end, incarnation.world_size, span=max_step)
        self._mark_snapshots(band_axis, lambda event: event["global_step"])
        band_axis.xaxis.set_major_formatter(step_format)
        self._finish_axes(loss_axis, throughput_axis, band_axis, "global step")

    def draw_time_column(self, loss_axis, throughput_axis, band_axis, clock, locator) -> None:
        for series in self.series:
            for key in ("kept", "rolled_back"):
                points = series[key]
                seconds = [p["time"] - self.started for p in points]
                color = LOSS_COLOR if key == "kept" else ROLLED_BACK_COLOR
                loss_axis.plot(seconds, [p["loss"] for p in points], linewidth=1.6, color=color,
                               linestyle="-" if key == "kept" else "--")
                throughput_axis.plot(seconds, [p["samples_per_second"] for p in points], linewidth=1.0,
                                     color=series["color"] if key == "kept" else ROLLED_BACK_COLOR, **self.markers)
        self._draw_held_out(loss_axis, lambda event: event["time"] - self.started, "loss", EVAL_LOSS_STYLE)
        for transition in self.transitions:
            self._mark_downtime(transition, (loss_axis, throughput_axis, band_axis))
        for incarnation in self.history.incarnations:
            start = (incarnation.first_step[0] if incarnation.first_step else incarnation.start_time) - self.started
            self._band_segment(band_axis, start, incarnation.last_time - self.started, incarnation.world_size,
                               span=self.duration)
        self._mark_snapshots(band_axis, lambda event: event["time"] - self.started)
        band_axis.xaxis.set_major_formatter(clock)
        band_axis.xaxis.set_major_locator(locator(_tick_interval(self.duration)))
        self._finish_axes(loss_axis, throughput_axis, band_axis, "time since the run started")
        self._label_transitions(loss_axis)

    # ---------------------------------------------------------------------------------- held out

    def _draw_held_out(self, axis, position, metric: str, style: dict[str, Any]) -> None:
        """The evaluations' `metric` (those where it is not null) against `position(event)`: the kept
        ones as one line through all incarnations (the few evaluations of one incarnation would
        otherwise be loose dots), the rolled-back ones faint and dashed per incarnation."""
        def draw(events: list[dict[str, Any]], **overrides: Any) -> None:
            events = [event for event in events if event.get(metric) is not None]
            axis.plot([position(event) for event in events], [event[metric] for event in events],
                      **{**style, **overrides})

        for part in self.evaluations:
            draw(part["rolled_back"], color=ROLLED_BACK_COLOR, linestyle="--")
        draw([event for part in self.evaluations for event in part["kept"]])

    @staticmethod
    def _accuracy_axis(loss_axis):
        """A 0..1 y axis on the right of `loss_axis`, sharing its x axis, drawn beneath it."""
        axis = loss_axis.twinx()
        # Beneath, so that the transition labels of the loss axis stay readable over the accuracy
        # line; the loss axis's background would then hide it, so it has none.
        loss_axis.set_zorder(axis.get_zorder() + 1)
        loss_axis.patch.set_visible(False)
        axis.set_ylim(0, 1)
        axis.set_ylabel("held-out accuracy")
        axis.tick_params(labelbottom=False)
        for side in ("top", "left"):  # the loss axis draws the frame; this one only its right edge
            axis.spines[side].set_visible(False)
        return axis

    # ---------------------------------------------------------------------------------- marks

    def _mark_snapshots(self, band_axis, position) -> None:
        """Written snapshots as ticks under the band, failed writes as red crosses."""
        for events, style in ((self.history.snapshots, {"marker": "|", "markersize": 9, "color": "#222222"}),
                              (self.history.snapshot_failures, {"marker": "x", "markersize": 7, "color": "#c62828"})):
            xs = [position(event) for event in events]
            band_axis.plot(xs, [0.08] * len(xs), linestyle="none", transform=band_axis.get_xaxis_transform(), **style)

    def _mark_lost_work(self, transition: Transition, axes: Sequence[Any]) -> None:
        if transition.kind == "relaunch after finish":
            return
        color = KIND_COLORS[transition.kind]
        resumed, reached = transition.after.resumed_from_step, transition.before.final_step
        for axis in axes:
            if reached > resumed:
                axis.axvspan(resumed, reached, facecolor=color, alpha=0.10, hatch="//", edgecolor=color, linewidth=0)
            axis.axvline(resumed, color=color, linewidth=1.0, linestyle=":")
        text = (f"{transition.kind}\n{transition.before.world_size}\u2192{transition.after.world_size}, "
                f"resumed at {resumed}\n{plural(transition.lost_steps, 'step')} redone")
        x = max(reached, resumed)
        self._annotate_top(axes[0], text, x, x / max(1, self.max_step), color)

    def _mark_downtime(self, transition: Transition, axes: Sequence[Any]) -> None:
        color = KIND_COLORS[transition.kind]
        failed, resumed = transition.failed_at - self.started, transition.resumed_at - self.started
        for axis in axes:
            if transition.kind != "relaunch after finish":  # idle between two runs, not downtime
                axis.axvspan(failed, resumed, facecolor=color, alpha=0.12, linewidth=0)
            axis.axvline(failed, color=color, linewidth=1.4)

    def _label_transitions(self, axis) -> None:
        for transition in self.transitions:
            color = KIND_COLORS[transition.kind]
            text = f"{transition.kind}\n{transition.before.world_size}\u2192{transition.after.world_size}"
            if transition.kind != "relaunch after finish":
                text += f", {transition.downtime:.0f} s down"
            x = transition.failed_at - self.started
            self._annotate_top(axis, text, x, x / self.duration, color)

    def _annotate_top(self, axis, text: str, x: float, fraction: float, color: str) -> None:
        """A label at the top of `axis` beside the line at `x`: to its right, or to its left near the
        right edge, so that it stays inside the figure; moved down below earlier labels close by."""
        right_side = fraction < 0.75
        extent = (fraction, fraction + LABEL_WIDTH) if right_side else (fraction - LABEL_WIDTH, fraction)
        placed = self._labels.setdefault(id(axis), [])  # (extent, level) of the labels already there
        taken = {level for (start, end), level in placed if start < extent[1] and extent[0] < end}
        level = min(set(range(len(placed) + 1)) - taken)
        placed.append((extent, level))
        axis.annotate(text, xy=(x, 1.0), xycoords=("data", "axes fraction"),
                      xytext=(4 if right_side else -4, -4 - 34 * level), textcoords="offset points", fontsize=8,
                      color=color, va="top", ha="left" if right_side else "right", fontweight="bold")

    def _band_segment(self, axis, start: float, end: float, world_size: int | None, span: float) -> None:
        color = self.colors.get(world_size, self.colors[None])
        axis.axvspan(start, max(end, start), ymin=0.22, ymax=0.95, facecolor=color, alpha=0.85, linewidth=0)
        if (end - start) < LABEL_MIN_FRACTION * span:
            return  # too narrow for its label: the colour and the legend tell the world size
        axis.annotate(f"world {world_size if world_size is not None else '?'}", xy=((start + end) / 2, 0.58),
                      xycoords=("data", "axes fraction"), ha="center", va="center", fontsize=8, color="white",
                      fontweight="bold", annotation_clip=True)

    def _finish_axes(self, loss_axis, throughput_axis, band_axis, xlabel: str) -> None:
        losses = [event["loss"] for event in (*self.history.progress, *self.history.evaluations)
                  if event.get("loss") is not None]
        if losses and min(losses) > 0 and max(losses) / min(losses) > 100:
            loss_axis.set_yscale("log")
        loss_axis.set_ylabel("loss (mean per sample)")
        throughput_axis.set_ylabel("samples / s (all ranks)")
        throughput_axis.set_ylim(bottom=0)
        band_axis.set_yticks([])
        band_axis.set_ylabel("world", rotation=0, ha="right", va="center")
        band_axis.set_xlabel(xlabel)
        for axis in (loss_axis, throughput_axis):
            axis.grid(True, color="#e3e3e3", linewidth=0.8)
            axis.tick_params(labelbottom=False)
        for axis in (loss_axis, throughput_axis, band_axis):
            for side in ("top", "right"):
                axis.spines[side].set_visible(False)


def _titles(figure, history: RunHistory) -> None:
    summary = summarise(history)
    state = "finished" if summary.finished else "not finished"
    name = f"Run {summary.run_id}" if summary.run_id else "Run"
    figure.text(0.06, 0.955, f"{name}: {state} at step {summary.final_step}, "
                f"{plural(summary.epochs_completed, 'epoch')} in {format_duration(summary.duration_seconds)}",
                fontsize=15, fontweight="bold", ha="left")
    snapshots = summary.snapshots
    size = format_bytes(snapshots["size_bytes_max"]) if snapshots["size_bytes_max"] else "-"
    median = summary.throughput["samples_per_second_median"]
    figure.text(0.06, 0.925,
                f"{plural(summary.failures, 'failure')}, {plural(summary.joins, 'join')} over "
                f"{plural(summary.incarnations, 'incarnation')}; {plural(summary.lost_steps_total, 'step')} redone; "
                f"{summary.downtime_seconds_total:.1f} s without training; "
                f"{plural(snapshots['count'], 'snapshot')} of {size}; "
                f"{f'{median:,.0f}' if median is not None else '-'} samples/s median",
                fontsize=10.5, color="#444444", ha="left")
    figure.text(0.06, 0.895, str(history.event_log), fontsize=8.5, color="#888888", ha="left")


def _legend(figure, plot: _RunPlot, Line2D, Patch) -> None:
    handles = [Line2D([], [], color=LOSS_COLOR, linewidth=1.6, label="loss")]
    if any(series["rolled_back"] for series in plot.series):
        handles.append(Line2D([], [], color=ROLLED_BACK_COLOR, linewidth=1.6, linestyle="--",
                              label="rolled back, redone"))
    if plot.history.evaluations:
        handles.append(Line2D([], [], label="held-out loss", **EVAL_LOSS_STYLE))
    if plot.has_accuracy:
        handles.append(Line2D([], [], label="held-out accuracy", **EVAL_ACCURACY_STYLE))
    handles += [Line2D([], [], color=color, marker="o", markersize=4, linewidth=1.0, label=f"samples/s, world {size}")
                for size, color in plot.colors.items() if size is not None]
    kinds = {t.kind for t in plot.transitions}
    for kind in (kind for kind in KIND_COLORS if kind in kinds):
        if kind == "relaunch after finish":
            handles.append(Line2D([], [], color=KIND_COLORS[kind], linewidth=1.4, label=kind))
        else:
            handles.append(Patch(facecolor=KIND_COLORS[kind], alpha=0.35, edgecolor=KIND_COLORS[kind],
                                 label=f"{kind}: time without training"))
    handles.append(Line2D([], [], color="#222222", marker="|", markersize=9, linestyle="none", label="snapshot"))
    if plot.history.snapshot_failures:
        handles.append(Line2D([], [], color="#c62828", marker="x", markersize=7, linestyle="none",
                              label="snapshot write failed"))
    columns = len(handles) if len(handles) <= 7 else (len(handles) + 1) // 2
    figure.legend(handles=handles, loc="lower center", ncol=columns, frameon=False, fontsize=9,
                  bbox_to_anchor=(0.5, 0.005))
