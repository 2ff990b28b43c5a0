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
from typing import TYPE_CHECKING, Any, Iterator

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from engine.report.terminal import Column, print_table
from prereg.errors import LedgerCorrupt, PreregError

if TYPE_CHECKING:
    from prereg.workload import WorkloadDeclaration


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


# The lab's registration ids run to 35 characters: folded at 20 they are two readable lines, and a table that
# would fold them narrower becomes a list.
REG_ID_WIDTH = 20


def seconds(value: float) -> str:
    """Device-seconds as a person compares them down a column: whole seconds with thousands separated."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.1f}"


def fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


# --- verbs ----------------------------------------------------------------------------------------------------


@contextmanager
def existing_ledger(option: str | None, *, read_only: bool = False) -> Iterator[Any]:
    """The ledger at the URL if there is one (None for a ledger file that does not exist); never created.
    `read_only`: the database refuses every write on its connections, and no run is reconciled (a verb that
    promises to write nothing)."""
    url = ledger_url(option)
    if (
        not url.startswith(("postgresql://", "postgresql+psycopg://"))
        and not Path(url.removeprefix("sqlite:///")).exists()
    ):
        yield None
        return
    if read_only:
        from prereg.ledger import Ledger

        with Ledger.open(url, create=False, read_only=True) as store:
            yield store
        return
    with open_ledger(option) as store:
        yield store


# Why check's sensitivity has no earlier windows when there is no ledger (not where: the path is the one --ledger
# or PREREG_LEDGER gave).
NO_LEDGER_FILE = "no ledger file here"


@app.command()
def check(file: Path, ledger: str = LedgerOption, as_json: bool = JsonOption) -> None:
    """Validate a registration and print the resolved plan with every rung's effective config and the sensitivity
    of its bars; writes nothing (the ledger is opened read-only). A document frozen in the ledger resolves with the
    defaults it was frozen with."""
    from prereg.actions import check as do_check
    from prereg.documents import document_hash
    from prereg.power import assessment_before_run

    with verb(as_json), existing_ledger(ledger, read_only=True) as store:
        result = do_check(store, file)
        reg = result.reg
        assessment = assessment_before_run(reg, store, unread=NO_LEDGER_FILE)
        payload = {
            "id": reg.id,
            "doc_hash": document_hash(reg),
            "valid": True,
            "frozen": result.frozen,
            "items": [i.id for i in reg.items],
            "rungs": [r.id for r in reg.protocol.rungs],
            "reads": list(reg.reads),
            "rules": [r.id for r in reg.rules],
            "effective_config": reg.effective_configs(),
            "config_defaults": reg.config_defaults,
            "notes": [use.note() for use in result.retired] + check_numerics_notes(result),
            "assumed": assumed_payload(result.assumed),
            "amended": [{"path": path, "value": value} for path, value in result.amended],
            **sensitivity_payload(assessment),
        }
        if emit(as_json, payload):
            return
        print_plan(reg, frozen=result.frozen)
        if result.amended:
            out.print(
                f"[yellow]amended in the ledger[/] (in force; the file is as frozen; `prereg audit show {reg.id}`):"
            )
        for path, value in result.amended:
            shown = json.dumps(value) if not isinstance(value, (dict, list)) else "a table or list, added or changed"
            out.print(f"  {esc(path)}: {esc(shown)}")
        print_assumed(payload["assumed"], reg.source)
        print_sensitivity(assessment)
        for note in payload["notes"]:
            out.print(f"[yellow]note[/]: {esc(note)}")
        out.print(f"[green]valid[/] · document {payload['doc_hash'][:16]}")


def check_numerics_notes(result) -> list[str]:
    """The numerics guard's note on a document frozen before the rule (prereg/numerics_guard.py)."""
    return [result.numerics_note] if result.numerics_note else []


def sensitivity_payload(assessment) -> dict[str, Any]:
    """`sensitivity` (one row per bar, with exactly the keys docs/design.md names) and beside it why a row has
    nulls."""
    return {"sensitivity": assessment.rows_json(), "sensitivity_notes": assessment.notes_json()}


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
    """Validate and freeze a registration; prints id, document hash, ledger head, and a warning per unpowered bar."""
    from prereg.actions import freeze_registration, load_against, refuse_new_freeze, source_hashes
    from prereg.power import assessment_before_run

    with verb(as_json):
        # Validate before the ledger is opened for writing: a bad file must not even create an empty ledger (exit 2
        # writes nothing). A document already frozen there resolves with the defaults it was frozen with.
        with existing_ledger(ledger) as known:
            reg, raw = load_against(known, file)
            source_hashes(reg, file)  # a source the workload names must exist
            if known is None or reg.id not in known.reg_ids():
                refuse_new_freeze(reg, file)
        with open_ledger(ledger, create=True) as store:
            result = freeze_registration(store, reg, raw, file)
            assessment = assessment_before_run(reg, store)
        payload = {
            "id": result.reg_id,
            "doc_hash": result.doc_hash,
            "head": result.head,
            "seq": result.seq,
            "already_frozen": result.already,
            **sensitivity_payload(assessment),
        }
        if emit(as_json, payload):
            return
        state = "already frozen (no-op)" if result.already else "frozen"
        out.print(
            f"{result.reg_id} {state} · document {result.doc_hash[:16]} · entry {result.seq} · head {result.head[:16]}"
        )
        print_unpowered_warnings(assessment, reg.protocol.on_underpowered)


def print_unpowered_warnings(assessment, on_underpowered: str) -> None:
    from prereg.power import describe, unpowered

    for row in unpowered(assessment):
        out.print(f"[bold yellow]UNDERPOWERED[/]: {esc(describe(row))} · on_underpowered = {on_underpowered}")


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
            f"{esc(reg_id)} amendment {payload['version']} · changed {esc(', '.join(payload['changed']))}"
            f" · entry {entry.seq} · head {entry.head[:16]}"
        )
        if flagged:
            out.print(
                f"[bold yellow]POST-HOC[/]: {esc(', '.join(flagged))}"
                " — printed on every verdict, report and audit line that depends on it"
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
def adopt(
    reg_id: str,
    items: list[str] = typer.Argument(None, help="the items that landed (none with --outcome)", show_default=False),
    commit: str = typer.Option(..., "--commit", help="the commit where they landed (checked in this git checkout)"),
    outcome: bool = typer.Option(
        False, "--outcome", help="adopt the recorded verdict's outcome as a whole (one that lands no items)"
    ),
    against_verdict: bool = typer.Option(
        False, "--against-verdict", help="adopt items the verdict parked, dropped or did not land; flagged forever"
    ),
    reason: str = typer.Option(None, "--reason", help="why, with --against-verdict"),
    ledger: str = LedgerOption,
    as_json: bool = JsonOption,
) -> None:
    """Record that decided items (or a verdict's outcome) landed in code at a commit."""
    from prereg.actions import adopt as do_adopt

    with verb(as_json), open_ledger(ledger) as store:
        result = do_adopt(
            store,
            reg_id,
            list(items or []),
            outcome=outcome,
            commit=commit,
            against_verdict=against_verdict,
            reason=reason,
            repo=Path.cwd(),
        )
        data = result.entry.data
        payload = {"id": reg_id, **data, "seq": result.entry.seq, "head": result.entry.head, "already": result.already}
        if emit(as_json, payload):
            return
        what = f"outcome {data['outcome']}" if data["outcome"] else ", ".join(data["items"])
        state = "already recorded (no-op)" if result.already else "adopted"
        entry = result.entry
        out.print(
            f"{esc(reg_id)}: {esc(what)} {state} at {data['commit'][:12]} · entry {entry.seq} · head {entry.head[:16]}"
        )
        for item, why in data["against_verdict"].items():
            out.print(f"[bold red]AGAINST VERDICT[/]: {esc(item)} {esc(why)} — reason: {esc(data['reason'])}")
        if data["without_verdict"]:
            out.print("[bold yellow]WITHOUT A VERDICT[/]: no decided verdict is recorded for it")
        if not data["commit_checked"]:
            out.print(f"commit not checked: {esc(Path.cwd())} is not a git checkout; recorded as given")


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
    detach: bool = typer.Option(
        False, "--detach", help="cluster launchers: submit the ladder's next job and return; a later run follows it"
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
                detach=detach,
            )
        emit(as_json, summary)


@app.command()
def verdict(reg_id: str, ledger: str = LedgerOption, as_json: bool = JsonOption) -> None:
    """Apply the frozen rules to what was measured; record and print the verdict."""
    from prereg.state import load_state
    from prereg.verdict import record_verdict

    with verb(as_json), open_ledger(ledger) as store:
        result, appended = record_verdict(store, reg_id)
        seq, head = store.head()
        if emit(as_json, {**result, "recorded": appended, "head": head}):
            return
        print_verdict(result, load_state(store, reg_id, with_windows=False).registration().declaration())
        out.print(
            f"verdict {'recorded' if appended else 'unchanged (already recorded)'}"
            f" · ledger head {head[:16]} (entry {seq})"
        )


@app.command()
def report(
    reg_id: str,
    out_dir: Path = typer.Option(None, "--out", help="directory (default reports/<id>)"),
    compare: str = typer.Option(
        None,
        "--compare",
        metavar="OTHER_ID",
        help="the same question registered with the other protocol.schedule: "
        "both cost splits and verdicts side by side",
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
    from prereg.cost import PARTS

    a, b = summary["sides"]
    columns = [
        Column("device-s", min_width=12),
        Column(f"{a['id']} ({a['schedule']})", min_width=14),
        Column(f"{b['id']} ({b['schedule']})", min_width=14),
    ]
    rows = [
        [label, f"{a['split'].get(name, 0.0):.1f}", f"{b['split'].get(name, 0.0):.1f}"]
        for name, label in PARTS.items()
        if name in a["split"] or name in b["split"]
    ]
    rows.append(["total (of the ceiling)", *(f"{s['gpu_s']:.1f} ({100 * s['share_of_ceiling']:.1f}%)" for s in (a, b))])
    rows.append(
        ["verdict", *(esc(f"{s['outcome']} (rule {s['rule']})" if s["outcome"] else "no rule fired") for s in (a, b))]
    )
    rows.append([f"read {esc(a['primary']['read'] or '—')}", *(fmt(s["primary"]["value"]) for s in (a, b))])
    print_table(out, "same question, two schedules", columns, rows)
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
        columns = [
            Column("id", key=True, min_width=REG_ID_WIDTH),
            Column("status", short=True),
            Column("versions", short=True),
            Column("outcome", min_width=12),
            Column("profile"),
            Column("frozen", short=True),
        ]
        table = [
            [
                esc(row["id"]),
                row["status"],
                str(row["versions"]),
                esc(fmt(row["outcome"]))
                + (" [bold yellow]POST-HOC[/]" if row["post_hoc"] else "")
                + (" [bold red]AGAINST VERDICT[/]" if row["against_verdict"] else ""),
                esc(row["profile"]),
                row["frozen"][:10],  # the day; `audit show` has the time
            ]
            for row in rows
        ]
        print_table(out, "registrations", columns, table)


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
        versions = [
            [
                str(v["version"]),
                str(v["seq"]),
                v["ts"][:19],
                v["doc_hash"][:12],
                esc(v["reason"] or "frozen")
                + (f" [bold yellow]POST-HOC {esc(', '.join(v['post_hoc']))}[/]" if v["post_hoc"] else ""),
            ]
            for v in shown["versions"]
        ]
        columns = [Column("v", short=True), Column("entry", short=True), Column("time", min_width=10)]
        print_table(
            out, "versions", columns + [Column("document", short=True), Column("reason", min_width=16)], versions
        )
        if shown["oracles"]:
            oracles = [
                [
                    esc(o["oracle"]),
                    esc(o["item"]),
                    o["kind"],
                    "[green]pass[/]" if o["passed"] else "[red]fail[/]",
                    esc(o["reason"]),
                    "external" if o["external"] else "engine",
                ]
                for o in shown["oracles"]
            ]
            columns = [Column("oracle", min_width=8), Column("item", min_width=4), Column("kind"), Column("result")]
            columns += [Column("observed vs bound", min_width=20), Column("source")]
            print_table(out, "oracles", columns, oracles)
        if shown["runs"]:
            runs = []
            for r in shown["runs"]:
                crash = r["crash_window"]
                crashed = f"crashed at step {crash['step']}, rc {crash['rc']}" if crash else ""
                if r["flagged"]:
                    note = f"[yellow]flagged: {esc(r['flagged'])}[/]"
                elif r["kill"]:
                    killed = f"killed by {r['kill']['kill']} at step {r['kill'].get('step')}"
                    note = esc(f"{killed} ({crashed})" if crashed else killed)
                else:
                    note = esc(crashed or r["provenance"] or "")
                items = esc(", ".join(r["items"]) or "—")
                runs.append(
                    [esc(r["rung"]), esc(r["run"]), r["status"], str(r["windows"]), items, str(r["version"]), note]
                )
            columns = [Column("rung", key=True, min_width=6), Column("run", min_width=12), Column("status", short=True)]
            columns += [Column("windows", short=True), Column("items", min_width=8), Column("v", short=True)]
            print_table(out, "runs", columns + [Column("note", min_width=16)], runs)
        print_jobs(shown["jobs"])
        if shown["verdict"]:
            v = shown["verdict"]
            hits = " ".join(f"{e['n']}{e.get('part') or ''}:{e['result']}" for e in v["expectations"])
            out.print(
                f"verdict (entry {v['seq']}): [bold]{esc(fmt(v['outcome']))}[/] by rule {esc(fmt(v['rule']))}"
                f" · land {esc(', '.join(v['land']) or '—')} · park {esc(', '.join(v['park']) or '—')}"
                f" · expectations {hits or '—'}"
            )
        if shown["post_hoc"]:
            out.print(f"[bold yellow]POST-HOC[/]: {esc('; '.join(shown['post_hoc']))}")
        print_assumed(shown["assumed"], shown["source"])
        for a in shown["adoptions"]:
            what = f"outcome {a['outcome']}" if a["outcome"] else ", ".join(a["items"])
            flags = "".join(
                f" [bold red]AGAINST VERDICT[/] {esc(item)} {esc(why)} (reason: {esc(a['reason'])})"
                for item, why in a["against_verdict"].items()
            ) + (" [bold yellow]WITHOUT A VERDICT[/]" if a["without_verdict"] else "")
            out.print(f"adopted (entry {a['seq']}): {esc(what)} at {a['commit'][:12]}{flags}")
        seq, head = store.head()
        out.print(f"ledger head {head[:16]} (entry {seq})")


def print_jobs(jobs: list[dict[str, Any]]) -> None:
    """The registration's cluster jobs: queued and running first (their Slurm ids), then those that ended."""
    if not jobs:
        return
    rows = [
        [
            esc(j["job"]),
            j["purpose"],
            esc(", ".join(f"{label} ({run})" for run, label in j["runs"].items()) or "—"),
            j["state"],
            esc(", ".join(j["hosts"]) or "—"),
            esc(j["launcher"]),
        ]
        for j in sorted(jobs, key=lambda j: (j["ended"], j["seq"]))
    ]
    columns = [Column("job", key=True, min_width=6), Column("for", short=True), Column("runs", min_width=12)]
    columns += [Column("state", short=True), Column("hosts", min_width=6), Column("launcher", min_width=8)]
    print_table(out, "cluster jobs", columns, rows)


@audit_app.command("adoption")
def audit_adoption(ledger: str = LedgerOption, as_json: bool = JsonOption) -> None:
    """Every decided verdict: landed and adopted or not, adopted against it or without one; adoption checks."""
    from prereg.audit import audit_adoption as query

    with verb(as_json), open_ledger(ledger) as store:
        result = query(store)
        if emit(as_json, result):
            return
        print_adoption(result)


def print_adoption(result: dict[str, Any]) -> None:
    # A list, not a table: a registration id, a commit and a reason do not fit 80 columns side by side.
    labels = {
        "landed-adopted": "[green]landed, adopted[/]",
        "landed-not-adopted": "[yellow]landed, not adopted[/]",
        "against-verdict": "[bold red]AGAINST VERDICT[/]",
        "without-verdict": "[bold yellow]WITHOUT A VERDICT[/]",
    }
    checks = {"met": "[green]met[/]", "failed": "[bold red]failed[/]", "pending": "[yellow]pending[/]"}
    for reg in result["registrations"]:
        decided = (
            f"{esc(reg['outcome'])} (rule {esc(reg['rule'])}, verdict entry {reg['verdict_seq']})"
            if reg["decided"]
            else "no decided verdict"
        )
        post_hoc = " [bold yellow]POST-HOC[/]" if reg["post_hoc"] else ""
        out.print(f"[bold]{esc(reg['id'])}[/] — {decided}{post_hoc}")
        for row in reg["rows"]:
            what = esc(row["what"]) + (" (outcome)" if row["kind"] == "outcome" else "")
            label = labels[row["status"]]
            if row["kind"] == "outcome":  # an outcome that lands no items is decided, not landed
                label = label.replace("landed, ", "decided, ")
            line = f"  {what}: {label}"
            if row["commit"]:
                unchecked = "" if row["commit_checked"] else " (not checked)"
                line += f" at {row['commit'][:12]}{unchecked}, entry {row['seq']}"
            if row["why"]:
                line += f" · {esc(row['why'])}"
            if row["reason"]:
                line += f" · reason: {esc(row['reason'])}"
            out.print(line)
        for check in reg["checks"]:
            line = f"  check {esc(check['id'])} ({esc(check['claim'])}): {checks[check['status']]}"
            if check["why"]:
                line += f" · {esc(check['why'])}"
            if check["post_hoc"]:
                line += f" [bold yellow]POST-HOC {esc(', '.join(check['post_hoc']))}[/]"
            out.print(line)
    counts = ", ".join(f"{n} {status}" for status, n in result["counts"].items() if n)
    out.print(f"{len(result['registrations'])} registrations · {counts or 'nothing decided or adopted'}")


@audit_app.command("sensitivity")
def audit_sensitivity(ledger: str = LedgerOption, as_json: bool = JsonOption) -> None:
    """Every decided verdict's compared reads: bar, value, flip probability, fragile, and the power they had
    before their data."""
    from prereg.audit import audit_sensitivity as query

    with verb(as_json), open_ledger(ledger) as store:
        result = query(store)
        if emit(as_json, result):
            return
        print_audit_sensitivity(result)


def short_number(value: Any) -> str:
    """Three significant digits: enough to set a value beside its bar, and narrow enough for 80 columns."""
    return f"{value:.3g}" if isinstance(value, float) else fmt(value)


def print_audit_sensitivity(result: dict[str, Any]) -> None:
    table = [
        [
            esc(row["id"]) + (" [bold yellow]POST-HOC[/]" if row["post_hoc"] else ""),
            esc(row["read"]),
            esc(f"{short_number(row['value'])} vs {row['bar']:g}"),
            flip_cell(row),
            short_number(row["mde"]),
            {True: "yes", False: "[bold red]no[/]", None: "—"}[row["powered"]],
        ]
        for row in result["reads"]
    ]
    columns = [Column("id", key=True, min_width=REG_ID_WIDTH), Column("read", min_width=8)]
    columns += [Column("value vs bar", min_width=9), Column("flip", min_width=7)]
    columns += [Column("MDE before", short=True), Column("powered", short=True)]
    print_table(out, "compared reads: robustness after the data, power before it", columns, table)
    counts = result["counts"]
    out.print(
        f"{counts['decided']} decided · {counts['compared']} compared reads · {counts['fragile']} fragile · "
        f"{counts['underpowered']} underpowered before their data · {counts['power_unknown']} with no noise known"
    )
    if result["without_bars"]:
        out.print(f"no read compared with a bar: {esc(', '.join(result['without_bars']))}")


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
        table = [
            [
                esc(row["id"]) + (" [bold yellow]POST-HOC[/]" if row["post_hoc"] else ""),
                *(seconds(row[key]) for key in ("gpu_s", "ceiling_gpu_s")),
                *(seconds(row["split"][part]) for part in ("load", "oracle", "steps", "external")),
                "[red]OVERRUN[/]" if row["overrun"] else "no",
            ]
            for row in rows
        ]
        columns = [Column("id", key=True, min_width=REG_ID_WIDTH)]
        columns += [Column(name, short=True) for name in ("GPU-s", "ceiling GPU-s", "load", "oracle", "steps")]
        columns += [Column("external", short=True), Column("overrun", short=True)]
        print_table(out, "costs (device-seconds)", columns, table)


@audit_app.command("calibration")
def audit_calibration(ledger: str = LedgerOption, as_json: bool = JsonOption) -> None:
    """Expectation hits per confidence level, and the Brier score."""
    from prereg.audit import audit_calibration as query

    with verb(as_json), open_ledger(ledger) as store:
        result = query(store)
        if emit(as_json, result):
            return
        table = [
            [
                row["confidence"],
                fmt(row["p"]),
                str(row["n"]),
                str(row["hits"]),
                fmt(row["hit_rate"]),
                str(row["undefined"]),
            ]
            for row in result["levels"]
        ]
        columns = [Column("confidence", short=True)]
        columns += [Column(name, short=True) for name in ("p", "scored", "hits", "hit rate", "undefined")]
        print_table(out, "calibration", columns, table)
        out.print(f"Brier score {fmt(result['brier'])} over {result['scored']} scored expectations")
        if result["post_hoc"]:
            out.print(
                f"[bold yellow]POST-HOC[/]: the verdicts of {esc(', '.join(result['post_hoc']))}"
                " stand on post-hoc amendments"
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


def print_plan(reg, *, frozen: bool = False) -> None:
    out.print(f"[bold]{esc(reg.id)}[/] — {esc(reg.title)}")
    out.print(
        f"workload {esc(reg.workload)} · profile {esc(reg.profile)} · {reg.protocol.kind}/{reg.protocol.schedule}"
        f" · {reg.protocol.steps} steps, log every {reg.protocol.log_every}, discard {reg.protocol.discard_first}"
        f" · ceiling {reg.cost.ceiling_gpu_h} GPU-h ({reg.cost.on_ceiling})"
    )
    if reg.items:
        items = []
        for item in reg.items:
            for index, oracle in enumerate(item.oracles):
                bounds = ", ".join(f"{k} ≤ {v:g}" for k, v in oracle.bounds.items()) or "—"
                first = index == 0  # an item's own cells only on its first oracle's line
                items.append(
                    [
                        esc(item.id) if first else "",
                        esc(item.switch) if first else "",
                        fmt(item.bitwise) if first else "",
                        esc(oracle.id),
                        oracle.kind,
                        esc(oracle.probe),
                        esc(bounds),
                    ]
                )
        columns = [Column("item", min_width=4), Column("switch", min_width=12), Column("bitwise", short=True)]
        columns += [Column("oracle", min_width=8), Column("kind", min_width=8), Column("probe", min_width=10)]
        print_table(out, "items and their oracles", columns + [Column("bounds", min_width=14)], items)
    rungs = [
        [esc(rung.id), esc(", ".join(rung.items) or "— (baseline)"), esc(json.dumps(reg.rung_config(rung.id)))]
        for rung in reg.protocol.rungs
    ]
    columns = [Column("rung", key=True, min_width=6), Column("items", min_width=12), Column("config", min_width=20)]
    print_table(out, "ladder", columns, rungs)
    print_effective_config(reg, "the defaults it was frozen with" if frozen else f"{reg.profile}'s current defaults")
    if reg.protocol.pass_rule:
        out.print(f"pass rule: {esc(reg.protocol.pass_rule)}")
    for name, text in reg.reads.items():
        out.print(f"read {esc(name)} = {esc(text)}")
    for rule in reg.rules:
        out.print(f"rule {esc(rule.id)}: when {esc(rule.when)} → {esc(rule.outcome)}")
    for kill in reg.kill:
        out.print(esc(f"kill {kill.id} (at {kill.at}): {kill.when}" + (f" → drops {kill.drops}" if kill.drops else "")))


def assumed_payload(values) -> list[dict[str, Any]]:
    return [{"path": v.path, "value": v.value, "reason": v.reason} for v in values]


def print_assumed(assumed: list[dict[str, Any]], source: str | None) -> None:
    """Which values are the source's and which the encoder assumed: the marked ones in a table, with their reasons."""
    if not assumed:
        if source:
            out.print(f"values: every one is the source's ({esc(source)})")
        return
    rows = [[esc(a["path"]), esc(json.dumps(a["value"])), esc(a["reason"])] for a in assumed]
    columns = [Column("field", key=True, min_width=12), Column("value", min_width=6), Column("why", min_width=20)]
    print_table(out, "values assumed by the encoder, not stated by the source", columns, rows)
    other = f"the source's ({esc(source)})" if source else "the author's"
    out.print(f"values: every other one is {other}")


def print_sensitivity(assessment) -> None:
    """The bars' table (one row per bar), then why a row has nulls and the compared reads with no bar."""
    rows = assessment.rows
    if not rows and not assessment.unresolved:
        out.print("sensitivity: no rule compares a read with a constant")
        return
    if rows:
        table = [
            [
                esc(row.read),
                esc(row.rule),
                f"{row.bar:g}",
                noise_cell(row.noise_cv, row.noise_source),
                fmt(row.mde),
                fmt(row.windows_needed),
                {True: "yes", False: "[bold red]no[/]", None: "—"}[row.powered],
            ]
            for row in rows
        ]
        columns = [Column("read", min_width=8), Column("rule", min_width=4), Column("bar", short=True)]
        columns += [Column("noise CV", min_width=8), Column("MDE", short=True), Column("windows needed", short=True)]
        title = f"sensitivity at {rows[0].windows_per_rung} read windows per rung (MDE: two-sided 5%, power 80%)"
        print_table(out, title, columns + [Column("powered", short=True)], table)
    # A read compared in several rules has the same notes in each: one line per read and note, naming the rules.
    rules_of: dict[tuple[str, str], list[str]] = {}
    for note in assessment.notes_json():
        rules_of.setdefault((note["read"], note["note"]), []).append(note["rule"])
    for (read, note), rules in rules_of.items():
        out.print(esc(f"  {read} ({', '.join(rules)}): {note}"))


def flip_cell(entry: dict[str, Any] | None) -> str:
    """A compared read's bootstrap probability of landing on the other side of its bar; `fragile` above 20%."""
    if entry is None or entry["flip_probability"] is None:
        return "—"
    mark = " [bold yellow]fragile[/]" if entry["fragile"] else ""
    return f"{entry['flip_probability']:.2f}{mark}"


def noise_cell(cv: float | None, source: str) -> str:
    if cv is not None:
        return f"{cv:.3g} ({source})"
    return "A/A at run" if source == "aa" else "—"


def print_rungs(v: dict[str, Any], workload: WorkloadDeclaration) -> None:
    """Two tables: what each rung ran and how it ended, then what it measured (the window fields every workload
    reports, then the metrics the workload's declaration marks for display)."""
    from prereg.display import cell, heading, rung_metrics

    ran = [
        [
            esc(r["rung"]),
            esc(", ".join(r["items"]) or "—"),
            fmt(r["status"]),
            str(r["windows"]),
            esc(r["why_undefined"] or ("external" if r["external"] else "")),
        ]
        for r in v["rungs"]
    ]
    columns = [Column("rung", key=True, min_width=6), Column("items", min_width=12), Column("status", short=True)]
    print_table(out, "rungs", columns + [Column("windows", short=True), Column("note", min_width=20)], ran)
    metrics = rung_metrics(workload, v["rungs"])
    measured = [[esc(r["rung"]), *(esc(cell(m, r)) for m in metrics)] for r in v["rungs"]]
    columns = [Column("rung", key=True, min_width=6)] + [Column(heading(m), min_width=6) for m in metrics]
    print_table(out, "measured over the read windows", columns, measured)


def print_effective_config(reg, defaults: str) -> None:
    """Every run-config key per rung: the value each rung runs with, a default marked (the document did not set
    it). A retired key that no rung sets is left out: it is no longer a key a document may set."""

    retired = reg.declaration().run_config.retired_keys()
    rung_ids = [r.id for r in reg.protocol.rungs]
    configs = {r: reg.effective_config(r).model_dump(mode="json") for r in rung_ids}
    rows = []
    for key in configs[rung_ids[0]]:
        if key in retired and all(configs[r][key] is None for r in rung_ids):
            continue
        cells = []
        for rung_id in rung_ids:
            value = configs[rung_id][key]
            shown = "—" if value is None else json.dumps(value)
            cells.append(esc(shown if key in reg.rung_config(rung_id) else f"· {shown}"))
        rows.append([esc(key), *cells])
    columns = [Column("key", key=True, min_width=10)] + [Column(esc(r), min_width=6) for r in rung_ids]
    print_table(out, "effective config", columns, rows)
    out.print(f"· marks a default: {esc(defaults)}")


def print_verdict(v: dict[str, Any], workload: WorkloadDeclaration) -> None:
    out.print(
        f"[bold]{esc(v['registration'])}[/] — verdict under document version {v['version']} ({v['doc_hash'][:12]})"
    )
    if v["post_hoc"]:
        out.print(f"[bold yellow]POST-HOC[/]: {esc('; '.join(v['post_hoc']))}")
    if v["dropped"]:
        dropped = []
        for item, why in v["dropped"].items():
            cause = (
                f"oracle {why['oracle']}" if why["cause"] == "oracle" else f"kill {why['kill']} on rung {why['rung']}"
            )
            dropped.append([esc(item), esc(cause), esc(why["reason"])])
        columns = [
            Column("item", min_width=4),
            Column("cause", min_width=10),
            Column("observed vs bound", min_width=20),
        ]
        print_table(out, "dropped items", columns, dropped)
    print_rungs(v, workload)
    if v["until_pass"]:
        for rejected in v["until_pass"]["rejected"]:
            out.print(esc(f"rung {rejected['rung']} {rejected['result']}: {rejected['reason']}"))
        out.print(
            f"until-pass: [bold]{esc(v['until_pass']['passed'] or 'none passed')}[/] — {esc(v['until_pass']['reason'])}"
        )
    if v["reads"]:
        reads = []
        for name, value in v["reads"].items():
            interval = v["intervals"].get(name)
            reads.append(
                [
                    esc(name),
                    esc(fmt(value)),
                    esc(f"[{interval[0]:.4g}, {interval[1]:.4g}]") if interval else "—",
                    flip_cell(v["robustness"].get(name)),
                    esc(v["undefined"].get(name, "")),
                ]
            )
        columns = [Column("read", min_width=12), Column("value", min_width=8), Column("95% interval", min_width=12)]
        columns += [Column("flip", min_width=7), Column("undefined because", min_width=20)]
        print_table(out, "reads", columns, reads)
    for name, entry in v["robustness"].items():
        if name not in v["reads"]:  # a rule compared an expression, not a named read, with its bar
            out.print(f"compared {esc(name)} with {entry['bar']:g}: flip {flip_cell(entry)}")
    for trace in v["rules"]:
        state = "undefined: " + trace["undefined"] if trace["undefined"] else fmt(trace["value"])
        out.print(esc(f"rule {trace['rule']}: {trace['when']} → {state}"))
    if v["rule"]:
        out.print(
            f"[bold]outcome: {esc(v['outcome'])}[/] (rule {esc(v['rule'])})"
            f" · land {esc(', '.join(v['land']) or '—')} · park {esc(', '.join(v['park']) or '—')}"
        )
        for entry in v["conditional_land"]:
            state = "undefined: " + entry["undefined"] if entry["undefined"] else fmt(entry["value"])
            landed = "lands" if entry["item"] in v["land"] else "parked"
            out.print(esc(f"  {entry['item']} if {entry['if']} → {state}: {landed}"))
    else:
        out.print("[bold]outcome: none[/] — no rule fired")
    if v["expectations"]:
        expectations = []
        for e in v["expectations"]:
            colour = {"hit": "green", "miss": "red"}.get(e["result"], "yellow")
            expectations.append(
                [
                    str(e["n"]) + (e.get("part") or ""),
                    esc(e["claim"]),
                    e["confidence"],
                    f"[{colour}]{e['result']}[/]" + (esc(f" ({e['why']})") if e["why"] else ""),
                ]
            )
        columns = [Column("n", short=True), Column("claim", min_width=24), Column("confidence", short=True)]
        print_table(out, "expectations", columns + [Column("result", min_width=9)], expectations)
    cost = v["cost"]
    overrun = " [red]OVERRUN[/]" if cost["overrun"] else ""
    split = cost["split"]
    out.print(
        f"cost: {cost['gpu_s']:.1f} device-s of {cost['ceiling_gpu_s']:.0f} ceiling (load {split['load']:.1f}, "
        f"oracle {split['oracle']:.1f}, steps {split['steps']:.1f}, external {split['external']:.1f}){overrun}"
    )


if __name__ == "__main__":
    app()
