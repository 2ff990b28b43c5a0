"""What a person sees of a rung, for any workload: the window fields every workload reports, then the metrics its
declaration marks `display` (prereg.workload.Metric). The CLI's tables and the report's ask here, so the two
show the same columns under the same headings."""

from __future__ import annotations

from typing import Any

from prereg.workload import WINDOW_FIELDS, Metric, WorkloadDeclaration

# The window fields' headings; the s/step column also shows the spread of the read windows.
HEADINGS = {"steps": "steps", "s_per_step": "s/step (median [min–max])", "loss": "loss", "finite": "finite"}


def rung_metrics(workload: WorkloadDeclaration, rungs: list[dict[str, Any]]) -> list[Metric]:
    """The metrics a table of these rungs (the verdict's `rungs`) shows: the window fields the workload's
    catalogue has, then every metric it marks `display` that some rung measured (a column of dashes says nothing)."""
    shown = [workload.metrics[name] for name in WINDOW_FIELDS if name in workload.metrics]
    return shown + [
        metric
        for metric in workload.metrics.values()
        if metric.display
        and metric.name not in WINDOW_FIELDS
        and any(rung["summary"].get(metric.name) is not None for rung in rungs)
    ]


def heading(metric: Metric) -> str:
    return HEADINGS.get(metric.name, metric.heading)


def cell(metric: Metric, rung: dict[str, Any]) -> str:
    """A rung's value of the metric as the tables write it; s/step with the spread of its read windows."""
    text = metric.written(rung["summary"].get(metric.name))
    spread = rung["spread"].get(metric.name) if metric.name == "s_per_step" else None
    if spread:
        text += f" [{format(spread[0], metric.format)}–{format(spread[1], metric.format)}]"
    return text
