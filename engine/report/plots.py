"""The report's plots (matplotlib, Agg): step time per rung, per-window series, the overlay oracle's two loss
curves, the cost split against the ceiling, and each compared read's bootstrap distribution against its bar.
Each returns whether it drew anything."""

from __future__ import annotations

from itertools import cycle
from pathlib import Path
from typing import Any

from prereg.cost import PARTS

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]
PART_COLOURS = {
    "load": "#d62728",
    "oracle_gate": "#9467bd",
    "steps_warmup": "#aec7e8",
    "steps_read": "#1f77b4",
    "other": "#7f7f7f",
    "external": "#2ca02c",
    "interrupted": "#ff7f0e",
    "unsplit": "#bcbd22",
}


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display), in the report's style."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {"figure.dpi": 110, "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3}
    )
    return plt


def plot_step_times(windows: dict[str, list[dict[str, Any]]], discard_first: int, path: Path) -> bool:
    data = {
        rung: [w["s_per_step"] for w in ws if w.get("step", 0) > discard_first and "s_per_step" in w]
        for rung, ws in windows.items()
    }
    data = {k: v for k, v in data.items() if v}
    if not data:
        return False
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels = list(data)
    ax.boxplot([data[k] for k in labels], tick_labels=labels, widths=0.5, showfliers=False)
    for index, label in enumerate(labels, start=1):
        values = data[label]
        jitter = [index + 0.12 * ((i % 5) - 2) / 2 for i in range(len(values))]
        ax.scatter(jitter, values, s=14, alpha=0.7, color=COLOURS[(index - 1) % len(COLOURS)], zorder=3)
    ax.set_ylabel("seconds per step (per window median)")
    ax.set_title(f"step time per rung (windows after step {discard_first})")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def plot_series(
    windows: dict[str, list[dict[str, Any]]], metrics: list[tuple[str, str]], ylabel: str, title: str, path: Path
) -> bool:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    drawn = False
    for index, (rung, ws) in enumerate(windows.items()):
        for style, (metric, label) in zip(cycle(["-", "--", ":"]), metrics):
            points = [(w["step"], w[metric]) for w in ws if metric in w]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, style, marker="o", ms=3, color=COLOURS[index % len(COLOURS)], label=f"{rung} {label}")
                drawn = True
    if not drawn:
        plt.close(fig)
        return False
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def plot_overlay(observed: dict[str, Any], oracle_id: str, path: Path) -> bool:
    a, b = observed.get("curve_a"), observed.get("curve_b")
    if not a or not b:
        return False
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(range(1, len(a) + 1), a, "-", color=COLOURS[0], label="baseline")
    ax.plot(range(1, len(b) + 1), b, "--", color=COLOURS[1], label="item")
    band = observed.get("band")
    if isinstance(band, (int, float)):
        ax.fill_between(
            range(1, len(a) + 1),
            [v - band for v in a],
            [v + band for v in a],
            color=COLOURS[0],
            alpha=0.15,
            label=f"baseline ± band ({band:.3g})",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(
        f"oracle {oracle_id}: loss-curve overlay (max |A−B| = {observed.get('max_abs_diff', float('nan')):.3g})"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def plot_cost_split(costs: list[tuple[str, dict[str, Any]]], path: Path) -> bool:
    """One stacked horizontal bar per registration, its parts in PARTS order, the ceiling as a dashed line."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 1.6 + 0.7 * len(costs)))
    labelled: set[str] = set()
    widest = 0.0
    for row, (_, cost) in enumerate(reversed(costs)):
        left = 0.0
        for name in PARTS:
            value = cost["split"].get(name, 0.0)
            if value <= 0:
                continue
            ax.barh(
                [row],
                [value],
                left=left,
                color=PART_COLOURS[name],
                edgecolor="white",
                height=0.6,
                label=PARTS[name] if name not in labelled else None,
            )
            if value >= 0.08 * max(cost["ceiling_gpu_s"], cost["gpu_s"]):
                ax.text(left + value / 2, row, f"{value:.0f}", ha="center", va="center", fontsize=7, color="white")
            labelled.add(name)
            left += value
        ax.text(
            left, row, f"  {left:.0f} s ({100 * left / cost['ceiling_gpu_s']:.0f}% of ceiling)", va="center", fontsize=8
        )
        widest = max(widest, left, cost["ceiling_gpu_s"])
    ceilings = sorted({c["ceiling_gpu_s"] for _, c in costs})
    for ceiling in ceilings:
        ax.axvline(ceiling, color="black", linestyle="--", linewidth=1)
        ax.text(ceiling, len(costs) - 0.45, f"ceiling {ceiling:.0f}", ha="right", va="bottom", fontsize=8)
    ax.set_yticks(range(len(costs)), [label for label, _ in reversed(costs)])
    ax.set_xlabel("device-seconds")
    ax.set_xlim(0, widest * 1.25)
    ax.set_ylim(-0.6, len(costs) - 0.1)
    ax.grid(axis="y", visible=False)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    ax.set_title("what the ladder cost, against the ceiling")
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return True


def plot_robustness(
    draws: dict[str, list[float]], compared: dict[str, dict[str, Any]], values: dict[str, Any], path: Path
) -> bool:
    """One panel per compared read with draws: the histogram of its bootstrap draws, its bar (dashed) and its
    value (solid), titled with the share of draws across the bar (`compared`: read -> robustness entry)."""
    shown = [read for read, entry in compared.items() if draws.get(read) and entry["flip_probability"] is not None]
    if not shown:
        return False
    plt = pyplot()
    fig, axes = plt.subplots(len(shown), 1, figsize=(7, 2.4 * len(shown)), squeeze=False)
    for ax, read in zip(axes[:, 0], shown):
        entry = compared[read]
        ax.hist(draws[read], bins=40, color=COLOURS[0], alpha=0.75)
        ax.axvline(entry["bar"], color=COLOURS[1], linestyle="--", linewidth=1.5, label=f"bar {entry['bar']:g}")
        if isinstance(values.get(read), (int, float)):
            ax.axvline(values[read], color="black", linewidth=1.2, label=f"value {values[read]:.4g}")
        fragile = " — fragile" if entry["fragile"] else ""
        ax.set_title(f"{read}: {entry['flip_probability']:.0%} of resamples across the bar{fragile}", fontsize=9)
        ax.set_ylabel("resamples")
        ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("the read's value in a bootstrap resample")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
