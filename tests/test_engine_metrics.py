"""The engine's own metrics (rc, steps, load_s, gpu_s, world_size, finite) are declared once, for every workload,
and merged into its catalogue; a workload marks what a person is shown beside the window fields (`display`,
`label`, `format`, `plot`), and the tables and the report show that, never a name written into them."""

from __future__ import annotations

import dataclasses
import re
import shutil

import pytest
from conftest import REPO, every_workload_declaration

from engine.molmo2.declaration import METRICS as MOLMO2_METRICS
from prereg.display import cell, heading, rung_metrics
from prereg.ledger import Ledger
from prereg.registry import get_workload
from prereg.state import load_state
from prereg.workload import ENGINE_METRICS, WINDOW_FIELDS, Metric, WorkloadDeclaration

ENGINE_NAMES = {"rc", "steps", "load_s", "gpu_s", "world_size", "finite"}


def declaration(**metrics: Metric) -> WorkloadDeclaration:
    """A workload like molmo2 but for its metrics."""
    return dataclasses.replace(get_workload("molmo2"), name="toy", metrics=metrics)


def test_the_engine_declares_its_metrics_once_for_every_workload() -> None:
    assert set(ENGINE_METRICS) == ENGINE_NAMES
    assert not ENGINE_NAMES & set(MOLMO2_METRICS)  # the workload declares only its own
    for name, workload in every_workload_declaration().items():
        assert ENGINE_NAMES <= set(workload.metrics), name
    toy = declaration(s_per_step=Metric("s_per_step", "s", "median", "seconds per step"))
    assert set(toy.metrics) == {"s_per_step"} | ENGINE_NAMES


def test_a_workload_that_declares_an_engine_metric_again_is_refused() -> None:
    with pytest.raises(ValueError, match=r"metrics \['rc'\] are the engine's own.*remove them"):
        declaration(rc=Metric("rc", "code", "last", "exit status"))


def test_every_document_the_lab_froze_still_validates_with_the_engine_metrics(tmp_path) -> None:
    """Frozen documents name rc, steps and the rest in reads, pass rules and kill lines (the F1 memory ladder:
    `rc == 0 and vram_peak_gib <= 125`): every version of every one still resolves."""
    copy = tmp_path / "ledger.db"
    shutil.copyfile(REPO / "ledger.db", copy)  # a copy: tests never open the lab's ledger itself
    engine_name = re.compile(r"\b(" + "|".join(ENGINE_NAMES - {"finite"}) + r")\b")
    naming = set()
    with Ledger.open(str(copy), create=False) as ledger:
        for reg_id in ledger.reg_ids():
            state = load_state(ledger, reg_id, with_windows=False)
            for version in state.versions:
                reg = state.registration_at(version.number)  # under the defaults it was frozen with
                rules = [reg.protocol.pass_rule or "", *reg.reads.values(), *(k.when for k in reg.kill)]
                if any(engine_name.search(text) for text in rules):
                    naming.add(reg_id)
    assert "molmo2-ar-f1-h200x2" in naming  # the check reached documents that name them


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(display=True), "display = True needs a label"),
        (dict(format="%.2f"), "is not a format spec"),
        (dict(plot="Memory plot"), "must be a lowercase name"),
    ],
)
def test_display_metadata_is_checked_when_declared(bad: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Metric("peak", "GiB", "max", "a peak", **bad)


def test_one_plot_has_one_unit() -> None:
    with pytest.raises(ValueError, match="metric b_mib .MiB. is drawn on plot 'memory', whose metrics are in GiB"):
        declaration(
            a_gib=Metric("a_gib", "GiB", "max", "a", plot="memory"),
            b_mib=Metric("b_mib", "MiB", "max", "b", plot="memory"),
        )


def rung(summary: dict, spread: dict | None = None) -> dict:
    return {"summary": summary, "spread": spread or {}}


def test_a_rung_table_shows_the_window_fields_then_what_the_workload_displays() -> None:
    molmo2 = get_workload("molmo2")
    rungs = [
        rung({"s_per_step": 2.2518, "smi_peak_mib": 137717.0, "tokens_per_s": 3000.0}, {"s_per_step": [2.2, 2.3]}),
        rung({"vram_peak_gib": 66.6}),
    ]
    shown = rung_metrics(molmo2, rungs)
    # smi and vram are displayed and measured; window peak is displayed but no rung has it; tokens_per_s is not
    # displayed; vram_reserved_peak_gib neither.
    assert [m.name for m in shown] == [*WINDOW_FIELDS, "vram_peak_gib", "smi_peak_mib"]
    assert [heading(m) for m in shown] == [
        "steps",
        "s/step (median [min–max])",
        "loss",
        "finite",
        "vram peak GiB",
        "smi peak MiB",
    ]
    assert [cell(m, rungs[0]) for m in shown] == ["—", "2.252 [2.2–2.3]", "—", "—", "—", "137,717"]
    assert cell(molmo2.metrics["finite"], rung({"finite": False})) == "no"


def test_the_report_shows_and_plots_what_the_workload_declares(tmp_path) -> None:
    from engine.report.report import write_report

    copy = tmp_path / "ledger.db"
    shutil.copyfile(REPO / "ledger.db", copy)  # a copy: tests never open the lab's ledger itself
    with Ledger.open(str(copy), create=False) as ledger:
        write_report(ledger, "molmo2-ar-f1-h200x2", tmp_path / "report")
    text = (tmp_path / "report" / "report.md").read_text(encoding="utf-8")
    header = "| rung | items | status | windows | steps | s/step (median [min–max]) | loss | finite | vram peak GiB | "
    assert header + "smi peak MiB | note |" in text  # no window peak: none of its rungs measured one
    assert "| rung7 | — | finished | 5 | 10 | 7.249 [7.049–7.5] | 12.25 | yes | 96.68 | 121,653 |  |" in text
    # vram_peak_gib and vram_window_peak_gib name the plot "memory": one plot, its file named after it
    assert "### Memory per window" in text and (tmp_path / "report" / "memory.png").stat().st_size > 0
