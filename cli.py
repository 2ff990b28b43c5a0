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
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from prereg.errors import LedgerCorrupt, PreregError


class JsonUsageErrors(TyperGroup):
    """With --json, a usage error (a missing argument, an unknown option) is the one JSON object on stdout too:
    click would print it to stderr and leave stdout empty, and a tool reading stdout would get nothing to parse."""

    def main(
        self,
        args: Any = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        words = list(sys.argv[1:] if args is None else args)
        if "--json" not in words:
            return super().main(words, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(words, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.TyperException as error:  # click's ClickException (typer vendors click)
            print(
                json.dumps(
                    {
                        "error": error.format_message(),
                        "where": None,
                        "fix": "see `prereg COMMAND --help`",
                        "exit_code": error.exit_code,
                    }
                )
            )
            code = error.exit_code
        # Non-standalone click returns an Exit's code (None after a normal return) instead of exiting.
        code = code if isinstance(code, int) else 0
        if not standalone_mode:
            return code
        sys.exit(code)


app = typer.Typer(
    cls=JsonUsageErrors,
    add_completion=False,
    no_args_is_help=True,
    help="Experiment governance: pre-register, freeze, run, decide, audit.",
)
audit_app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Questions about everything registered, run and decided."
)
app.add_typer(audit_app, name="audit")

DEFAULT_LEDGER = "ledger.db"
LedgerOption = typer.Option(
    None, "--ledger", help="ledger path or postgresql:// URL (default ./ledger.db or $PREREG_LEDGER)"
)
JsonOption = typer.Option(False, "--json", help="print one JSON object on stdout and nothing else")

out = Console(highlight=False, soft_wrap=False)
# soft_wrap: an error names a file path and a field path that people copy; hard wrapping would break them.
err = Console(stderr=True, highlight=False, soft_wrap=True)


def ledger_url(option: str | None) -> str:
    return option or os.environ.get("PREREG_LEDGER") or DEFAULT_LEDGER


@contextmanager
def verb(as_json: bool) -> Iterator[None]:
    """Turn errors into their exit codes; in --json mode the error is the one JSON object on stdout."""
    global out, err
    # Fresh consoles per invocation: the terminal (or COLUMNS) of this call decides the width, not the first import's.
    out = Console(highlight=False, soft_wrap=False)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        yield
    except PreregError as error:
        payload = {"error": error.message, "where": error.where, "fix": error.fix, "exit_code": error.exit_code}
        if isinstance(error, LedgerCorrupt):
            payload["first_bad"] = error.first_bad
        if as_json:
            print(json.dumps(payload))
        else:
            err.print(f"[bold red]error[/]: {esc(error.render())}")
        raise typer.Exit(error.exit_code) from None
    except typer.Exit:
        raise
    except Exception as error:  # anything unexpected: exit 1 with the traceback for the bug report
        if as_json:
            print(json.dumps({"error": f"unexpected: {error!r}", "exit_code": 1}))
        else:
            err.print(f"[bold red]unexpected error[/]: {esc(repr(error))}")
            err.print(traceback.format_exc(), markup=False)
        raise typer.Exit(1) from None


def open_ledger(option: str | None, *, create: bool = False, reconcile: bool = True):
    """The ledger, with every run whose process is gone recorded `interrupted` first (engine/reconcile.py): no
    verb reads a run as running once its process is gone. Verification and export read the entries as stored."""
    from prereg.ledger import Ledger

    store = Ledger.open(ledger_url(option), create=create)
    if reconcile:
        from engine.reconcile import reconcile as reconcile_runs

        try:
            reconcile_runs(store)
        except BaseException:
            store.close()
            raise
    return store


def emit(as_json: bool, payload: dict[str, Any]) -> bool:
    if as_json:
        print(json.dumps(payload, default=str))
    return as_json


def esc(value: Any) -> str:
    """Text from documents, files and measurements, printed literally: rich would read `[rungs.ID]` as markup."""
    return escape(str(value))


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
def check(file: Path, ledger: str = LedgerOption, as_json: bool = JsonOption) -> None:
    """Validate a registration and print the resolved plan; writes nothing."""
    del ledger  # every verb takes --ledger (DESIGN.md); check reads no ledger, so scripts may pass it anyway
    from prereg.actions import source_hashes
    from prereg.documents import document_hash, load_registration
    from prereg.pairing import refuse_unpaired

    with verb(as_json):
        reg, _ = load_registration(file)
        refuse_unpaired(reg, str(file))
        source_hashes(reg, file)  # a source the workload names must exist (hashed at freeze)
        payload = {
            "id": reg.id,
            "doc_hash": document_hash(reg),
            "valid": True,
            "items": [i.id for i in reg.items],
            "rungs": [r.id for r in reg.protocol.rungs],
            "reads": list(reg.reads),
            "rules": [r.id for r in reg.rules],
        }
        if emit(as_json, payload):
            return
        print_plan(reg)
        out.print(f"[green]valid[/] · document {payload['doc_hash'][:16]}")


@app.command()
def new(
    file: Path,
    workload: str = typer.Option("command", "--workload", help="the workload the registration governs"),
    ledger: str = LedgerOption,
    as_json: bool = JsonOption,
) -> None:
    """Write a commented registration to start from; `check` accepts it once its blanks are filled."""
    del ledger  # every verb takes --ledger; new writes only FILE
    from prereg.errors import InvalidInput
    from prereg.template import TEMPLATES, blanks

    with verb(as_json):
        if workload not in TEMPLATES:
            raise InvalidInput(
                f"--workload {workload!r}: no template for it; templates exist for {sorted(TEMPLATES)}",
                fix="pass --workload command, or copy a registration of that workload from registrations/",
            )
        if file.exists():
            raise InvalidInput("the file exists; new never overwrites", where=str(file), fix="pass a new path")
        if not file.parent.is_dir():
            raise InvalidInput(f"no folder {file.parent}", where=str(file), fix="create the folder first")
        text = TEMPLATES[workload]
        file.write_text(text, encoding="utf-8")
        payload = {"file": str(file), "workload": workload, "blanks": blanks(text)}
        if emit(as_json, payload):
            return
        out.print(
            f"wrote {esc(file)}: fill in its {len(payload['blanks'])} blanks (FILL), then `prereg check {esc(file)}`"
        )


@app.command()
def freeze(file: Path, ledger: str = LedgerOption, as_json: bool = JsonOption) -> None:
    """Validate and freeze a registration; prints id, document hash, ledger head."""
    from prereg.actions import freeze_registration, source_hashes
    from prereg.documents import load_registration

    with verb(as_json):
        # Validate before the ledger is opened: a bad file must not even create an empty ledger (exit 2 writes nothing).
        reg, raw = load_registration(file)
        source_hashes(reg, file)
        with open_ledger(ledger, create=True) as store:
            result = freeze_registration(store, reg, raw, file)
        payload = {
            "id": result.reg_id,
            "doc_hash": result.doc_hash,
            "head": result.head,
            "seq": result.seq,
            "already_frozen": result.already,
        }
        if emit(as_json, payload):
            return
        state = "already frozen (no-op)" if result.already else "frozen"
        out.print(
            f"{result.reg_id} {state} · document {result.doc_hash[:16]} · entry {result.seq} · head {result.head[:16]}"
        )


@app.command()
def amend(
    reg_id: str,
    file: Path,
    post_hoc: bool = typer.Option(
        False, "--post-hoc", help="accept a change to something already measured; flagged forever"
    ),
    ledger: str = LedgerOption,
    as_json: bool = JsonOption,
) -> None:
    """Append an amendment to a frozen registration."""
    from prereg.actions import amend as do_amend

    with verb(as_json), open_ledger(ledger) as store:
        entry, flagged = do_amend(store, reg_id, file, post_hoc=post_hoc)
        payload = {
            "id": reg_id,
            "version": entry.data["version"],
            "doc_hash": entry.data["doc_hash"],
            "changed": entry.data["changed"],
            "post_hoc": list(flagged),
            "seq": entry.seq,
            "head": entry.head,
        }
        if emit(as_json, payload):
            return
        out.print(
            f"{esc(reg_id)} amendment {payload['version']} · changed {esc(', '.join(payload['changed']))} · entry {entry.seq} · head {entry.head[:16]}"
        )
        if flagged:
            out.print(
                f"[bold yellow]POST-HOC[/]: {esc(', '.join(flagged))} — printed on every verdict, report and audit line that depends on it"
            )


@app.command()
def record(reg_id: str, file: Path, ledger: str = LedgerOption, as_json: bool = JsonOption) -> None:
    """Enter measurements made outside the engine (marked external, judged by the same rules)."""
    from prereg.actions import record as do_record

    with verb(as_json), open_ledger(ledger) as store:
        entries = do_record(store, reg_id, file)
        oracles = [e.data for e in entries if e.kind == "oracle"]
        rungs = next(e.data["rungs"] for e in entries if e.kind == "record")
        payload = {
            "id": reg_id,
            "oracles": {o["oracle"]: {"passed": o["passed"], "reason": o["reason"]} for o in oracles},
            "rungs": {k: {"status": v["status"], "flagged": v["flagged"]} for k, v in rungs.items()},
            "head": entries[-1].head,
            "seq": entries[-1].seq,
        }
        if emit(as_json, payload):
            return
        for o in oracles:
            mark = "[green]pass[/]" if o["passed"] else "[red]FAIL → item dropped[/]"
            out.print(f"oracle {esc(o['oracle'])} ({esc(o['item'])}): {mark} · {esc(o['reason'])}")
        for rung_id, rung in rungs.items():
            flag = f" · [yellow]flagged, kept out of every read[/]: {esc(rung['flagged'])}" if rung["flagged"] else ""
            out.print(f"rung {esc(rung_id)}: {rung['status']}{flag}")
        out.print(f"recorded · entry {entries[-1].seq} · head {entries[-1].head[:16]}")


@app.command()
def run(
    reg_id: str,
    dry_run: bool = typer.Option(False, "--dry-run", help="check and print the plan; run nothing"),
    file: Path = typer.Option(None, "--file", help="the registration file (default: registrations/<frozen file name>)"),
    budget_s: float = typer.Option(
        None, "--budget-s", help="stop cleanly before this many seconds and leave the ladder resumable"
    ),
    gate_only: bool = typer.Option(
        False, "--gate-only", help="run the oracle gate and stop before the first rung; a later run resumes the ladder"
    ),
    ledger: str = LedgerOption,
    as_json: bool = JsonOption,
) -> None:
    """Oracle gate, then the ladder; resumes an interrupted ladder."""
    with verb(as_json):
        from engine.ladder import run_ladder

        with open_ledger(ledger) as store:
            summary = run_ladder(
                store,
                reg_id,
                file=file,
                dry_run=dry_run,
                budget_s=budget_s,
                console=None if as_json else out,
                gate_only=gate_only,
            )
        emit(as_json, summary)


@app.command()
def verdict(reg_id: str, ledger: str = LedgerOption, as_json: bool = JsonOption) -> None:
    """Apply the frozen rules to what was measured; record and print the verdict."""
    from prereg.verdict import record_verdict

    with verb(as_json), open_ledger(ledger) as store:
        result, appended = record_verdict(store, reg_id)
        seq, head = store.head()
        if emit(as_json, {**result, "recorded": appended, "head": head}):
            return
        print_verdict(result)
        out.print(
            f"verdict {'recorded' if appended else 'unchanged (already recorded)'} · ledger head {head[:16]} (entry {seq})"
        )


@app.command()
def report(
    reg_id: str,
    out_dir: Path = typer.Option(None, "--out", help="directory (default reports/<id>)"),
    compare: str = typer.Option(
        None,
        "--compare",
        metavar="OTHER_ID",
        help="the same question registered with the other protocol.schedule: both cost splits and verdicts side by side",
    ),
    ledger: str = LedgerOption,
    as_json: bool = JsonOption,
) -> None:
    """A Markdown and HTML report with plots, and what the ladder cost against its ceiling."""
    with verb(as_json):
        from engine.report.report import write_report

        with open_ledger(ledger) as store:
            paths = write_report(store, reg_id, out_dir or Path("reports") / reg_id, compare=compare)
            summary = None
            if compare:
                comparison = json.loads((paths[0].parent / "compare.json").read_text(encoding="utf-8"))
                summary = {
                    "same_verdict": comparison["same_verdict"],
                    "why": comparison["why"],
                    "sides": [
                        {
                            "id": s["id"],
                            "schedule": s["schedule"],
                            "gpu_s": s["cost"]["gpu_s"],
                            "split": s["cost"]["split"],
                            "share_of_ceiling": s["cost"]["share_of_ceiling"],
                            "outcome": s["outcome"],
                            "rule": s["rule"],
                            "primary": s["primary"],
                        }
                        for s in comparison["sides"]
                    ],
                }
        if emit(as_json, {"id": reg_id, "files": [str(p) for p in paths], **({"compare": summary} if summary else {})}):
            return
        for path in paths:
            out.print(esc(path))
        if summary:
            print_comparison(summary)


def print_comparison(summary: dict[str, Any]) -> None:
    from engine.report.costs import PARTS

    a, b = summary["sides"]
    table = Table(
        "device-s",
        f"{esc(a['id'])} ({a['schedule']})",
        f"{esc(b['id'])} ({b['schedule']})",
        title="same question, two schedules",
    )
    for name, label in PARTS.items():
        if name in a["split"] or name in b["split"]:
            table.add_row(label, f"{a['split'].get(name, 0.0):.1f}", f"{b['split'].get(name, 0.0):.1f}")
    table.add_row("total (of the ceiling)", *(f"{s['gpu_s']:.1f} ({100 * s['share_of_ceiling']:.1f}%)" for s in (a, b)))
    table.add_row(
        "verdict", *(esc(f"{s['outcome']} (rule {s['rule']})" if s["outcome"] else "no rule fired") for s in (a, b))
    )
    table.add_row(f"read {esc(a['primary']['read'] or '—')}", *(fmt(s["primary"]["value"]) for s in (a, b)))
    out.print(table)
    same = summary["same_verdict"]
    out.print(
        "[bold green]both reach the same verdict[/]"
        if same
        else "[bold red]the verdicts differ[/]"
        if same is False
        else f"[yellow]not comparable yet[/]: {esc(summary['why'])}"
    )


# --- audit ----------------------------------------------------------------------------------------------------


@audit_app.command("list")
def audit_list(ledger: str = LedgerOption, as_json: bool = JsonOption) -> None:
    """Every registration: status, versions, outcome."""
    from prereg.audit import audit_list as query

    with verb(as_json), open_ledger(ledger) as store:
        rows = query(store)
        if emit(as_json, {"registrations": rows}):
            return
        table = Table(title="registrations")
        for name in ("id", "status", "versions", "outcome", "profile", "frozen"):
            table.add_column(name, no_wrap=name in ("id", "outcome"))
        for row in rows:
            outcome = esc(fmt(row["outcome"])) + (" [bold yellow]POST-HOC[/]" if row["post_hoc"] else "")
            table.add_row(
                esc(row["id"]), row["status"], str(row["versions"]), outcome, esc(row["profile"]), row["frozen"][:19]
            )
        out.print(table)


@audit_app.command("show")
def audit_show(reg_id: str, ledger: str = LedgerOption, as_json: bool = JsonOption) -> None:
    """One registration's whole history."""
    from prereg.audit import audit_show as query

    with verb(as_json), open_ledger(ledger) as store:
        shown = query(store, reg_id)
        if emit(as_json, shown):
            return
        out.print(
            f"[bold]{esc(shown['id'])}[/] — {esc(shown['title'])}  ({shown['status']}, profile {esc(shown['profile'])})"
        )
        versions = Table("v", "entry", "time", "document", "reason", title="versions")
        for v in shown["versions"]:
            reason = esc(v["reason"] or "frozen") + (
                f" [bold yellow]POST-HOC {esc(', '.join(v['post_hoc']))}[/]" if v["post_hoc"] else ""
            )
            versions.add_row(str(v["version"]), str(v["seq"]), v["ts"][:19], v["doc_hash"][:12], reason)
        out.print(versions)
        if shown["oracles"]:
            oracles = Table("oracle", "item", "kind", "result", "observed vs bound", "source", title="oracles")
            for o in shown["oracles"]:
                oracles.add_row(
                    esc(o["oracle"]),
                    esc(o["item"]),
                    o["kind"],
                    "[green]pass[/]" if o["passed"] else "[red]fail[/]",
                    esc(o["reason"]),
                    "external" if o["external"] else "engine",
                )
            out.print(oracles)
        if shown["runs"]:
            runs = Table("rung", "run", "status", "windows", "items", "v", "note", title="runs")
            for r in shown["runs"]:
                note = (
                    r["flagged"]
                    and f"[yellow]flagged: {esc(r['flagged'])}[/]"
                    or (r["kill"] and esc(f"killed by {r['kill']['kill']} at step {r['kill'].get('step')}"))
                    or esc(r["provenance"] or "")
                )
                runs.add_row(
                    esc(r["rung"]),
                    esc(r["run"]),
                    r["status"],
                    str(r["windows"]),
                    esc(",".join(r["items"]) or "—"),
                    str(r["version"]),
                    note,
                )
            out.print(runs)
        if shown["verdict"]:
            v = shown["verdict"]
            hits = " ".join(f"{e['n']}{e.get('part') or ''}:{e['result']}" for e in v["expectations"])
            out.print(
                f"verdict (entry {v['seq']}): [bold]{esc(fmt(v['outcome']))}[/] by rule {esc(fmt(v['rule']))} · land {esc(v['land'] or '—')} · park {esc(v['park'] or '—')} · expectations {hits or '—'}"
            )
        if shown["post_hoc"]:
            out.print(f"[bold yellow]POST-HOC[/]: {esc('; '.join(shown['post_hoc']))}")
        seq, head = store.head()
        out.print(f"ledger head {head[:16]} (entry {seq})")


@audit_app.command("verify")
def audit_verify(
    published_head: str = typer.Option(None, "--head", help="a head published earlier; truncation past it is caught"),
    ledger: str = LedgerOption,
    as_json: bool = JsonOption,
) -> None:
    """Recompute the hash chain; name the first bad entry. Exit 4 when it fails."""
    with verb(as_json), open_ledger(ledger, reconcile=False) as store:
        report = store.verify(published_head=published_head)
        payload = {
            "ok": report.ok,
            "entries": report.entries,
            "head": report.head,
            "first_bad": report.first_bad,
            "reason": report.reason,
        }
        if not emit(as_json, payload):
            if report.ok:
                out.print(f"[green]ok[/] · {report.entries} entries · head {report.head}")
            else:
                err.print(f"[bold red]ledger failed verification[/] at entry {report.first_bad}: {esc(report.reason)}")
        if not report.ok:
            raise typer.Exit(LedgerCorrupt.exit_code)


@audit_app.command("costs")
def audit_costs(ledger: str = LedgerOption, as_json: bool = JsonOption) -> None:
    """GPU-seconds per registration against its ceiling; overruns are shown, never hidden."""
    from prereg.audit import audit_costs as query

    with verb(as_json), open_ledger(ledger) as store:
        rows = query(store)
        if emit(as_json, {"registrations": rows}):
            return
        table = Table("id", "GPU-s", "ceiling GPU-s", "load", "oracle", "steps", "external", "overrun", title="costs")
        for row in rows:
            split = row["split"]
            table.add_row(
                esc(row["id"]) + (" [bold yellow]POST-HOC[/]" if row["post_hoc"] else ""),
                fmt(row["gpu_s"]),
                fmt(row["ceiling_gpu_s"]),
                fmt(split["load"]),
                fmt(split["oracle"]),
                fmt(split["steps"]),
                fmt(split["external"]),
                "[red]OVERRUN[/]" if row["overrun"] else "no",
            )
        out.print(table)


@audit_app.command("calibration")
def audit_calibration(ledger: str = LedgerOption, as_json: bool = JsonOption) -> None:
    """Expectation hits per confidence level, and the Brier score."""
    from prereg.audit import audit_calibration as query

    with verb(as_json), open_ledger(ledger) as store:
        result = query(store)
        if emit(as_json, result):
            return
        table = Table("confidence", "p", "scored", "hits", "hit rate", "undefined", title="calibration")
        for row in result["levels"]:
            table.add_row(
                row["confidence"],
                fmt(row["p"]),
                str(row["n"]),
                str(row["hits"]),
                fmt(row["hit_rate"]),
                str(row["undefined"]),
            )
        out.print(table)
        out.print(f"Brier score {fmt(result['brier'])} over {result['scored']} scored expectations")
        if result["post_hoc"]:
            out.print(
                f"[bold yellow]POST-HOC[/]: the verdicts of {esc(', '.join(result['post_hoc']))} stand on post-hoc amendments"
            )


@audit_app.command("export")
def audit_export(
    out_file: Path = typer.Option(None, "--out", help="write JSONL here (default: stdout)"), ledger: str = LedgerOption
) -> None:
    """Every entry as JSONL (first line: the ledger's name); `import` re-verifies it."""
    with verb(False), open_ledger(ledger, reconcile=False) as store:
        if out_file is None:
            store.export_jsonl(sys.stdout)
        else:
            with out_file.open("w", encoding="utf-8") as handle:
                count = store.export_jsonl(handle)
            err.print(f"{count} entries → {esc(out_file)}")


@audit_app.command("import")
def audit_import(file: Path, ledger: str = LedgerOption, as_json: bool = JsonOption) -> None:
    """Load a JSONL export into a new, empty ledger; the chain is re-verified first."""
    from prereg.ledger import Ledger

    with verb(as_json):
        url = ledger_url(ledger)
        with file.open(encoding="utf-8") as handle, Ledger.import_jsonl(handle, url) as store:
            seq, head = store.head()
        if not emit(as_json, {"entries": seq, "head": head}):
            out.print(f"imported {seq} entries · head {head}")


# --- rendering ------------------------------------------------------------------------------------------------


def print_plan(reg) -> None:
    out.print(f"[bold]{esc(reg.id)}[/] — {esc(reg.title)}")
    out.print(
        f"workload {esc(reg.workload)} · profile {esc(reg.profile)} · {reg.protocol.kind}/{reg.protocol.schedule} · {reg.protocol.steps} steps, "
        f"log every {reg.protocol.log_every}, discard {reg.protocol.discard_first} · ceiling {reg.cost.ceiling_gpu_h} GPU-h ({reg.cost.on_ceiling})"
    )
    if reg.items:
        items = Table("item", "switch", "bitwise", "oracle", "kind", "probe", "bounds", title="items and their oracles")
        for item in reg.items:
            for index, oracle in enumerate(item.oracles):
                bounds = ", ".join(f"{k} ≤ {v:g}" for k, v in oracle.bounds.items()) or "—"
                items.add_row(
                    esc(item.id) if index == 0 else "",
                    esc(item.switch) if index == 0 else "",
                    fmt(item.bitwise) if index == 0 else "",
                    esc(oracle.id),
                    oracle.kind,
                    esc(oracle.probe),
                    esc(bounds),
                )
        out.print(items)
    rungs = Table("rung", "items", "config", title="ladder")
    for rung in reg.protocol.rungs:
        rungs.add_row(
            esc(rung.id), esc(", ".join(rung.items) or "— (baseline)"), esc(json.dumps(reg.rung_config(rung.id)))
        )
    out.print(rungs)
    if reg.protocol.pass_rule:
        out.print(f"pass rule: {esc(reg.protocol.pass_rule)}")
    for name, text in reg.reads.items():
        out.print(f"read {esc(name)} = {esc(text)}")
    for rule in reg.rules:
        out.print(f"rule {esc(rule.id)}: when {esc(rule.when)} → {esc(rule.outcome)}")
    for kill in reg.kill:
        out.print(esc(f"kill {kill.id} (at {kill.at}): {kill.when}" + (f" → drops {kill.drops}" if kill.drops else "")))


def print_verdict(v: dict[str, Any]) -> None:
    out.print(
        f"[bold]{esc(v['registration'])}[/] — verdict under document version {v['version']} ({v['doc_hash'][:12]})"
    )
    if v["post_hoc"]:
        out.print(f"[bold yellow]POST-HOC[/]: {esc('; '.join(v['post_hoc']))}")
    if v["dropped"]:
        dropped = Table("item", "cause", "observed vs bound", title="dropped items")
        for item, why in v["dropped"].items():
            cause = (
                f"oracle {why['oracle']}" if why["cause"] == "oracle" else f"kill {why['kill']} on rung {why['rung']}"
            )
            dropped.add_row(esc(item), esc(cause), esc(why["reason"]))
        out.print(dropped)
    rungs = Table(
        "rung", "items", "status", "windows", "s/step (median \\[min–max])", "vram peak GiB", "note", title="rungs"
    )
    for r in v["rungs"]:
        spread = r["spread"].get("s_per_step")
        step = fmt(r["summary"].get("s_per_step")) + (f" [{spread[0]:.4g}–{spread[1]:.4g}]" if spread else "")
        rungs.add_row(
            esc(r["rung"]),
            esc(", ".join(r["items"]) or "—"),
            fmt(r["status"]),
            str(r["windows"]),
            esc(step),
            fmt(r["summary"].get("vram_peak_gib")),
            esc(r["why_undefined"] or ("external" if r["external"] else "")),
        )
    out.print(rungs)
    if v["until_pass"]:
        for rejected in v["until_pass"]["rejected"]:
            out.print(esc(f"rung {rejected['rung']} {rejected['result']}: {rejected['reason']}"))
        out.print(
            f"until-pass: [bold]{esc(v['until_pass']['passed'] or 'none passed')}[/] — {esc(v['until_pass']['reason'])}"
        )
    if v["reads"]:
        reads = Table("read", "value", "95% interval", "undefined because", title="reads")
        for name, value in v["reads"].items():
            interval = v["intervals"].get(name)
            reads.add_row(
                esc(name),
                esc(fmt(value)),
                esc(f"[{interval[0]:.4g}, {interval[1]:.4g}]") if interval else "—",
                esc(v["undefined"].get(name, "")),
            )
        out.print(reads)
    for trace in v["rules"]:
        state = "undefined: " + trace["undefined"] if trace["undefined"] else fmt(trace["value"])
        out.print(esc(f"rule {trace['rule']}: {trace['when']} → {state}"))
    if v["rule"]:
        out.print(
            f"[bold]outcome: {esc(v['outcome'])}[/] (rule {esc(v['rule'])}) · land {esc(', '.join(v['land']) or '—')} · park {esc(', '.join(v['park']) or '—')}"
        )
        for entry in v["conditional_land"]:
            state = "undefined: " + entry["undefined"] if entry["undefined"] else fmt(entry["value"])
            landed = "lands" if entry["item"] in v["land"] else "parked"
            out.print(esc(f"  {entry['item']} if {entry['if']} → {state}: {landed}"))
    else:
        out.print("[bold]outcome: none[/] — no rule fired")
    if v["expectations"]:
        exp = Table("n", "claim", "confidence", "result", title="expectations")
        for e in v["expectations"]:
            colour = {"hit": "green", "miss": "red"}.get(e["result"], "yellow")
            exp.add_row(
                str(e["n"]) + (e.get("part") or ""),
                esc(e["claim"]),
                e["confidence"],
                f"[{colour}]{e['result']}[/]" + (esc(f" ({e['why']})") if e["why"] else ""),
            )
        out.print(exp)
    cost = v["cost"]
    overrun = " [red]OVERRUN[/]" if cost["overrun"] else ""
    split = cost["split"]
    out.print(
        f"cost: {cost['gpu_s']:.1f} device-s of {cost['ceiling_gpu_s']:.0f} ceiling (load {split['load']:.1f}, oracle {split['oracle']:.1f}, "
        f"steps {split['steps']:.1f}, external {split['external']:.1f}){overrun}"
    )


if __name__ == "__main__":
    app()
