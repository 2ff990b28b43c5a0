"""`prereg report ID`: Markdown and HTML with plots a person would rather look at than read.

Plots (matplotlib, Agg): step-time distribution per rung, the overlay oracle's two loss curves, memory per
window, loss per window, and the cost split against the ceiling (engine/report/costs.py: model load, oracle gate,
steps, process start and teardown; with `--compare`, the same question under the other schedule beside it).
Everything comes from the ledger.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

from prereg.ledger import Ledger
from prereg.state import load_state
from prereg.verdict import compute_verdict

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {"figure.dpi": 110, "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3}
    )
    return plt


def _windows_by_rung(state, verdict) -> dict[str, list[dict[str, Any]]]:
    used = {r["run"]: r["rung"] for r in verdict["rungs"] if r["run"]}
    return {used[run.run_id]: run.windows for run in state.runs if run.run_id in used and run.windows}


def plot_step_times(windows: dict[str, list[dict[str, Any]]], discard_first: int, path: Path) -> bool:
    data = {
        rung: [w["s_per_step"] for w in ws if w.get("step", 0) > discard_first and "s_per_step" in w]
        for rung, ws in windows.items()
    }
    data = {k: v for k, v in data.items() if v}
    if not data:
        return False
    plt = _plt()
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
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    drawn = False
    for index, (rung, ws) in enumerate(windows.items()):
        for style, (metric, label) in zip(["-", "--", ":"], metrics):
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
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(range(1, len(a) + 1), a, "-", color=COLOURS[0], label="baseline (HEAD)")
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


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def markdown(
    verdict: dict[str, Any],
    show: dict[str, Any],
    images: list[tuple[str, str]],
    cost_lines: list[str] | None = None,
    compare_lines: list[str] | None = None,
) -> str:
    lines = [f"# {verdict['registration']} — {show['title']}", ""]
    if verdict["post_hoc"]:
        lines += [f"> **POST-HOC**: {'; '.join(verdict['post_hoc'])}", ""]
    lines += [f"Document version {verdict['version']} (`{verdict['doc_hash'][:16]}`), profile `{show['profile']}`.", ""]
    outcome = f"**{verdict['outcome']}** (rule {verdict['rule']})" if verdict["rule"] else "**no rule fired**"
    lines += [
        f"## Outcome: {outcome}",
        "",
        f"- land: {', '.join(verdict['land']) or '—'}",
        f"- park: {', '.join(verdict['park']) or '—'}",
        "",
    ]
    lines += ["## Oracle gate", "", "| oracle | item | kind | result | observed vs bound |", "|---|---|---|---|---|"]
    for o in show["oracles"]:
        lines.append(
            f"| {o['oracle']} | {o['item']} | {o['kind']} | {'pass' if o['passed'] else '**FAIL**'} | {o['reason']} |"
        )
    if verdict["dropped"]:
        lines += [
            "",
            "Dropped: "
            + ", ".join(
                f"**{k}** ({v.get('oracle') or v.get('kill')}: {v['reason']})" for k, v in verdict["dropped"].items()
            ),
        ]
    lines += [
        "",
        "## Rungs",
        "",
        "| rung | items | status | windows | s/step median [min–max] | vram peak GiB | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in verdict["rungs"]:
        spread = r["spread"].get("s_per_step")
        step = _fmt(r["summary"].get("s_per_step")) + (f" [{spread[0]:.4g}–{spread[1]:.4g}]" if spread else "")
        lines.append(
            f"| {r['rung']} | {', '.join(r['items']) or '—'} | {r['status'] or '—'} | {r['windows']} | {step} | {_fmt(r['summary'].get('vram_peak_gib'))} | {r['why_undefined'] or ''} |"
        )
    if verdict["until_pass"]:
        lines += [
            "",
            f"Until-pass: **{verdict['until_pass']['passed'] or 'none passed'}** — {verdict['until_pass']['reason']}",
        ]
        for rejected in verdict["until_pass"]["rejected"]:
            lines.append(f"- rung {rejected['rung']} {rejected['result']}: {rejected['reason']}")
    lines += ["", "## Reads", "", "| read | value | 95% bootstrap interval | undefined because |", "|---|---|---|---|"]
    for name, value in verdict["reads"].items():
        interval = verdict["intervals"].get(name)
        lines.append(
            f"| {name} | {_fmt(value)} | {f'[{interval[0]:.4g}, {interval[1]:.4g}]' if interval else '—'} | {verdict['undefined'].get(name, '')} |"
        )
    lines += ["", "## Rules", ""]
    for trace in verdict["rules"]:
        lines.append(
            f"- {trace['rule']}: `{trace['when']}` → {('undefined: ' + trace['undefined']) if trace['undefined'] else _fmt(trace['value'])}"
        )
    lines += ["", "## Expectations", "", "| n | claim | confidence | result |", "|---|---|---|---|"]
    for e in verdict["expectations"]:
        lines.append(
            f"| {e['n']}{e.get('part') or ''} | {e['claim']} | {e['confidence']} | {e['result']}{(' — ' + e['why']) if e['why'] else ''} |"
        )
    if cost_lines is None:
        cost = verdict["cost"]
        cost_lines = [
            "## Cost",
            "",
            f"{cost['gpu_s']:.1f} device-seconds of a {cost['ceiling_gpu_s']:.0f} ceiling"
            + (" — **OVERRUN**" if cost["overrun"] else "")
            + ": "
            + ", ".join(f"{k} {v:.1f}" for k, v in cost["split"].items()),
            "",
        ]
    lines += [""] + cost_lines + (compare_lines or [])
    if images:
        lines += ["## Plots", ""]
    for title, name in images:
        lines += [f"### {title}", "", f"![{title}]({name})", ""]
    return "\n".join(lines)


def write_report(ledger: Ledger, reg_id: str, out_dir: Path, compare: str | None = None) -> list[Path]:
    """The report of reg_id; with `compare`, also the same question under the other registration's schedule, side
    by side (refused with InvalidInput, before anything is written, unless the two ask the same question)."""
    from engine.report.costs import compare_markdown, compare_schedules, cost_markdown, ladder_cost, plot_cost_split
    from prereg.audit import audit_show

    comparison = compare_schedules(ledger, reg_id, compare) if compare else None
    out_dir.mkdir(parents=True, exist_ok=True)
    state = load_state(ledger, reg_id)
    verdict = compute_verdict(ledger, reg_id)
    show = audit_show(ledger, reg_id)
    reg = state.registration()
    cost = ladder_cost(ledger, reg_id, state)
    windows = _windows_by_rung(state, verdict)
    images: list[tuple[str, str]] = []
    if plot_step_times(windows, reg.protocol.discard_first, out_dir / "step_time.png"):
        images.append(("Step time per rung", "step_time.png"))
    if plot_series(
        windows,
        [("vram_peak_gib", "lifetime peak"), ("vram_window_peak_gib", "window peak")],
        "GiB",
        "memory per window",
        out_dir / "memory.png",
    ):
        images.append(("Memory per window", "memory.png"))
    if plot_series(windows, [("loss", "loss")], "loss", "training loss per window", out_dir / "loss.png"):
        images.append(("Loss per window", "loss.png"))
    for oracle in state.oracles.values():
        if oracle.kind == "curve_overlay" and plot_overlay(
            oracle.observed, oracle.oracle, out_dir / f"overlay_{oracle.oracle}.png"
        ):
            images.append((f"Oracle {oracle.oracle}: loss-curve overlay", f"overlay_{oracle.oracle}.png"))
    written = [out_dir / "cost.png"] if plot_cost_split([(reg_id, cost)], out_dir / "cost.png") else []
    cost_lines = cost_markdown(cost, "cost.png" if written else None)
    compare_lines = None
    if comparison is not None:
        sides = [(f"{side['id']}\n({side['schedule']})", side["cost"]) for side in comparison["sides"]]
        if plot_cost_split(sides, out_dir / "cost_compare.png"):
            written.append(out_dir / "cost_compare.png")
        compare_lines = compare_markdown(
            comparison, "cost_compare.png" if out_dir / "cost_compare.png" in written else None
        )
        (out_dir / "compare.json").write_text(json.dumps(comparison, indent=1, default=str), encoding="utf-8")
        written.append(out_dir / "compare.json")
    compare_lines = (compare_lines or []) + memory_lines(state)
    text = markdown(verdict, show, images, cost_lines, compare_lines)
    (out_dir / "report.md").write_text(text, encoding="utf-8")
    page = _html(text)
    (out_dir / "report.html").write_text(page, encoding="utf-8")
    (out_dir / "verdict.json").write_text(json.dumps(verdict, indent=1, default=str), encoding="utf-8")
    (out_dir / "cost.json").write_text(json.dumps(cost, indent=1, default=str), encoding="utf-8")
    return (
        [out_dir / "report.md", out_dir / "report.html", out_dir / "verdict.json", out_dir / "cost.json"]
        + [out_dir / name for _, name in images]
        + written
    )


def memory_lines(state) -> list[str]:
    """Seed 003's forensics verdict for every rung that recorded allocation snapshots (`memory_snapshot`): what
    held the memory at the peak. A snapshot stays on the machine that ran the rung; one not found here is named."""
    from engine.memory.forensics import forensics_markdown

    lines: list[str] = []
    for run in state.runs:
        for path in run.memory_snapshots:
            if not lines:
                lines = ["## Memory forensics", ""]
            lines += [f"### rung {run.rung} (run {run.run_id})", ""]
            lines += [forensics_markdown(path), ""] if Path(path).is_file() else [f"`{path}`: not on this machine", ""]
    return lines


def _inline(text: str) -> str:
    """Escaped text with the report's inline Markdown: **bold** and `code`."""
    text = html.escape(text)
    text = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", text)
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", text)


def _html(markdown_text: str) -> str:
    """A small Markdown-to-HTML rendering of exactly what `markdown` writes (headings, lists, tables, images)."""
    out = [
        "<!doctype html><meta charset='utf-8'><title>prereg report</title>",
        "<style>body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;line-height:1.4}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.25rem .5rem}blockquote{background:#fff3cd;padding:.5rem}"
        "img{max-width:100%}</style>",
    ]
    in_table = False
    for line in markdown_text.splitlines():
        if line.startswith("|"):
            cells = [_inline(c.strip()) for c in line.strip("|").split("|")]
            if set("".join(cells)) <= set("-"):
                continue
            if not in_table:
                out.append("<table>")
                in_table = True
                out.append("<tr>" + "".join(f"<th>{c}</th>" for c in cells) + "</tr>")
            else:
                out.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
            continue
        if in_table:
            out.append("</table>")
            in_table = False
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            out.append(f"<h{level}>{_inline(line[level:].strip())}</h{level}>")
        elif line.startswith("!["):
            alt, src = line[2:].split("](")
            out.append(f"<p><img alt='{html.escape(alt)}' src='{html.escape(src.rstrip(')'))}'></p>")
        elif line.startswith("- "):
            out.append(f"<li>{_inline(line[2:])}</li>")
        elif line.startswith("> "):
            out.append(f"<blockquote>{_inline(line[2:])}</blockquote>")
        elif line.strip():
            out.append(f"<p>{_inline(line)}</p>")
    if in_table:
        out.append("</table>")
    return "\n".join(out)
