"""The benchmarks' claims with their data: the committed bench/results/ledger_bench.json has its conditions and
figures, and every figure a document cites beside it is one of them, within the rounding it is printed at; the
governance cost counts every window's append, the last one included."""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

import pytest
from conftest import REPO, Cli, prereg_process, write

from prereg.ledger import Ledger

RESULTS = REPO / "bench" / "results" / "ledger_bench.json"
DOCUMENTS = [REPO / "README.md", REPO / "docs" / "results.md"]

# A figure: a number (1,000,000 or 3.8), or a range of two (3.8–7.9), then its unit.
FIGURE = re.compile(r"(\d[\d,]*(?:\.\d+)?)(?:\s*[–-]\s*(\d[\d,]*(?:\.\d+)?))?\s*(ms|/s|s|entries|windows|MiB)\b")


def results() -> dict:
    return json.loads(RESULTS.read_text())


def test_the_committed_results_carry_their_conditions_and_figures() -> None:
    data = results()
    assert set(data["conditions"]) >= {"cpu", "cpus", "python", "sqlite", "journal_mode", "synchronous"}
    assert data["conditions"]["synchronous"] == "FULL" and data["conditions"]["journal_mode"] == "wal"
    assert data["build"]["count"] == data["entries"] and data["repeats"] >= 1
    assert set(data["appends"]) == {"single", "batch_100", "batch_1000"}
    for name in ("verify", "audit_show", "cli_floor"):
        timed = data[name]
        assert timed["command"].startswith("prereg audit ") and len(timed["seconds"]) == data["repeats"]
        assert timed["median_s"] == round(statistics.median(timed["seconds"]), 4)
    assert data["audit_show"]["windows"] == 100_000
    assert data["verify"]["command"] == "prereg audit verify --json --ledger big.db"


def figures_by_unit(data: dict) -> dict[str, list[float]]:
    """Every value a document may cite, by the unit it is written in."""
    seconds = [data["build"]["seconds"]] + [figures["seconds"] for figures in data["appends"].values()]
    for name in ("verify", "audit_show", "cli_floor"):
        seconds += data[name]["seconds"] + [data[name]["median_s"]]
    return {
        "s": seconds,
        "ms": [s * 1000 for s in seconds],
        "/s": [data["build"]["per_s"]] + [figures["per_s"] for figures in data["appends"].values()],
        "entries": [data["entries"]],
        "windows": [data["audit_show"]["windows"]],
        "MiB": [data["build"]["db_mib"]],
    }


def within_rounding(printed: str, value: float) -> bool:
    """Whether `value` prints as `printed`: half a unit of its last decimal, or of its last non-zero digit."""
    digits = printed.replace(",", "")
    if "." in digits:
        step = 10.0 ** -len(digits.split(".")[1])
    else:
        step = 10.0 ** (len(digits) - len(digits.rstrip("0"))) if digits.strip("0") else 1.0
    return abs(float(digits) - value) <= step / 2 + 1e-9


def mismatched_figures(text: str, data: dict) -> list[str]:
    """The figures of every paragraph that cites ledger_bench.json that are none of its values."""
    known = figures_by_unit(data)
    wrong = []
    for paragraph in text.split("\n\n"):
        if "ledger_bench.json" not in paragraph:
            continue
        for match in FIGURE.finditer(paragraph):
            low, high, unit = match.groups()
            for printed in filter(None, (low, high)):
                if not any(within_rounding(printed, value) for value in known[unit]):
                    wrong.append(f"{printed} {unit}")
    return wrong


def test_the_figure_check_catches_a_figure_that_is_not_in_the_results() -> None:
    data = results()
    verify = data["verify"]["median_s"]
    cited = f"`verify` of {data['entries']:,} entries took {verify:.2f} s (bench/results/ledger_bench.json)"
    assert mismatched_figures(cited, data) == []
    assert mismatched_figures(cited.replace(f"{verify:.2f} s", f"{verify + 1:.2f} s"), data) == [f"{verify + 1:.2f} s"]
    assert mismatched_figures(f"{data['entries'] + 1000:,} entries", data) == []  # not a paragraph that cites it


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_documents_citing_the_results_cite_its_figures(document: Path) -> None:
    if not document.exists() or "ledger_bench.json" not in document.read_text():
        pytest.skip(f"{document.name} does not cite bench/results/ledger_bench.json")
    assert mismatched_figures(document.read_text(), results()) == []


# --- the governance cost on the step ---------------------------------------------------------------------------

TWO_RUNGS_INTERLEAVED = """
id = "governance-cost"
title = "governance cost: two baseline rungs in one process"
question = "Is every window append counted?"
workload = "molmo2"
profile = "cpu-tiny"

[cost]
ceiling_gpu_h = 0.5

[protocol]
schedule = "interleaved"
steps = 4
log_every = 2
config = { batch = 2, backward_chunks = 1, camera_counts = [1, 2], max_crops = 1 }
  [[protocol.rungs]]
  id = "A"
  [[protocol.rungs]]
  id = "A2"
"""


def test_the_governance_cost_counts_every_window_append(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "bench"))
    from governance_cost import governance_cost

    ledger = tmp_path / "ledger.db"
    registration = write(tmp_path, "governance-cost.toml", TWO_RUNGS_INTERLEAVED)
    Cli(ledger, tmp_path).ok("freeze", registration)
    prereg_process("run", "governance-cost", "--file", str(registration), ledger=ledger, check=True)
    store = Ledger.open(str(ledger), create=False)
    try:
        cost = governance_cost(store, "governance-cost")
        windows = [e.data for e in store.entries(reg_id="governance-cost", kinds=("window",))]
        ends = [e.data for e in store.entries(reg_id="governance-cost", kinds=("run-end",))]
    finally:
        store.close()
    assert cost.windows == len(windows) == 4
    assert cost.writes_counted == cost.windows  # the last window's append too, carried by its run's run-end
    # The process's first window has nothing before it; each later one carries the append before it.
    assert windows[0]["ledger_s"] == 0.0 and all(w["ledger_s"] > 0 for w in windows[1:])
    # One process wrote both runs: only the run whose window came last carries that append.
    assert sorted(end["ledger_s"] > 0 for end in ends) == [False, True]
    assert cost.write_s == pytest.approx(sum(w["ledger_s"] for w in windows) + sum(e["ledger_s"] for e in ends))
    assert 0 < cost.share < 1
