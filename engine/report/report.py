"""`prereg report ID`: Markdown and HTML with plots a person would rather look at than read.

Plots (engine/report/plots.py): step-time distribution per rung, loss per window, each per-window plot the
workload's metrics name (`Metric.plot`), the overlay oracle's two loss curves, the cost split against the
ceiling (engine/report/costs.py: model load, oracle gate, steps, process start and teardown; with `--compare`,
the same question under the other schedule beside it), and each compared read's bootstrap distribution against
its bar. The sensitivity section: each bar's power before the data (prereg.power.power_before_data) and each
compared read's flip probability after it. Everything comes from the ledger.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

from engine.report.costs import compare_markdown, compare_schedules, cost_markdown
from engine.report.plots import plot_cost_split, plot_overlay, plot_robustness, plot_series, plot_step_times
from prereg.audit import audit_show
from prereg.cost import ladder_cost
from prereg.display import cell, heading, rung_metrics
from prereg.ledger import Ledger
from prereg.power import every_state, power_before_data
from prereg.sensitivity import Assessment
from prereg.state import load_state
from prereg.verdict import verdict_detail
from prereg.workload import Metric, WorkloadDeclaration


def _windows_by_rung(state, verdict) -> dict[str, list[dict[str, Any]]]:
    used = {r["run"]: r["rung"] for r in verdict["rungs"] if r["run"]}
    return {used[run.run_id]: run.windows for run in state.runs if run.run_id in used and run.windows}


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def rung_table(workload: WorkloadDeclaration, rungs: list[dict[str, Any]]) -> list[str]:
    """The verdict's rungs as a Markdown table: the window fields, then the metrics the workload displays."""
    metrics = rung_metrics(workload, rungs)
    columns = ["rung", "items", "status", "windows", *(heading(m) for m in metrics), "note"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rungs:
        values = [r["rung"], ", ".join(r["items"]) or "—", r["status"] or "—", str(r["windows"])]
        values += [cell(m, r) for m in metrics] + [r["why_undefined"] or ""]
        lines.append("| " + " | ".join(values) + " |")
    return lines


def markdown(
    verdict: dict[str, Any],
    show: dict[str, Any],
    workload: WorkloadDeclaration,
    images: list[tuple[str, str]],
    cost_lines: list[str] | None = None,
    compare_lines: list[str] | None = None,
    sensitivity_lines: list[str] | None = None,
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
    lines += assumed_lines(show)
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
    lines += ["", "## Rungs", ""] + rung_table(workload, verdict["rungs"])
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
            f"| {name} | {_fmt(value)} | {f'[{interval[0]:.4g}, {interval[1]:.4g}]' if interval else '—'}"
            f" | {verdict['undefined'].get(name, '')} |"
        )
    lines += ["", "## Rules", ""]
    for trace in verdict["rules"]:
        lines.append(
            f"- {trace['rule']}: `{trace['when']}` → "
            + (f"undefined: {trace['undefined']}" if trace["undefined"] else _fmt(trace["value"]))
        )
    lines += ["", "## Expectations", "", "| n | claim | confidence | result |", "|---|---|---|---|"]
    for e in verdict["expectations"]:
        lines.append(
            f"| {e['n']}{e.get('part') or ''} | {e['claim']} | {e['confidence']}"
            f" | {e['result']}{(' — ' + e['why']) if e['why'] else ''} |"
        )
    lines += sensitivity_lines or []
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
    comparison = compare_schedules(ledger, reg_id, compare) if compare else None
    out_dir.mkdir(parents=True, exist_ok=True)
    state = load_state(ledger, reg_id)
    detail = verdict_detail(ledger, reg_id)
    verdict = detail.verdict
    show = audit_show(ledger, reg_id)
    reg = state.registration()
    workload = reg.declaration()
    cost = ladder_cost(ledger, reg_id, state)
    windows = _windows_by_rung(state, verdict)
    images: list[tuple[str, str]] = []
    if plot_step_times(windows, reg.protocol.discard_first, out_dir / "step_time.png"):
        images.append(("Step time per rung", "step_time.png"))
    for name, metrics in declared_plots(workload).items():
        series = [(m.name, m.heading) for m in metrics]
        if plot_series(windows, series, metrics[0].unit, f"{name} per window", out_dir / f"{name}.png"):
            images.append((f"{name.capitalize()} per window", f"{name}.png"))
    if plot_series(windows, [("loss", "loss")], "loss", "training loss per window", out_dir / "loss.png"):
        images.append(("Loss per window", "loss.png"))
    for oracle in state.oracles.values():
        if oracle.kind == "curve_overlay" and plot_overlay(
            oracle.observed, oracle.oracle, out_dir / f"overlay_{oracle.oracle}.png"
        ):
            images.append((f"Oracle {oracle.oracle}: loss-curve overlay", f"overlay_{oracle.oracle}.png"))
    robustness_plot = plot_robustness(detail.draws, verdict["robustness"], detail.compared, out_dir / "robustness.png")
    if robustness_plot:
        images.append(("Each compared read's bootstrap distribution against its bar", "robustness.png"))
    before = power_before_data(ledger, state, every_state(ledger))
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
    compare_lines = (compare_lines or []) + memory_lines(state, workload.activation_frames)
    text = markdown(verdict, show, workload, images, cost_lines, compare_lines, sensitivity_markdown(before, verdict))
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


def assumed_lines(show: dict[str, Any]) -> list[str]:
    """Which values are the source's and which the encoder assumed (prereg.assumed), when either can be said."""
    source = show.get("source")
    if not show["assumed"]:
        return [f"Every value is the source's ({source}).", ""] if source else []
    lines = ["## Values assumed by the encoder", "", "| field | value | why |", "|---|---|---|"]
    for a in show["assumed"]:
        lines.append(f"| `{a['path']}` | `{json.dumps(a['value'])}` | {a['reason']} |")
    other = f"the source's ({source})" if source else "the author's"
    return lines + ["", f"Every other value is {other}.", ""]


def sensitivity_markdown(before: Assessment, verdict: dict[str, Any]) -> list[str]:
    """Each bar's power before the data, then each compared read's robustness after it."""
    lines = ["", "## Sensitivity", ""]
    if not before.rows:
        return lines + ["No rule compares a read with a constant.", ""]
    windows = before.rows[0].windows_per_rung
    lines += [
        f"Before the data, at {windows} read windows per rung (MDE: two-sided 5%, power 80%):",
        "",
        "| read | rule | bar | noise CV | noise from | SE | MDE | windows needed | powered |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in before.rows:
        powered = {True: "yes", False: "**no**", None: "—"}[row.powered]
        lines.append(
            f"| {row.read} | {row.rule} | {row.bar:g} | {_fmt(row.noise_cv)} | {row.noise_source} | {_fmt(row.se)}"
            f" | {_fmt(row.mde)} | {_fmt(row.windows_needed)} | {powered} |"
        )
    notes: dict[tuple[str, str], list[str]] = {}
    for note in before.notes_json():
        notes.setdefault((note["read"], note["note"]), []).append(note["rule"])
    lines += [""] + [f"- {read} ({', '.join(rules)}): {note}" for (read, note), rules in notes.items()]
    lines += ["", "After the data: the share of bootstrap resamples on the other side of each compared read's bar.", ""]
    lines += ["| read | bar | value | flip probability | fragile |", "|---|---|---|---|---|"]
    for read, entry in verdict["robustness"].items():
        fragile = {True: "**fragile**", False: "no", None: "—"}[entry["fragile"]]
        value = verdict["reads"].get(read)
        lines.append(f"| {read} | {entry['bar']:g} | {_fmt(value)} | {_fmt(entry['flip_probability'])} | {fragile} |")
    return lines + [""]


def declared_plots(workload: WorkloadDeclaration) -> dict[str, list[Metric]]:
    """plot name -> the metrics drawn on it, in catalogue order (`Metric.plot`)."""
    plots: dict[str, list[Metric]] = {}
    for metric in workload.metrics.values():
        if metric.plot:
            plots.setdefault(metric.plot, []).append(metric)
    return plots


def memory_lines(state, activation_frames: frozenset[str] = frozenset()) -> list[str]:
    """The memory forensics for every rung that recorded allocation snapshots: what held the memory at the peak,
    read with the workload's own activation frames. A snapshot stays on the machine that ran the rung; one not
    found here is named."""
    from engine.memory.forensics import forensics_markdown

    lines: list[str] = []
    for run in state.runs:
        for path in run.memory_snapshots:
            if not lines:
                lines = ["## Memory forensics", ""]
            lines += [f"### rung {run.rung} (run {run.run_id})", ""]
            if Path(path).is_file():
                lines += [forensics_markdown(path, activation_frames=activation_frames), ""]
            else:
                lines += [f"`{path}`: not on this machine", ""]
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
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.25rem .5rem}"
        "blockquote{background:#fff3cd;padding:.5rem}"
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
