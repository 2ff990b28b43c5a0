"""prereg — the command line. One small function per verb; rich output for people, --json for tools.

Exit codes (DESIGN.md): 0 done; 2 invalid input or usage, nothing written; 3 refused by a governance rule;
4 the ledger failed verification; 1 anything unexpected.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import typer
from rich.console import Console
from rich.table import Table

from prereg.errors import InvalidInput, LedgerCorrupt, PreregError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Experiment governance: pre-register, freeze, run, decide, audit.")
audit_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Questions about everything registered, run and decided.")
app.add_typer(audit_app, name="audit")

DEFAULT_LEDGER = "ledger.db"
LedgerOption = typer.Option(None, "--ledger", help="ledger path or postgresql:// URL (default ./ledger.db or $PREREG_LEDGER)")
JsonOption = typer.Option(False, "--json", help="print one JSON object on stdout and nothing else")

out = Console(highlight=False, soft_wrap=False)
err = Console(stderr=True, highlight=False)


def ledger_url(option: str | None) -> str:
    return option or os.environ.get("PREREG_LEDGER") or DEFAULT_LEDGER


@contextmanager
def verb(as_json: bool) -> Iterator[None]:
    """Turn errors into their exit codes; in --json mode the error is the one JSON object on stdout."""
    try:
        yield
    except PreregError as error:
        payload = {"error": error.message, "where": error.where, "fix": error.fix, "exit_code": error.exit_code}
        if isinstance(error, LedgerCorrupt):
            payload["first_bad"] = error.first_bad
        if as_json:
            print(json.dumps(payload))
        else:
            err.print(f"[bold red]error[/]: {error.render()}")
        raise typer.Exit(error.exit_code) from None
    except typer.Exit:
        raise
    except Exception as error:  # anything unexpected: exit 1 with the traceback for the bug report
        if as_json:
            print(json.dumps({"error": f"unexpected: {error!r}", "exit_code": 1}))
        else:
            err.print(f"[bold red]unexpected error[/]: {error!r}")
            err.print(traceback.format_exc(), markup=False)
        raise typer.Exit(1) from None


def open_ledger(option: str | None, *, create: bool = False):
    from prereg.ledger import Ledger

    return Ledger.open(ledger_url(option), create=create)


def emit(as_json: bool, payload: dict[str, Any]) -> bool:
    if as_json:
        print(json.dumps(payload, default=str))
    return as_json


def fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


# --- verbs ----------------------------------------------------------------------------------------------------


@app.command()
def check(file: Path, as_json: bool = JsonOption) -> None:
    """Validate a registration and print the resolved plan; writes nothing."""
    from prereg.documents import document_hash, load_registration

    with verb(as_json):
        reg, _ = load_registration(file)
        payload = {"id": reg.id, "doc_hash": document_hash(reg), "valid": True, "items": [i.id for i in reg.items],
                   "rungs": [r.id for r in reg.protocol.rungs], "reads": list(reg.reads), "rules": [r.id for r in reg.rules]}
        if emit(as_json, payload):
            return
        print_plan(reg)
        out.print(f"[green]valid[/] · document {payload['doc_hash'][:16]}")


@app.command()
def freeze(file: Path, ledger: str = LedgerOption, as_json: bool = JsonOption) -> None:
    """Validate and freeze a registration; prints id, document hash, ledger head."""
    from prereg.actions import freeze as do_freeze

    with verb(as_json):
        store = open_ledger(ledger, create=True)
        result = do_freeze(store, file)
        payload = {"id": result.reg_id, "doc_hash": result.doc_hash, "head": result.head, "seq": result.seq, "already_frozen": result.already}
        if emit(as_json, payload):
            return
        state = "already frozen (no-op)" if result.already else "frozen"
        out.print(f"{result.reg_id} {state} · document {result.doc_hash[:16]} · entry {result.seq} · head {result.head[:16]}")


@app.command()
def amend(reg_id: str, file: Path, post_hoc: bool = typer.Option(False, "--post-hoc", help="accept a change to something already measured; flagged forever"),
          ledger: str = LedgerOption, as_json: bool = JsonOption) -> None:
    """Append an amendment to a frozen registration."""
    from prereg.actions import amend as do_amend

    with verb(as_json):
        store = open_ledger(ledger)
        entry, flagged = do_amend(store, reg_id, file, post_hoc=post_hoc)
        payload = {"id": reg_id, "version": entry.data["version"], "doc_hash": entry.data["doc_hash"], "changed": entry.data["changed"],
                   "post_hoc": list(flagged), "seq": entry.seq, "head": entry.head}
        if emit(as_json, payload):
            return
        out.print(f"{reg_id} amendment {payload['version']} · changed {', '.join(payload['changed'])} · entry {entry.seq} · head {entry.head[:16]}")
        if flagged:
            out.print(f"[bold yellow]POST-HOC[/]: {', '.join(flagged)} — printed on every verdict, report and audit line that depends on it")


@app.command()
def record(reg_id: str, file: Path, ledger: str = LedgerOption, as_json: bool = JsonOption) -> None:
    """Enter measurements made outside the engine (marked external, judged by the same rules)."""
    from prereg.actions import record as do_record

    with verb(as_json):
        store = open_ledger(ledger)
        entries = do_record(store, reg_id, file)
        oracles = [e.data for e in entries if e.kind == "oracle"]
        rungs = next(e.data["rungs"] for e in entries if e.kind == "record")
        payload = {"id": reg_id, "oracles": {o["oracle"]: {"passed": o["passed"], "reason": o["reason"]} for o in oracles},
                   "rungs": {k: {"status": v["status"], "flagged": v["flagged"]} for k, v in rungs.items()},
                   "head": entries[-1].head, "seq": entries[-1].seq}
        if emit(as_json, payload):
            return
        for o in oracles:
            mark = "[green]pass[/]" if o["passed"] else "[red]FAIL → item dropped[/]"
            out.print(f"oracle {o['oracle']} ({o['item']}): {mark} · {o['reason']}")
        for rung_id, rung in rungs.items():
            flag = f" · [yellow]flagged, kept out of every read[/]: {rung['flagged']}" if rung["flagged"] else ""
            out.print(f"rung {rung_id}: {rung['status']}{flag}")
        out.print(f"recorded · entry {entries[-1].seq} · head {entries[-1].head[:16]}")


@app.command()
def run(reg_id: str, dry_run: bool = typer.Option(False, "--dry-run", help="check and print the plan; run nothing"),
        file: Path = typer.Option(None, "--file", help="the registration file (default: registrations/<frozen file name>)"),
        budget_s: float = typer.Option(None, "--budget-s", help="stop cleanly before this many seconds and leave the ladder resumable"),
        ledger: str = LedgerOption, as_json: bool = JsonOption) -> None:
    """Oracle gate, then the ladder; resumes an interrupted ladder."""
    with verb(as_json):
        from engine.ladder import run_ladder

        store = open_ledger(ledger)
        summary = run_ladder(store, reg_id, file=file, dry_run=dry_run, budget_s=budget_s, console=None if as_json else out)
        emit(as_json, summary)


@app.command()
def verdict(reg_id: str, ledger: str = LedgerOption, as_json: bool = JsonOption) -> None:
    """Apply the frozen rules to what was measured; record and print the verdict."""
    from prereg.verdict import record_verdict

    with verb(as_json):
        store = open_ledger(ledger)
        result, appended = record_verdict(store, reg_id)
        seq, head = store.head()
        if emit(as_json, {**result, "recorded": appended, "head": head}):
            return
        print_verdict(result)
        out.print(f"verdict {'recorded' if appended else 'unchanged (already recorded)'} · ledger head {head[:16]} (entry {seq})")


@app.command()
def report(reg_id: str, out_dir: Path = typer.Option(None, "--out", help="directory (default reports/<id>)"),
           ledger: str = LedgerOption, as_json: bool = JsonOption) -> None:
    """A Markdown and HTML report with plots."""
    with verb(as_json):
        from engine.report import write_report

        store = open_ledger(ledger)
        paths = write_report(store, reg_id, out_dir or Path("reports") / reg_id)
        if emit(as_json, {"id": reg_id, "files": [str(p) for p in paths]}):
            return
        for path in paths:
            out.print(str(path))


# --- audit ----------------------------------------------------------------------------------------------------


@audit_app.command("list")
def audit_list(ledger: str = LedgerOption, as_json: bool = JsonOption) -> None:
    """Every registration: status, versions, outcome."""
    from prereg.audit import audit_list as query

    with verb(as_json):
        rows = query(open_ledger(ledger))
        if emit(as_json, {"registrations": rows}):
            return
        table = Table("id", "status", "versions", "outcome", "profile", "frozen", title="registrations")
        for row in rows:
            outcome = fmt(row["outcome"]) + (" [bold yellow]POST-HOC[/]" if row["post_hoc"] else "")
            table.add_row(row["id"], row["status"], str(row["versions"]), outcome, row["profile"], row["frozen"][:19])
        out.print(table)


@audit_app.command("show")
def audit_show(reg_id: str, ledger: str = LedgerOption, as_json: bool = JsonOption) -> None:
    """One registration's whole history."""
    from prereg.audit import audit_show as query

    with verb(as_json):
        store = open_ledger(ledger)
        shown = query(store, reg_id)
        if emit(as_json, shown):
            return
        out.print(f"[bold]{shown['id']}[/] — {shown['title']}  ({shown['status']}, profile {shown['profile']})")
        versions = Table("v", "entry", "time", "document", "reason", title="versions")
        for v in shown["versions"]:
            reason = (v["reason"] or "frozen") + (f" [bold yellow]POST-HOC {', '.join(v['post_hoc'])}[/]" if v["post_hoc"] else "")
            versions.add_row(str(v["version"]), str(v["seq"]), v["ts"][:19], v["doc_hash"][:12], reason)
        out.print(versions)
        if shown["oracles"]:
            oracles = Table("oracle", "item", "kind", "result", "observed vs bound", "source", title="oracles")
            for o in shown["oracles"]:
                oracles.add_row(o["oracle"], o["item"], o["kind"], "[green]pass[/]" if o["passed"] else "[red]fail[/]", o["reason"],
                                "external" if o["external"] else "engine")
            out.print(oracles)
        if shown["runs"]:
            runs = Table("rung", "run", "status", "windows", "items", "v", "note", title="runs")
            for r in shown["runs"]:
                note = r["flagged"] and f"[yellow]flagged: {r['flagged']}[/]" or (r["kill"] and f"killed by {r['kill']['kill']} at step {r['kill'].get('step')}") or (r["provenance"] or "")
                runs.add_row(r["rung"], r["run"], r["status"], str(r["windows"]), ",".join(r["items"]) or "—", str(r["version"]), note)
            out.print(runs)
        if shown["verdict"]:
            v = shown["verdict"]
            hits = " ".join(f"{e['n']}:{e['result']}" for e in v["expectations"])
            out.print(f"verdict (entry {v['seq']}): [bold]{fmt(v['outcome'])}[/] by rule {fmt(v['rule'])} · land {v['land'] or '—'} · park {v['park'] or '—'} · expectations {hits or '—'}")
        if shown["post_hoc"]:
            out.print(f"[bold yellow]POST-HOC[/]: {'; '.join(shown['post_hoc'])}")
        seq, head = store.head()
        out.print(f"ledger head {head[:16]} (entry {seq})")


@audit_app.command("verify")
def audit_verify(published_head: str = typer.Option(None, "--head", help="a head published earlier; truncation past it is caught"),
                 ledger: str = LedgerOption, as_json: bool = JsonOption) -> None:
    """Recompute the hash chain; name the first bad entry. Exit 4 when it fails."""
    with verb(as_json):
        store = open_ledger(ledger)
        report = store.verify(published_head=published_head)
        payload = {"ok": report.ok, "entries": report.entries, "head": report.head, "first_bad": report.first_bad, "reason": report.reason}
        if not emit(as_json, payload):
            if report.ok:
                out.print(f"[green]ok[/] · {report.entries} entries · head {report.head}")
            else:
                err.print(f"[bold red]ledger failed verification[/] at entry {report.first_bad}: {report.reason}")
        if not report.ok:
            raise typer.Exit(LedgerCorrupt.exit_code)


@audit_app.command("costs")
def audit_costs(ledger: str = LedgerOption, as_json: bool = JsonOption) -> None:
    """GPU-seconds per registration against its ceiling; overruns are shown, never hidden."""
    from prereg.audit import audit_costs as query

    with verb(as_json):
        rows = query(open_ledger(ledger))
        if emit(as_json, {"registrations": rows}):
            return
        table = Table("id", "GPU-s", "ceiling GPU-s", "load", "oracle", "steps", "overrun", title="costs")
        for row in rows:
            split = row["split"]
            table.add_row(row["id"], fmt(row["gpu_s"]), fmt(row["ceiling_gpu_s"]), fmt(split["load"]), fmt(split["oracle"]), fmt(split["steps"]),
                          "[red]OVERRUN[/]" if row["overrun"] else "no")
        out.print(table)


@audit_app.command("calibration")
def audit_calibration(ledger: str = LedgerOption, as_json: bool = JsonOption) -> None:
    """Expectation hits per confidence level, and the Brier score."""
    from prereg.audit import audit_calibration as query

    with verb(as_json):
        result = query(open_ledger(ledger))
        if emit(as_json, result):
            return
        table = Table("confidence", "p", "scored", "hits", "hit rate", "undefined", title="calibration")
        for row in result["levels"]:
            table.add_row(row["confidence"], fmt(row["p"]), str(row["n"]), str(row["hits"]), fmt(row["hit_rate"]), str(row["undefined"]))
        out.print(table)
        out.print(f"Brier score {fmt(result['brier'])} over {result['scored']} scored expectations")


@audit_app.command("export")
def audit_export(out_file: Path = typer.Option(None, "--out", help="write JSONL here (default: stdout)"), ledger: str = LedgerOption) -> None:
    """Every entry as JSONL (first line: the ledger's name); `import` re-verifies it."""
    with verb(False):
        store = open_ledger(ledger)
        if out_file is None:
            store.export_jsonl(sys.stdout)
        else:
            with out_file.open("w", encoding="utf-8") as handle:
                count = store.export_jsonl(handle)
            err.print(f"{count} entries → {out_file}")


@audit_app.command("import")
def audit_import(file: Path, ledger: str = LedgerOption, as_json: bool = JsonOption) -> None:
    """Load a JSONL export into a new, empty ledger; the chain is re-verified first."""
    from prereg.ledger import Ledger

    with verb(as_json):
        url = ledger_url(ledger)
        with file.open(encoding="utf-8") as handle:
            store = Ledger.import_jsonl(handle, url)
        seq, head = store.head()
        if not emit(as_json, {"entries": seq, "head": head}):
            out.print(f"imported {seq} entries · head {head}")


# --- rendering ------------------------------------------------------------------------------------------------


def print_plan(reg) -> None:
    out.print(f"[bold]{reg.id}[/] — {reg.title}")
    out.print(f"workload {reg.workload} · profile {reg.profile} · {reg.protocol.kind}/{reg.protocol.schedule} · {reg.protocol.steps} steps, "
              f"log every {reg.protocol.log_every}, discard {reg.protocol.discard_first} · ceiling {reg.cost.ceiling_gpu_h} GPU-h ({reg.cost.on_ceiling})")
    if reg.items:
        items = Table("item", "switch", "bitwise", "oracle", "kind", "probe", "bounds", title="items and their oracles")
        for item in reg.items:
            for index, oracle in enumerate(item.oracles):
                bounds = ", ".join(f"{k} ≤ {v:g}" for k, v in oracle.bounds.items()) or "—"
                items.add_row(item.id if index == 0 else "", item.switch if index == 0 else "", fmt(item.bitwise) if index == 0 else "",
                              oracle.id, oracle.kind, oracle.probe, bounds)
        out.print(items)
    rungs = Table("rung", "items", "config", title="ladder")
    for rung in reg.protocol.rungs:
        rungs.add_row(rung.id, ", ".join(rung.items) or "— (baseline)", json.dumps(reg.rung_config(rung.id)))
    out.print(rungs)
    if reg.protocol.pass_rule:
        out.print(f"pass rule: {reg.protocol.pass_rule}")
    for name, text in reg.reads.items():
        out.print(f"read {name} = {text}")
    for rule in reg.rules:
        out.print(f"rule {rule.id}: when {rule.when} → {rule.outcome}")
    for kill in reg.kill:
        out.print(f"kill {kill.id} (at {kill.at}): {kill.when}" + (f" → drops {kill.drops}" if kill.drops else ""))


def print_verdict(v: dict[str, Any]) -> None:
    out.print(f"[bold]{v['registration']}[/] — verdict under document version {v['version']} ({v['doc_hash'][:12]})")
    if v["post_hoc"]:
        out.print(f"[bold yellow]POST-HOC[/]: {'; '.join(v['post_hoc'])}")
    if v["dropped"]:
        dropped = Table("item", "cause", "observed vs bound", title="dropped items")
        for item, why in v["dropped"].items():
            cause = f"oracle {why['oracle']}" if why["cause"] == "oracle" else f"kill {why['kill']} on rung {why['rung']}"
            dropped.add_row(item, cause, why["reason"])
        out.print(dropped)
    rungs = Table("rung", "items", "status", "windows", "s/step (median [min–max])", "vram peak GiB", "note", title="rungs")
    for r in v["rungs"]:
        spread = r["spread"].get("s_per_step")
        step = fmt(r["summary"].get("s_per_step")) + (f" [{spread[0]:.4g}–{spread[1]:.4g}]" if spread else "")
        rungs.add_row(r["rung"], ", ".join(r["items"]) or "—", fmt(r["status"]), str(r["windows"]), step,
                      fmt(r["summary"].get("vram_peak_gib")), r["why_undefined"] or ("external" if r["external"] else ""))
    out.print(rungs)
    if v["until_pass"]:
        for rejected in v["until_pass"]["rejected"]:
            out.print(f"rung {rejected['rung']} {rejected['result']}: {rejected['reason']}")
        out.print(f"until-pass: [bold]{v['until_pass']['passed'] or 'none passed'}[/] — {v['until_pass']['reason']}")
    if v["reads"]:
        reads = Table("read", "value", "95% interval", "undefined because", title="reads")
        for name, value in v["reads"].items():
            interval = v["intervals"].get(name)
            reads.add_row(name, fmt(value), f"[{interval[0]:.4g}, {interval[1]:.4g}]" if interval else "—", v["undefined"].get(name, ""))
        out.print(reads)
    for trace in v["rules"]:
        state = "undefined: " + trace["undefined"] if trace["undefined"] else fmt(trace["value"])
        out.print(f"rule {trace['rule']}: {trace['when']} → {state}")
    if v["rule"]:
        out.print(f"[bold]outcome: {v['outcome']}[/] (rule {v['rule']}) · land {', '.join(v['land']) or '—'} · park {', '.join(v['park']) or '—'}")
    else:
        out.print("[bold]outcome: none[/] — no rule fired")
    if v["expectations"]:
        exp = Table("n", "claim", "confidence", "result", title="expectations")
        for e in v["expectations"]:
            colour = {"hit": "green", "miss": "red"}.get(e["result"], "yellow")
            exp.add_row(str(e["n"]) + (e.get("part") or ""), e["claim"], e["confidence"], f"[{colour}]{e['result']}[/]" + (f" ({e['why']})" if e["why"] else ""))
        out.print(exp)
    cost = v["cost"]
    overrun = " [red]OVERRUN[/]" if cost["overrun"] else ""
    out.print(f"cost: {cost['gpu_s']:.1f} device-s of {cost['ceiling_gpu_s']:.0f} ceiling (load {cost['split']['load']:.1f}, oracle {cost['split']['oracle']:.1f}, steps {cost['split']['steps']:.1f}){overrun}")


if __name__ == "__main__":
    app()
